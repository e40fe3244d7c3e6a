"""How many tokens to draft next round, and whether to speculate at all.

The choice uses only past rounds (measured times, acceptance) and the context (a drafter's label
for its next proposal), never the current round's target output, so it cannot bias the output
distribution: exactness holds for any K.

Here: the Policy protocol, the measured costs and the fixed policies. The adaptive one is
adaptive.py (priced by the costs and acceptance), checked by observed.py (this run's round times).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol

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
        far, f = self.later, self._reach(position)
        if far is None or f is None:
            return self
        widths = dict(far.verify)
        return Costs(
            plain_step=_grow(self.plain_step, far.plain_step, f),
            draft_step=_grow(self.draft_step, far.draft_step, f),
            extra=_grow(self.extra, far.extra, f),
            verify=tuple((n, _grow(t, widths.get(n, t), f)) for n, t in self.verify),
            position=position,
        )

    def plain_at(self, position: int) -> float:
        """at(position).plain_step alone (loop.Timing prices each kept step with it, each
        round)."""
        far, f = self.later, self._reach(position)
        if far is None or f is None:
            return self.plain_step
        return _grow(self.plain_step, far.plain_step, f)

    def _reach(self, position: int) -> float | None:
        """How far `position` lies from the short context to the long one (0 at or below the
        short one, 1 at the long one); None with one context measured."""
        far = self.later
        if far is None or far.position <= self.position:
            return None
        return max(0.0, (position - self.position) / (far.position - self.position))

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


def _grow(short: float, far: float, f: float) -> float:
    """A cost `f` of the way from the short context's to the long one's, never below the short."""
    return short + max(0.0, far - short) * f


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


# Copied n-gram ids cost no draft time, so a copy may run to this many times num_draft: a long
# match (16+ ids) is followed ~93% of the time, and on a CPU a pass over 17 ids costs ~2 steps.
COPY_FACTOR = 4
