"""The adaptive policy checked against the round times this machine actually shows.

The inner policy (adaptive.py) prices rounds with costs measured once at load; those may be wrong
for this run (another process, a kernel whose wide passes cost more than measured, draft time
the filler did not see). Observed keeps, per arm, the seconds each emitted token really took,
and lets a round speculate only where that beats the plain steps of the same run.

Like the inner policy it reads only past rounds and the drafter's label, never the current
round's output: it changes how many drafts are proposed, never whether one is accepted, so the
output distribution is the target's whatever it picks.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

from .adaptive import NOTHING, AdaptiveK, Arm, name
from .policy import Label, Policy
from .tally import Backoff, Decision, Tally
from .tree import Tree, TreeShape

log = logging.getLogger("macspec.core")

# A speculative arm: the drafter's label (None: the draft model; n: an n-gram copy of match
# bucket n) and the K (or token tree) the round was given.
ArmKey = tuple[Label, int | TreeShape]

TIME_DECAY = 0.8  # an arm's round times: about its last five rounds

# The reasons the observed check gives where it overrides the priced choice (Decision.reason).
SLOWER = "slower than plain here"
CHEAPER = "a cheaper K pays here"
PROBE = "probe of a slower arm"
FIXED = "fixed"


def _tally() -> Tally:
    return Tally(TIME_DECAY)


@dataclass
class Observations:
    """What a loaded pair's rounds took, kept across its generations (as loop.Timing): plain
    steps and every speculative arm (seconds / tokens)."""

    plain: Tally = field(default_factory=_tally)
    arms: dict[ArmKey, Tally] = field(default_factory=dict)
    # label -> the adaptive policy's acceptance estimates (AdaptiveK.kept), for the next
    # generation to start from
    acceptance: dict[Label, Arm] = field(default_factory=dict)


@dataclass
class Reasons:
    """The decisions of one generation, for its statistics and log: the last one, and how
    many plain steps each reason gave. A change of reason is logged (INFO), not every round."""

    last: Decision | None = None
    plain: Counter[str] = field(default_factory=Counter)

    def record(self, decision: Decision) -> None:
        if decision.plain:
            self.plain[decision.reason] += 1
        last = self.last
        if last is None or _mode(last) != _mode(decision):
            log.info("policy: %s", decision)
        elif last.reason != decision.reason:
            log.debug("policy: %s", decision)
        self.last = decision

    def plain_steps(self) -> tuple[tuple[str, int], ...]:
        """(reason, plain steps), the most common first."""
        return tuple(self.plain.most_common())


def _mode(decision: Decision) -> str:
    """What a change of is worth an INFO line: to plain steps (and why), or to drafting."""
    return decision.reason if decision.plain else "drafting"


def _depth(k: int | TreeShape) -> int:
    return k.depth if isinstance(k, TreeShape) else k


@dataclass
class Observed(Policy):
    """The inner policy's choice, kept only where observed round times say it pays.

    Choice rule, per round with label L, where p = seconds of a plain step and s(a) = seconds per
    emitted token of arm a, both decaying averages of this pair's own rounds:
      - the inner policy proposes k (priced by the measured costs); k = 0 is a plain step;
      - an arm (L, k) run fewer than FIRST_LOOK times yet is run (a first look);
      - else (L, k) is run if s(L, k) <= (1 + slack) * p (it pays);
      - else L backs off (Backoff, from FIRST_WAIT up to MAX_WAIT rounds): the proposed arm
        runs again once its wait is over (a probe, its old rounds faded as if those rounds had
        been its own); in its place the run arm (L, j), j < k, with the least s, if it pays (a
        cheaper K in place of the losing one), or a plain step.
    A new generation (new content) starts every label's back-off afresh; the tallies, which say
    what this machine's rounds cost, are kept. `decide` makes each choice and says why
    (Decision); `reasons` keeps the generation's.
    """

    inner: Policy
    seen: Observations = field(default_factory=Observations)
    # An arm loses when its seconds per token exceed plain's by more than this: on a shared
    # machine round times swing by more, and the inner policy already prices the close cases.
    slack: float = 0.2
    backoffs: dict[Label, Backoff] = field(default_factory=dict)  # this generation's
    resting: set[Label] = field(default_factory=set)  # labels whose last proposal was vetoed
    reasons: Reasons = field(default_factory=Reasons)
    _arm: ArmKey | None = None  # the arm of the round being run (None: a plain step)
    _label: Label = None  # the label of the round being run
    _vetoing: bool = False  # the last choice was a plain step in place of a losing arm

    FIRST_WAIT: ClassVar[int] = 8
    FIRST_LOOK: ClassVar[int] = 2  # rounds an arm runs before it can lose
    # A probe costs at most one losing round: one every 64 steps wastes little and still
    # catches the draft helping again (a passage it knows, code that repeats itself).
    MAX_WAIT: ClassVar[int] = 64

    @property
    def max_k(self) -> int:
        return self.inner.max_k

    @property
    def decision(self) -> Decision | None:
        """The last round's choice and why."""
        return self.reasons.last

    def backoff(self, label: Label) -> Backoff:
        return self.backoffs.setdefault(label, Backoff(self.FIRST_WAIT, self.MAX_WAIT))

    def next_k(
        self, label: Label = None, launched: bool = False, position: int = 0
    ) -> int | TreeShape:
        return self.decide(label, launched, position).k

    def decide(self, label: Label = None, launched: bool = False, position: int = 0) -> Decision:
        """The next round's drafts (0: a plain step) and why: the inner policy's priced choice,
        checked against the observed times (`choose`)."""
        k = self.inner.next_k(label, launched, position)
        # (isinstance, not a probe: a fixed policy has no reasons of its own to give)
        if isinstance(self.inner, AdaptiveK):
            priced = self.inner.decision
        else:
            priced = Decision(k, FIXED if k or label != 0 else NOTHING)
        self._arm, self._label, self._vetoing = None, label, False
        decision = priced if k == 0 else self.choose(label, priced)
        if decision.k != 0:
            self._arm = (label, decision.k)
        (self.resting.add if self._vetoing else self.resting.discard)(label)
        self.reasons.record(decision)
        return decision

    def pick(self, labels: tuple[Label, ...], launched: bool = False, position: int = 0) -> Label:
        """Of the labels a drafter offers (a hybrid's short match: its model or a copy), the
        inner policy's pick among those not resting: a label whose last proposal was vetoed is
        passed over till its probe is due, each round counted in its wait, so that where one
        kind of proposal loses here the other drafts, not plain steps. All resting: all open."""
        resting = [a for a in labels if a in self.resting and self.backoff(a).resting]
        offered = tuple(a for a in labels if a not in resting) or labels
        if len(offered) < len(labels):
            for label in resting:
                self.backoff(label).skip()
        if len(offered) == 1:
            return offered[0]
        return self.inner.pick(offered, launched, position)

    def choose(self, label: Label, priced: Decision) -> Decision:
        """The choice rule above, for the inner policy's proposal of priced.k drafts."""
        seen, k = self.seen, priced.k
        proposed = seen.arms.get((label, k))
        if seen.plain.rounds == 0 or proposed is None or proposed.runs < self.FIRST_LOOK:
            return priced
        # The inner policy's K weighs the acceptance of the last rounds: where its arm pays it
        # stands, even if a cheaper arm's tally looks faster (that tally may be old, from other
        # content, and only the arm that runs would ever update it).
        if self.pays(proposed):
            return priced
        backoff = self.backoff(label)
        if not backoff.resting and not backoff.due:
            backoff.lose()  # this round is the first given up
        elif backoff.probe():
            proposed.fade(backoff.waited)  # its rounds are older by those rounds
            return Decision(k, PROBE, self._slower(label, k, proposed))
        else:
            backoff.skip()
        cheaper = [
            a for a in seen.arms if a[0] == label and isinstance(a[1], int) and a[1] < _depth(k)
        ]
        best = min(cheaper, key=lambda a: seen.arms[a].mean, default=None)
        if best is not None and self.pays(seen.arms[best]):
            return Decision(best[1], CHEAPER, self._slower(label, k, proposed))
        self._vetoing = True
        wait = f"probe in {backoff.left + 1}"
        return Decision(0, SLOWER, f"{self._slower(label, k, proposed)}, {wait}")

    def _slower(self, label: Label, k: int | TreeShape, tally: Tally) -> str:
        """The figures behind a veto: "model K=2 took 1.31x plain's time a token over 6
        rounds"."""
        arm = f"tree {k.max_nodes} nodes" if isinstance(k, TreeShape) else f"K={k}"
        ratio = tally.mean / self.seen.plain.mean
        return (
            f"{name(label)} {arm} took {ratio:.2f}x plain's time a token over {tally.runs} rounds"
        )

    def pays(self, tally: Tally) -> bool:
        return tally.mean <= (1.0 + self.slack) * self.seen.plain.mean

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
        tally = seen.arms.setdefault(self._arm, _tally())
        tally.add(seconds, tokens)
        if self.pays(tally):
            self.backoff(self._arm[0]).win()
        self._arm = None

    def expects_plain(self) -> bool:
        """A vetoed label's next round is plain too unless a probe is due."""
        if self._vetoing:
            return self.backoff(self._label).resting
        return self.inner.expects_plain()
