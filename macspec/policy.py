"""How many tokens to draft next round, and whether to speculate at all.

The choice uses only past rounds (measured times, acceptance) and the context (a drafter's label
for its next proposal), never the current round's target output, so it cannot bias the output
distribution: exactness holds for any K.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Protocol

# A drafter's grade of its next proposal, from the context alone (the n-gram match length);
# None = ungraded (a draft model); 0 = nothing to propose.
Label = int | None


class Policy(Protocol):
    def next_k(self, label: Label = None) -> int:
        """Drafts for the next round (0 = a plain step)."""

    def observe(self, k: int, accepted: int) -> None:
        """How many of the last speculative round's k drafts were accepted."""


@dataclass(frozen=True)
class Costs:
    """Seconds measured once per loaded pair on this machine (see api.calibrate).

    They are frozen so that K depends only on costs and on the seeded acceptance history: the
    same seed then gives the same tokens, which live timings would not."""

    plain_step: float  # one plain target step
    draft_step: float  # one draft token (a model draft; copied n-gram ids cost nothing)
    extra: float  # verification cost of one more position beyond a plain step (linear model)
    # Measured passes: (k, seconds of one target pass over 1 + k positions). On CPUs the cost is
    # far from linear in k (SmolLM2-135M, OpenBLAS, 2 cores: 1.20x a plain step for k=1, 1.61x for
    # k=4, 1.73x for k=7), so a single slope mis-prices both short and long proposals.
    verify: tuple[tuple[int, float], ...] = ()

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


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round emits on average when each draft is accepted with probability alpha:
    1 + alpha + ... + alpha^k (the accepted prefix plus the target's own token)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class FixedK:
    """Always k drafts (adaptive=False): for comparisons and tests. Label 0 (nothing to
    propose) is a plain step."""

    k: int

    def next_k(self, label: Label = None) -> int:
        return 0 if label == 0 else self.k

    def observe(self, k: int, accepted: int) -> None:
        pass


@dataclass
class _Arm:
    """Acceptance statistics and fallback state of one kind of proposal (one label)."""

    accepts: float = 0.6  # running counts; a prior of alpha = 0.6
    trials: float = 1.0
    backoff: int = 8
    skips_left: int = 0  # plain steps before the next probe round
    probing: bool = False

    @property
    def alpha(self) -> float:
        return self.accepts / self.trials


@dataclass
class AdaptiveK:
    """Pick K maximising expected tokens per second; fall back to plain decoding (K = 0) when
    even the best K is expected to lose against it, and probe again later.

    Time of a round: k * draft_step + the measured pass over 1 + k positions (Costs.pass_time);
    tokens: expected_tokens(alpha, k)
    with alpha, the per-draft acceptance, a running estimate from past rounds. Proposals with
    different labels keep separate estimates: a 4-gram match of a summary is accepted ~90% of the
    time, a 1-gram match ~15% (SmolLM2, measured), so one pooled rate would draft too much after
    weak matches and too little after strong ones. Labelled (copied) proposals cost no draft
    time and may run up to `copy_max` ids; model drafts up to `k_max`."""

    k_max: int
    costs: Costs
    margin: float = 1.0  # speculate only if expected speed >= margin x plain speed
    probe_after: int = 8
    copy_max: int | None = None  # cap for labelled proposals (default: k_max)
    arms: dict = field(default_factory=dict)
    _last: Label = None

    def arm(self, label: Label) -> _Arm:
        if label not in self.arms:
            self.arms[label] = _Arm(backoff=self.probe_after)
        return self.arms[label]

    @property
    def alpha(self) -> float:
        """Acceptance estimate of the ungraded (model) proposals."""
        return self.arm(None).alpha

    def expected_speed(self, k: int, label: Label = None) -> float:
        c = self.costs
        draft = 0.0 if label is not None else c.draft_step
        return expected_tokens(self.arm(label).alpha, k) / (k * draft + c.pass_time(k))

    def best_k(self, label: Label = None) -> int:
        cap = self.k_max if label is None else (self.copy_max or self.k_max)
        return max(range(1, cap + 1), key=lambda k: self.expected_speed(k, label))

    def next_k(self, label: Label = None) -> int:
        self._last = label
        if label == 0:
            return 0
        arm = self.arm(label)
        if arm.skips_left > 0:
            arm.skips_left -= 1
            arm.probing = arm.skips_left == 0
            return 0
        k = self.best_k(label)
        if arm.probing:
            arm.probing = False  # one speculative round to see whether drafting helps now
            return k
        if self.expected_speed(k, label) < self.margin / self.costs.plain_step:
            # Losing: decode plainly for a while (longer each time), then probe.
            arm.skips_left = arm.backoff - 1
            arm.backoff = min(arm.backoff * 2, 256)
            return 0
        arm.backoff = self.probe_after
        return k

    def observe(self, k: int, accepted: int) -> None:
        if k == 0:
            return
        # Per-draft acceptance from prefix lengths: `accepted` successes, then one failure
        # unless every draft was accepted (the maximum-likelihood estimate of a geometric run),
        # as running counts weighted towards recent rounds.
        arm, rate = self.arm(self._last), 0.3
        arm.accepts = (1 - rate) * arm.accepts + rate * accepted
        arm.trials = (1 - rate) * arm.trials + rate * (accepted + (accepted < k))
