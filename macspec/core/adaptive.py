"""The adaptive policy: K (or a token tree) priced by measured costs and observed acceptance.

Like every policy it reads only past rounds and the context (the drafter's label for its next
proposal), never the current round's target output, so exactness holds whatever it picks.
observed.py checks its choices against this machine's round times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .drafters.ngram import COPY_PRIORS
from .policy import COPY_FACTOR, Costs, Label, Policy
from .tally import Backoff, Decision, Tally
from .tree import Tree, TreeShape

PRIOR = 0.6  # acceptance expected at position 1 of a label with no prior of its own
ARM_DECAY = 0.9  # a generation's acceptance: a window of about ten rounds
PAIR_DECAY = 0.98  # a pair's over its generations: about fifty, so one poor answer is not all

# The reasons a decision gives (Decision.reason), one per kind of choice.
NOTHING = "nothing to propose"
LOSES = "priced below plain"
RUNNING = "a plain pass already running"
PAYS = "priced to pay"
PROBE = "probe"
TREE = "tree priced faster"
TREE_PROBE = "tree probe"


def name(label: Label) -> str:
    """The kind of proposal a label stands for, in words."""
    return "model" if label is None else f"copy of a {label}-id match"


@dataclass
class Arm:
    """Acceptance of one kind of proposal (one label), per draft position.

    Tracked per position as P(draft i accepted | drafts 1..i-1 accepted): a draft model's later
    positions build on its own guesses and fare worse (the default SmolLM2 draft: 0.44 at
    position 1, 0.15 at position 2 on a chat answer), so one geometric rate would overrate
    K >= 2 and underrate K = 1. Each position is shrunk towards the one before it (towards
    `prior` for position 1) with the weight of one round, so positions never drafted yet
    borrow it."""

    prior: float = PRIOR
    decay: float = ARM_DECAY
    positions: list[Tally] = field(default_factory=list)  # accepted / drafted, by position

    def rates(self, k: int) -> list[float]:
        """Conditional acceptance estimates for positions 1..k."""
        out, before = [], self.prior
        for i in range(k):
            t = self.positions[i] if i < len(self.positions) else None
            a, n = (t.total, t.count) if t is not None else (0.0, 0.0)
            before = (a + before) / (n + 1.0)
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

    def carried(self, weight: float) -> Arm:
        """A new generation's start from this (kept) arm: its counts scaled to at most
        `weight` rounds (what this pair's drafts were accepted at, soon outweighed by the new
        content's)."""
        first = self.positions[0].count if self.positions else 0.0
        f = min(1.0, weight / first) if first > 0 else 1.0
        kept = [Tally(ARM_DECAY, f * t.total, f * t.count) for t in self.positions]
        return Arm(prior=self.prior, positions=kept)

    def observe(self, k: int, accepted: int) -> None:
        """Positions 1..accepted were accepted; position accepted+1, if drafted, was not."""
        reached = min(accepted + 1, k)
        while len(self.positions) < reached:
            self.positions.append(Tally(self.decay))
        for i, t in enumerate(self.positions):
            t.add(i < accepted, i < reached)


@dataclass
class Trees:
    """Token trees for the draft model's proposals, weighed against its best chain.

    A tree of shape s is priced, before it has run, like a chain of its depth that pays the
    calibrated pass over all its rows (no credit for the extra candidates: trees must earn
    it); once run, by the tokens per second its recent rounds measured. A shape the model
    rounds pass over backs off as a losing K does (Backoff: tried again after 8 model rounds,
    then 16, up to 32), so a change (a paragraph the draft knows) is noticed; the first try
    comes after FIRST_PROBE rounds."""

    shapes: tuple[TreeShape, ...]
    speed: dict[TreeShape, Tally] = field(default_factory=dict)  # tokens / seconds
    backoffs: dict[TreeShape, Backoff] = field(default_factory=dict)
    last: TreeShape | None = None  # the shape of the round being run

    DECAY: ClassVar[float] = 0.9
    FIRST_PROBE: ClassVar[int] = 8
    MAX_WAIT: ClassVar[int] = 32

    def __post_init__(self) -> None:
        for s in self.shapes:  # each first tried after FIRST_PROBE model rounds
            b = self.backoffs[s] = Backoff(self.FIRST_PROBE, self.MAX_WAIT)
            b.left = self.FIRST_PROBE

    def tree_speed(self, s: TreeShape, arm: Arm, costs: Costs) -> float:
        seen = self.speed.get(s)
        if seen is not None and seen.rounds > 0.5:
            return seen.mean
        tokens = arm.expected_tokens(s.depth)
        return tokens / (s.depth * costs.draft_step + costs.pass_time(s.max_nodes))

    def choose(self, arm: Arm, costs: Costs, chain: float) -> Decision | None:
        """A tree for this model round, where one's probe is due or one is priced faster than
        the chain's `chain` tokens a second; else None (the chain runs)."""
        due = next((s for s in self.shapes if self.backoffs[s].due), None)
        best = max(self.shapes, key=lambda s: self.tree_speed(s, arm, costs))
        speed = self.tree_speed(best, arm, costs)
        self.last = due or (best if speed > chain else None)
        for s in self.shapes:  # a shape passed over rests, as a losing choice does
            b = self.backoffs[s]
            if s == due:
                b.probe()  # runs now
            elif s == self.last:
                b.win()
            elif b.resting:
                b.skip()
            elif not b.due:
                b.lose()
        if due is not None:
            waited = self.backoffs[due].waited
            return Decision(due, TREE_PROBE, f"after {waited} model rounds without it")
        if self.last is None:
            return None
        return Decision(self.last, TREE, f"{speed / chain:.2f}x the best chain's speed")

    def observe(self, path: list[int], seconds: float) -> None:
        if self.last is not None:
            self.speed.setdefault(self.last, Tally(self.DECAY)).add(len(path) + 1, seconds)


@dataclass
class AdaptiveK(Policy):
    """Pick K maximising expected tokens per second; fall back to plain decoding (K = 0) when
    even the best K is expected to lose against it, and probe again later (Backoff).

    Time of a round: k * draft_step + the measured pass over 1 + k positions (Costs.pass_time);
    tokens: 1 + the chance that drafts 1..i are all accepted, summed over i <= k, from each
    label's Arm. Proposals with different labels keep separate estimates: a 4-gram match of a
    summary is accepted ~90% of the time, a 1-gram match ~15% (SmolLM2, measured), so one pooled
    rate would draft too much after weak matches and too little after strong ones. Labelled
    (copied) proposals cost no draft time and may run up to `copy_max` ids; model drafts up to
    `k_max`; with `trees`, the model's rounds may be token trees (Trees). `decide` makes every
    choice and says why (Decision); `decision` is the last one."""

    k_max: int
    costs: Costs
    margin: float = 1.0  # speculate only if expected speed >= margin x plain speed
    probe_after: int = 8  # plain steps after the first loss (Backoff.first)
    copy_max: int | None = None  # cap for labelled proposals (default: k_max)
    # Acceptance expected at position 1 per label before any round (the drafter's knowledge of
    # what its labels mean); a label not listed starts at PRIOR.
    priors: dict[Label, float] = field(default_factory=dict)
    arms: dict[Label, Arm] = field(default_factory=dict)
    # The pair's acceptance over its generations (label -> Arm at PAIR_DECAY), kept up to date
    # here: a label's first arm starts from its kept one (Arm.carried) where that beats the
    # prior, which may be far below this pair's acceptance and would decide every answer's start.
    kept: dict[Label, Arm] | None = None
    trees: Trees | None = None
    backoffs: dict[Label, Backoff] = field(default_factory=dict)
    decision: Decision = Decision(0, NOTHING)
    _last: Label = None
    _now: Costs | None = None  # the costs at the context of the round being chosen
    _at: int = -1

    PRICE_STEP: ClassVar[int] = 64  # positions between two re-pricings of the costs
    CARRY: ClassVar[float] = 4.0  # rounds' weight an earlier generation's acceptance keeps
    # A probe costs one losing round: probing every 32 steps wastes under 1% and catches a draft
    # that starts helping again (a new paragraph, a quote).
    MAX_WAIT: ClassVar[int] = 32

    @property
    def max_k(self) -> int:
        chains = max(self.k_max, self.copy_max or self.k_max)
        shapes = self.trees.shapes if self.trees is not None else ()
        return max((chains, *(s.max_k for s in shapes)))

    @property
    def now(self) -> Costs:
        return self._now or self.costs

    def price(self, position: int) -> None:
        """Price rounds after `position` cached tokens from now on (Costs.at)."""
        at = position // self.PRICE_STEP * self.PRICE_STEP
        if at != self._at:
            self._at, self._now = at, self.costs.at(at)

    def arm(self, label: Label) -> Arm:
        if label not in self.arms:
            arm = Arm(prior=self.priors.get(label, PRIOR))
            before = None if self.kept is None else self.kept.get(label)
            # Only a history better than the prior is carried: a false fallback (8, 16, 32
            # plain steps) costs more than the few losing rounds that find a poor draft.
            if before is not None and before.alpha > arm.alpha:
                arm = before.carried(self.CARRY)
            self.arms[label] = arm
        return self.arms[label]

    def backoff(self, label: Label) -> Backoff:
        """The label's fallback schedule (this generation's: a fallback is never carried)."""
        return self.backoffs.setdefault(label, Backoff(self.probe_after, self.MAX_WAIT))

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
            if label != best:
                self.backoff(label).skip()
        return best

    def loses(self, label: Label, launched: bool = False) -> bool:
        """Whether a proposal with this label would be a plain step now (falling back, or its
        best K priced below plain decoding); not while its probe is due."""
        backoff = self.backoff(label)
        if backoff.due:
            return False
        if backoff.resting:
            return True
        speed = self.marginal_speed if launched else self.expected_speed
        return speed(self.best_k(label, launched), label) < self.margin / self.now.plain_step

    def next_k(
        self, label: Label = None, launched: bool = False, position: int = 0
    ) -> int | TreeShape:
        return self.decide(label, launched, position).k

    def decide(self, label: Label = None, launched: bool = False, position: int = 0) -> Decision:
        """The next round's drafts (0: a plain step) and why; kept as `decision`."""
        self._last = label
        self.price(position)
        if self.trees is not None:
            self.trees.last = None
        self.decision = self._chain(label, launched)
        if label is None and self.decision.k != 0 and not launched and self.trees is not None:
            # (a tree's root is in its own pass: never over a launched one)
            chain = self.expected_speed(self.decision.k)
            tree = self.trees.choose(self.arm(None), self.now, chain)
            self.decision = tree or self.decision
        return self.decision

    def _chain(self, label: Label, launched: bool) -> Decision:
        """The choice among chains of drafts (0: a plain step), and why."""
        if label == 0:
            return Decision(0, NOTHING)
        backoff = self.backoff(label)
        if backoff.resting:
            backoff.skip()
            return Decision(0, LOSES, f"{name(label)} backing off, probe in {backoff.left + 1}")
        plain = self.margin / self.now.plain_step
        if launched:
            # The launched pass gives a token by itself: drafts must pay for their own pass at
            # plain speed. Not evidence against the label: its back-off is kept.
            k = self.best_k(label, launched=True)
            speed = self.marginal_speed(k, label)
            detail = self._detail(label, k, speed, "over the running pass")
            return Decision(k, PAYS, detail) if speed >= plain else Decision(0, RUNNING, detail)
        k = self.best_k(label)
        speed = self.expected_speed(k, label)
        detail = self._detail(label, k, speed, "expected")
        if backoff.probe():
            return Decision(k, PROBE, detail)  # one round to see whether drafting helps now
        if speed < plain:
            backoff.lose()
            return Decision(0, LOSES, detail)
        backoff.win()
        return Decision(k, PAYS, detail)

    def _detail(self, label: Label, k: int, speed: float, what: str) -> str:
        """The figures behind a choice: "model K=2: expected 0.83x plain (acceptance 0.31)"."""
        ratio = speed * self.now.plain_step
        alpha = self.arm(label).alpha
        return f"{name(label)} K={k}: {what} {ratio:.2f}x plain (acceptance {alpha:.2f})"

    def observe(self, k: int, accepted: int) -> None:
        if k > 0:
            self.arm(self._last).observe(k, accepted)
            if self.kept is not None:
                prior = self.priors.get(self._last, PRIOR)
                kept = self.kept.setdefault(self._last, Arm(prior=prior, decay=PAIR_DECAY))
                kept.observe(k, accepted)

    def observe_time(self, k: int | TreeShape, tokens: int, seconds: float) -> None:
        pass  # priced by the measured costs alone (observed.py adds the round times)

    def observe_tree(self, tree: Tree, path: list[int], seconds: float = 0.0) -> None:
        if self.trees is not None:
            self.trees.observe(path, seconds)

    def expects_plain(self) -> bool:
        return self._last == 0 or self.backoff(self._last).resting


def adaptive(
    num_draft: int, costs: Costs, tree_nodes: int = 0, kept: dict[Label, Arm] | None = None
) -> AdaptiveK:
    """The default policy: K up to num_draft for model drafts, copies up to COPY_FACTOR times
    that, each copy graded by its match length from its measured prior (or from `kept`, the
    pair's acceptance in earlier generations: AdaptiveK.kept); with `tree_nodes`, token trees
    of up to that many candidates where they are expected to pay."""
    shapes = tuple(TreeShape(num_draft, width, tree_nodes) for width in (2, 3))
    trees = Trees(shapes) if tree_nodes else None
    copy_max = COPY_FACTOR * num_draft
    return AdaptiveK(
        num_draft, costs, copy_max=copy_max, priors=COPY_PRIORS, kept=kept, trees=trees
    )
