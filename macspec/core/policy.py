"""How many tokens to draft next round, and whether to speculate at all.

The choice uses only past rounds (measured times, acceptance) and the context (a drafter's label
for its next proposal), never the current round's target output, so it cannot bias the output
distribution: exactness holds for any K.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import ClassVar, Protocol

from .drafters.ngram import COPY_PRIORS
from .tree import Tree, TreeShape

# A drafter's grade of its next proposal, from the context alone (the n-gram match length);
# None = ungraded (a draft model); 0 = nothing to propose.
Label = int | None


class Policy(Protocol):
    """What chooses each round's drafts. pick and observe_tree have defaults, which a policy
    deriving from this class inherits: the drafter's default label, and nothing to learn."""

    max_k: int  # the most drafts next_k ever returns (caches keep room to take them back)

    def next_k(
        self, label: Label = None, launched: bool = False, position: int = 0
    ) -> int | TreeShape:
        """Drafts for the next round (0 = a plain step), or a token tree's shape. `launched`:
        the pass over the round's first row is already running (target.py, Target.launch);
        `position`: the tokens the target's cache holds (what every pass and draft token
        reads)."""

    def observe(self, k: int, accepted: int) -> None:
        """How many of the last speculative round's k drafts were accepted."""

    def observe_time(self, k: int | TreeShape, tokens: int, seconds: float) -> None:
        """What the last round (k drafts; 0: a plain step) emitted, before any stop, and the
        seconds it took (observed.py checks the choices against them)."""

    def expects_plain(self) -> bool:
        """After a plain step: whether the next round will be one too if its label is the
        last one's (its pass may then start before this step's id is read)."""

    def pick(self, labels: tuple[Label, ...], launched: bool = False, position: int = 0) -> Label:
        """One of `labels`, for a drafter that offers several kinds of proposal
        (HybridDrafter.labels): by default the first, the drafter's own default."""
        return labels[0]

    def observe_tree(self, tree: Tree, path: list[int], seconds: float = 0.0) -> None:
        """A token tree's round: the tree, its accepted path and the round's seconds."""


@dataclass(frozen=True)
class Costs:
    """Seconds measured once per loaded pair on this machine (see measure.py).

    They are frozen so that K depends only on costs and on the seeded acceptance history: the
    same seed then gives the same tokens, which live timings would not."""

    plain_step: float  # one plain target step
    draft_step: float  # one draft token (a model draft; copied n-gram ids cost nothing)
    extra: float  # verification cost of one more position beyond a plain step (linear model)
    # Measured passes: (k, seconds of one target pass over 1 + k positions). On CPUs the cost is
    # far from linear in k (the README's pass costs), so one slope mis-prices short and long ones.
    verify: tuple[tuple[int, float], ...] = ()
    position: int = 0  # the context length (cached tokens) these were measured after
    # The same measured after a long context: every pass and draft token reads all cached
    # positions, so costs grow with the context (README: the default pair fell below plain
    # decoding after 2,000 tokens when priced at a short context's costs).
    later: Costs | None = None
    measured: float = 0.0  # when (time.time()); a long measurement may be kept across loads

    def at(self, position: int) -> Costs:
        """These costs after `position` cached tokens: each one linear in the context length
        through the two measured contexts (extended past the long one), never below the short
        context's."""
        far = self.later
        if far is None or far.position <= self.position:
            return self
        f = max(0.0, (position - self.position) / (far.position - self.position))

        def grow(a: float, b: float) -> float:
            return a + max(0.0, b - a) * f

        widths = dict(far.verify)
        return Costs(
            plain_step=grow(self.plain_step, far.plain_step),
            draft_step=grow(self.draft_step, far.draft_step),
            extra=grow(self.extra, far.extra),
            verify=tuple((n, grow(t, widths.get(n, t))) for n, t in self.verify),
            position=position,
        )

    def pass_time(self, k: int) -> float:
        """Seconds of a target pass verifying k drafts: interpolated between the measured
        passes, extended with the last measured slope, or plain_step + k * extra without any."""
        points = [(0, self.plain_step), *self.verify]
        if len(points) == 1:
            return self.plain_step + k * self.extra
        for (k0, t0), (k1, t1) in pairwise(points):
            if k <= k1:
                return t0 + (t1 - t0) * (k - k0) / (k1 - k0)
        return t1 + max(t1 - t0, 0.0) / (k1 - k0) * (k - k1)


@dataclass
class FixedTree(Policy):
    """Always a token tree of this shape for the draft model's proposals (copied n-grams: a
    chain of the tree's depth): for comparisons and tests."""

    shape: TreeShape
    _nothing: bool = False  # the last label said there was nothing to propose

    @property
    def max_k(self) -> int:
        return self.shape.max_k

    def next_k(
        self, label: Label = None, launched: bool = False, position: int = 0
    ) -> int | TreeShape:
        self._nothing = label == 0
        if label == 0:
            return 0
        return self.shape if label is None else self.shape.depth

    def observe(self, k: int, accepted: int) -> None:
        pass

    def observe_time(self, k: int | TreeShape, tokens: int, seconds: float) -> None:
        pass

    def expects_plain(self) -> bool:
        return self._nothing


@dataclass
class FixedK(Policy):
    """Always k drafts (adaptive=False): for comparisons and tests. Label 0 (nothing to
    propose) is a plain step."""

    k: int
    _nothing: bool = False  # the last label said there was nothing to propose

    @property
    def max_k(self) -> int:
        return self.k

    def next_k(self, label: Label = None, launched: bool = False, position: int = 0) -> int:
        self._nothing = label == 0
        return 0 if label == 0 else self.k

    def observe(self, k: int, accepted: int) -> None:
        pass

    def observe_time(self, k: int | TreeShape, tokens: int, seconds: float) -> None:
        pass

    def expects_plain(self) -> bool:
        return self._nothing


@dataclass
class _Arm:
    """Acceptance statistics and fallback state of one kind of proposal (one label).

    Acceptance is tracked per draft position, as P(draft i accepted | drafts 1..i-1 accepted):
    a draft model's later positions build on its own guesses and fare worse (the default
    SmolLM2 draft: 0.44 at position 1, 0.15 at position 2 on a chat answer), so one geometric
    rate would overrate K >= 2 and underrate K = 1. Counts decay by `DECAY` per round (a window
    of about ten rounds); each position is shrunk towards the one before it (towards `prior` for
    position 1) with the weight of one round, so positions never drafted yet borrow it."""

    prior: float = 0.6  # acceptance expected at position 1 before any round
    accepts: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)
    backoff: int = 8
    skips_left: int = 0  # plain steps before the next probe round
    probing: bool = False

    DECAY: ClassVar[float] = 0.9

    def rates(self, k: int) -> list[float]:
        """Conditional acceptance estimates for positions 1..k."""
        out, before = [], self.prior
        for i in range(k):
            a, t = (self.accepts[i], self.trials[i]) if i < len(self.trials) else (0.0, 0.0)
            before = (a + before) / (t + 1.0)
            out.append(before)
        return out

    @property
    def alpha(self) -> float:
        """Acceptance estimate of the first draft position."""
        return self.rates(1)[0]

    def expected_tokens(self, k: int) -> float:
        """Tokens a k-draft round emits on average: 1 + sum over i of P(drafts 1..i accepted)."""
        total, run = 1.0, 1.0
        for rate in self.rates(k):
            run *= rate
            total += run
        return total

    def carried(self, weight: float) -> _Arm:
        """A new generation's start from this arm: its counts scaled to at most `weight` rounds
        (what this pair's drafts were accepted at, soon outweighed by the new content's), and
        no fallback pending."""
        f = min(1.0, weight / self.trials[0]) if self.trials and self.trials[0] > 0 else 1.0
        return _Arm(
            prior=self.prior,
            accepts=[f * a for a in self.accepts],
            trials=[f * t for t in self.trials],
        )

    def observe(self, k: int, accepted: int) -> None:
        """Positions 1..accepted were accepted; position accepted+1, if drafted, was not."""
        reached = min(accepted + 1, k)
        while len(self.trials) < reached:
            self.accepts.append(0.0)
            self.trials.append(0.0)
        for i in range(len(self.trials)):
            self.accepts[i] = self.DECAY * self.accepts[i] + (i < accepted)
            self.trials[i] = self.DECAY * self.trials[i] + (i < reached)


@dataclass
class _PairArm(_Arm):
    """A label's acceptance over a loaded pair's generations (AdaptiveK.kept): a window of
    about fifty rounds, so that one answer the draft did poorly on does not decide the next."""

    DECAY: ClassVar[float] = 0.98


@dataclass
class AdaptiveK:
    """Pick K maximising expected tokens per second; fall back to plain decoding (K = 0) when
    even the best K is expected to lose against it, and probe again later.

    Time of a round: k * draft_step + the measured pass over 1 + k positions (Costs.pass_time);
    tokens: 1 + the chance that drafts 1..i are all accepted, summed over i <= k, from running
    per-position estimates of past rounds (_Arm). Proposals with different labels keep separate
    estimates: a 4-gram match of a summary is accepted ~90% of the time, a 1-gram match ~15%
    (SmolLM2, measured), so one pooled rate would draft too much after weak matches and too
    little after strong ones. Labelled (copied) proposals cost no draft time and may run up to
    `copy_max` ids; model drafts up to `k_max`."""

    k_max: int
    costs: Costs
    margin: float = 1.0  # speculate only if expected speed >= margin x plain speed
    probe_after: int = 8
    copy_max: int | None = None  # cap for labelled proposals (default: k_max)
    # Acceptance expected at position 1 per label before any round (the drafter's knowledge of
    # what its labels mean); a label not listed starts at _Arm's default.
    priors: dict = field(default_factory=dict)
    arms: dict = field(default_factory=dict)
    # The pair's acceptance over its generations (label -> _PairArm), kept up to date here: a
    # label's first arm starts from its kept one (_Arm.carried) where that beats the prior,
    # which may be far below this pair's acceptance and would decide every answer's start.
    kept: dict | None = None
    _last: Label = None
    _now: Costs | None = None  # the costs at the context of the round being chosen
    _at: int = -1

    PRICE_STEP: ClassVar[int] = 64  # positions between two re-pricings of the costs
    CARRY: ClassVar[float] = 4.0  # rounds' weight an earlier generation's acceptance keeps

    @property
    def max_k(self) -> int:
        return max(self.k_max, self.copy_max or self.k_max)

    @property
    def now(self) -> Costs:
        return self._now or self.costs

    def price(self, position: int) -> None:
        """Price rounds after `position` cached tokens from now on (Costs.at)."""
        at = position // self.PRICE_STEP * self.PRICE_STEP
        if at != self._at:
            self._at, self._now = at, self.costs.at(at)

    def arm(self, label: Label) -> _Arm:
        if label not in self.arms:
            arm = _Arm(prior=self.priors.get(label, _Arm.prior))
            before = None if self.kept is None else self.kept.get(label)
            # Only a history better than the prior is carried: a false fallback (8, 16, 32
            # plain steps) costs more than the few losing rounds that find a poor draft.
            if before is not None and before.alpha > arm.alpha:
                arm = before.carried(self.CARRY)
            arm.backoff = self.probe_after
            self.arms[label] = arm
        return self.arms[label]

    @property
    def alpha(self) -> float:
        """Acceptance estimate of the ungraded (model) proposals."""
        return self.arm(None).alpha

    def expected_speed(self, k: int, label: Label = None) -> float:
        c = self.now
        draft = 0.0 if label is not None else c.draft_step
        return self.arm(label).expected_tokens(k) / (k * draft + c.pass_time(k))

    def marginal_speed(self, k: int, label: Label = None) -> float:
        """With the first row's pass already running: the tokens beyond its one per second of
        the pass over the k drafts (and their drafting) that speculating adds."""
        c = self.now
        draft = 0.0 if label is not None else c.draft_step
        return (self.arm(label).expected_tokens(k) - 1.0) / (k * draft + c.pass_time(k - 1))

    def best_k(self, label: Label = None, launched: bool = False) -> int:
        cap = self.k_max if label is None else (self.copy_max or self.k_max)
        speed = self.marginal_speed if launched else self.expected_speed
        return max(range(1, cap + 1), key=lambda k: speed(k, label))

    def pick(self, labels: tuple[Label, ...], launched: bool = False, position: int = 0) -> Label:
        """Of the labels a drafter offers for its next proposal, the first (its default: a
        hybrid's draft model) while it is expected to beat plain decoding, else the one whose
        best K is expected to emit the most tokens a second of those that are: each from its
        own acceptance as observed so far (its arm), priced by the measured costs (a copy
        drafts for free, the model pays draft_step a token). The default keeps drafting where it
        pays, so its acceptance stays observed (picked by speed alone, a draft that missed its
        first rounds lost every short match to copies and was never seen to recover). A label
        passed over while falling back counts the round in its plain stretch."""
        self.price(position)
        speed = self.marginal_speed if launched else self.expected_speed
        default, *others = labels
        winners = [a for a in others if not self.loses(a, launched)]
        if not winners or not self.loses(default, launched):
            return default
        best = max(winners, key=lambda a: speed(self.best_k(a, launched), a))
        for label in labels:
            arm = self.arm(label)
            if label != best and arm.skips_left > 0:
                arm.skips_left -= 1
                arm.probing = arm.skips_left == 0
        return best

    def loses(self, label: Label, launched: bool = False) -> bool:
        """Whether a proposal with this label would be a plain step now (falling back, or its
        best K priced below plain decoding); not while its probe is due."""
        arm = self.arm(label)
        if arm.probing:
            return False
        if arm.skips_left > 0:
            return True
        speed = self.marginal_speed if launched else self.expected_speed
        return speed(self.best_k(label, launched), label) < self.margin / self.now.plain_step

    def next_k(self, label: Label = None, launched: bool = False, position: int = 0) -> int:
        self._last = label
        self.price(position)
        if label == 0:
            return 0
        arm = self.arm(label)
        if arm.skips_left > 0:
            arm.skips_left -= 1
            arm.probing = arm.skips_left == 0
            return 0
        if launched:
            # The launched pass gives a token by itself: drafts must pay for their own pass at
            # plain speed. Not evidence against the label: its probing schedule is kept.
            k = self.best_k(label, launched=True)
            return k if self.marginal_speed(k, label) >= self.margin / self.now.plain_step else 0
        k = self.best_k(label)
        if arm.probing:
            arm.probing = False  # one speculative round to see whether drafting helps now
            return k
        if self.expected_speed(k, label) < self.margin / self.now.plain_step:
            # Losing: decode plainly for a while (longer each time), then probe.
            arm.skips_left = arm.backoff - 1
            # Capped: a probe costs one losing round, so probing every 32 steps wastes under
            # 1% and catches a draft that starts helping again (a new paragraph, a quote).
            arm.backoff = min(arm.backoff * 2, 32)
            return 0
        arm.backoff = self.probe_after
        return k

    def observe(self, k: int, accepted: int) -> None:
        if k > 0:
            self.arm(self._last).observe(k, accepted)
            if self.kept is not None:
                prior = self.priors.get(self._last, _Arm.prior)
                self.kept.setdefault(self._last, _PairArm(prior=prior)).observe(k, accepted)

    def observe_time(self, k: int | TreeShape, tokens: int, seconds: float) -> None:
        pass  # priced by the measured costs alone (Observed adds the round times)

    def expects_plain(self) -> bool:
        return self._last == 0 or self.arm(self._last).skips_left > 0


# Copied n-gram ids cost no draft time, so a copy may run to this many times num_draft: a long
# match (16+ ids) is followed ~93% of the time, and on a CPU a pass over 17 ids costs ~2 steps.
COPY_FACTOR = 4


def adaptive(
    num_draft: int, costs: Costs, tree_nodes: int = 0, kept: dict | None = None
) -> AdaptiveK | AdaptiveTree:
    """The default policy: K up to num_draft for model drafts, copies up to COPY_FACTOR times
    that, each copy graded by its match length from its measured prior (or from `kept`, the
    pair's acceptance in earlier generations: AdaptiveK.kept); with `tree_nodes`, token trees
    of up to that many candidates where they are expected to pay."""
    chain = AdaptiveK(
        num_draft, costs, copy_max=COPY_FACTOR * num_draft, priors=COPY_PRIORS, kept=kept
    )
    if not tree_nodes:
        return chain
    shapes = tuple(TreeShape(num_draft, width, tree_nodes) for width in (2, 3))
    return AdaptiveTree(chain, shapes)


@dataclass
class _Speed:
    """Decaying totals of what one tree shape's rounds emitted and took."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: float = 0.0


@dataclass
class AdaptiveTree:
    """AdaptiveK, which also weighs token trees for the draft model's proposals.

    A tree of shape s is priced, before it has run, like a chain of its depth that pays the
    calibrated pass over all its rows (no credit for the extra candidates: trees must earn it);
    once run, by the tokens per second its recent rounds measured (decaying by DECAY a round).
    The better of the best chain and the best tree is drafted; each shape is tried again every
    PROBE_EVERY model rounds so a change (a paragraph the draft knows) is noticed. Copies and
    the decision to speculate at all stay AdaptiveK's."""

    chain: AdaptiveK
    shapes: tuple[TreeShape, ...]
    speed: dict = field(default_factory=dict)  # shape -> _Speed
    since: dict = field(default_factory=dict)  # shape -> model rounds since it last ran
    _last: TreeShape | None = None

    DECAY: ClassVar[float] = 0.9
    PROBE_EVERY: ClassVar[int] = 32

    @property
    def max_k(self) -> int:
        return max(self.chain.max_k, *(s.max_k for s in self.shapes))

    def __post_init__(self) -> None:
        # The first probe of each shape comes after a few model rounds, not PROBE_EVERY.
        self.since = {s: self.PROBE_EVERY - 8 for s in self.shapes}

    def tree_speed(self, s: TreeShape) -> float:
        seen = self.speed.get(s)
        if seen is not None and seen.rounds > 0.5:
            return seen.tokens / seen.seconds
        c = self.chain.now
        tokens = self.chain.arm(None).expected_tokens(s.depth)
        return tokens / (s.depth * c.draft_step + c.pass_time(s.max_nodes))

    def next_k(
        self, label: Label = None, launched: bool = False, position: int = 0
    ) -> int | TreeShape:
        self._last = None
        k = self.chain.next_k(label, launched, position)
        if label is not None or k == 0 or launched:  # (a tree's root is in its own pass)
            return k
        for s in self.shapes:
            self.since[s] += 1
        due = [s for s in self.shapes if self.since[s] > self.PROBE_EVERY]
        best = max(self.shapes, key=self.tree_speed)
        if due or self.tree_speed(best) > self.chain.expected_speed(k):
            self._last = due[0] if due else best
            self.since[self._last] = 0
            return self._last
        return k

    def pick(self, labels: tuple[Label, ...], launched: bool = False, position: int = 0) -> Label:
        return self.chain.pick(labels, launched, position)  # (trees: the model's alone)

    def observe(self, k: int, accepted: int) -> None:
        self.chain.observe(k, accepted)

    def observe_time(self, k: int | TreeShape, tokens: int, seconds: float) -> None:
        pass  # its shapes' speeds come from observe_tree

    def expects_plain(self) -> bool:
        return self.chain.expects_plain()

    def observe_tree(self, tree: Tree, path: list[int], seconds: float = 0.0) -> None:
        if self._last is None:
            return
        seen = self.speed.setdefault(self._last, _Speed())
        seen.tokens = self.DECAY * seen.tokens + len(path) + 1
        seen.seconds = self.DECAY * seen.seconds + seconds
        seen.rounds = self.DECAY * seen.rounds + 1
