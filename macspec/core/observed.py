"""The adaptive policy checked against the round times this machine actually shows.

The inner policy (policy.py) prices rounds with costs measured once at load; those may be wrong
for this run (another process, a kernel whose wide passes cost more than measured, draft time
the filler did not see). Observed keeps, per arm, the seconds each emitted token really took,
and lets a round speculate only where that beats the plain steps of the same run.

Like the inner policy it reads only past rounds and the drafter's label, never the current
round's output: it changes how many drafts are proposed, never whether one is accepted, so the
output distribution is the target's whatever it picks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .policy import Label, Policy
from .tree import Tree, TreeShape

# A speculative arm: the drafter's label (None: the draft model; n: an n-gram copy of match
# bucket n) and the K (or token tree) the round was given.
Arm = tuple[Label, int | TreeShape]


@dataclass
class Tally:
    """Decaying totals of one arm: each new round counts 1, older ones DECAY times less."""

    seconds: float = 0.0
    tokens: float = 0.0
    rounds: float = 0.0
    runs: int = 0  # rounds ever added (not decayed)

    DECAY: ClassVar[float] = 0.8  # about the last five rounds of the arm

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds = self.DECAY * self.seconds + seconds
        self.tokens = self.DECAY * self.tokens + tokens
        self.rounds = self.DECAY * self.rounds + 1.0
        self.runs += 1

    def fade(self, rounds: int) -> None:
        """As if `rounds` rounds of other arms had been added since (a stretch of plain steps)."""
        f = self.DECAY**rounds
        self.seconds, self.tokens, self.rounds = f * self.seconds, f * self.tokens, f * self.rounds

    @property
    def per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens > 0 else float("inf")


@dataclass
class Observations:
    """What a loaded pair's rounds took, kept across its generations (as loop.Timing): plain
    steps, every speculative arm, and how long each label waits between probes."""

    plain: Tally = field(default_factory=Tally)
    arms: dict[Arm, Tally] = field(default_factory=dict)
    waits: dict[Label, int] = field(default_factory=dict)  # vetoed rounds between two probes
    vetoed: dict[Label, int] = field(default_factory=dict)  # vetoed rounds since the last probe
    resting: set = field(default_factory=set)  # labels whose last proposal was vetoed
    # label -> the inner policy's acceptance estimates (policy.AdaptiveK.kept), for the next
    # generation to start from
    acceptance: dict = field(default_factory=dict)


def _depth(k: int | TreeShape) -> int:
    return k.depth if isinstance(k, TreeShape) else k


@dataclass
class Observed:
    """The inner policy's choice, kept only where observed round times say it pays.

    Choice rule, per round with label L, where p = seconds of a plain step and s(a) = seconds per
    emitted token of arm a, both decaying averages of this pair's own rounds:
      - the inner policy proposes k (priced by the measured costs); k = 0 is a plain step;
      - an arm (L, k) run fewer than two times yet is run (a first look);
      - else (L, k) is run if s(L, k) <= (1 + slack) * p (it pays);
      - else, after `waits[L]` rounds in place of it, the proposed arm runs once (a probe, its
        old rounds faded as if those rounds had been its own); each losing probe doubles the
        wait, from FIRST_WAIT up to MAX_WAIT rounds; a winning one resets it;
      - else the run arm (L, j), j < k, with the least s, if it pays (a cheaper K in place of
        the losing one), or a plain step.
    A new generation (new content) starts every label's wait at FIRST_WAIT again; the tallies,
    which say what this machine's rounds cost, are kept.
    """

    inner: Policy
    seen: Observations = field(default_factory=Observations)
    # An arm loses when its seconds per token exceed plain's by more than this: on a shared
    # machine round times swing by more, and the inner policy already prices the close cases.
    slack: float = 0.2
    _arm: Arm | None = None  # the arm of the round being run (None: a plain step)
    _label: Label = None  # the label of the round being run
    _vetoing: bool = False  # the last choice was a plain step in place of a losing arm
    _probing: bool = False  # the round being run is a probe of a losing arm

    FIRST_WAIT: ClassVar[int] = 8
    FIRST_LOOK: ClassVar[int] = 2  # rounds an arm runs before it can lose
    # A probe costs at most one losing round: one every 64 steps wastes little and still
    # catches the draft helping again (a passage it knows, code that repeats itself).
    MAX_WAIT: ClassVar[int] = 64

    @property
    def max_k(self) -> int:
        return self.inner.max_k

    def next_k(
        self, label: Label = None, launched: bool = False, position: int = 0
    ) -> int | TreeShape:
        k = self.inner.next_k(label, launched, position)
        self._arm, self._label, self._vetoing, self._probing = None, label, False, False
        if k == 0:
            return 0
        k = self.choose(label, k)
        if k != 0:
            self._arm = (label, k)
        (self.seen.resting.add if self._vetoing else self.seen.resting.discard)(label)
        return k

    def pick(self, labels: tuple[Label, ...], launched: bool = False, position: int = 0) -> Label:
        """Of the labels a drafter offers (a hybrid's short match: its model or a copy), the
        inner policy's pick among those not resting: a label whose last proposal was vetoed is
        passed over till its probe is due, each round counted in its wait, so that where one
        kind of proposal loses here the other drafts, not plain steps. All resting: all open."""
        seen = self.seen
        resting = [
            label
            for label in labels
            if label in seen.resting
            and seen.vetoed.get(label, 0) < seen.waits.get(label, self.FIRST_WAIT)
        ]
        offered = tuple(label for label in labels if label not in resting) or labels
        if len(offered) < len(labels):
            for label in resting:
                seen.vetoed[label] = seen.vetoed.get(label, 0) + 1
        inner = getattr(self.inner, "pick", None)
        if inner is None or len(offered) == 1:
            return offered[0]
        return inner(offered, launched, position)

    def __post_init__(self) -> None:
        # One Observed per generation: a label that lost on the last prompt is probed soon on
        # this one, where the draft may know the content (a waits doubled to MAX_WAIT there
        # would keep a paying draft idle for most of a short answer).
        self.seen.waits.clear()
        self.seen.vetoed.clear()
        self.seen.resting.clear()

    def choose(self, label: Label, k: int | TreeShape) -> int | TreeShape:
        """The choice rule above, for a proposal of k drafts with label `label`."""
        seen = self.seen
        proposed = seen.arms.get((label, k))
        if seen.plain.rounds == 0 or proposed is None or proposed.runs < self.FIRST_LOOK:
            return k
        # The inner policy's K weighs the acceptance of the last rounds: where its arm pays it
        # stands, even if a cheaper arm's tally looks faster (that tally may be old, from other
        # content, and only the arm that runs would ever update it).
        if self.pays(proposed):
            return k
        steps = seen.vetoed.get(label, 0)
        if steps >= seen.waits.get(label, self.FIRST_WAIT):
            seen.vetoed[label], self._probing = 0, True
            proposed.fade(steps)  # its rounds are older by those rounds
            return k  # a probe: the proposed arm's time again
        seen.vetoed[label] = steps + 1
        cheaper = [
            a for a in seen.arms if a[0] == label and isinstance(a[1], int) and a[1] < _depth(k)
        ]
        best = min(cheaper, key=lambda a: seen.arms[a].per_token, default=None)
        if best is not None and self.pays(seen.arms[best]):
            return best[1]
        self._vetoing = True
        return 0

    def pays(self, tally: Tally) -> bool:
        return tally.per_token <= (1.0 + self.slack) * self.seen.plain.per_token

    def observe(self, k: int, accepted: int) -> None:
        self.inner.observe(k, accepted)

    def observe_tree(self, tree: Tree, path: list[int], seconds: float = 0.0) -> None:
        self.inner.observe_tree(tree, path, seconds)

    def observe_time(self, k: int | TreeShape, tokens: int, seconds: float) -> None:
        """The round just run (k drafts, 0: a plain step) emitted `tokens` ids (before any
        stop) in `seconds`."""
        seen = self.seen
        if k == 0 or self._arm is None:
            seen.plain.add(seconds, 1)
            self._arm = None
            return
        label = self._arm[0]
        tally = seen.arms.setdefault(self._arm, Tally())
        tally.add(seconds, tokens)
        if self.pays(tally):
            seen.waits[label] = self.FIRST_WAIT
        elif self._probing:
            seen.waits[label] = min(2 * seen.waits.get(label, self.FIRST_WAIT), self.MAX_WAIT)
        self._arm, self._probing = None, False

    def expects_plain(self) -> bool:
        """A vetoed label's next round is plain too unless a probe is due."""
        if self._vetoing:
            seen, label = self.seen, self._label
            return seen.vetoed.get(label, 0) < seen.waits.get(label, self.FIRST_WAIT)
        return self.inner.expects_plain()
