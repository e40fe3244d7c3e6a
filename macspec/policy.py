"""How many tokens to draft next round, and whether to speculate at all.

The choice uses only past rounds (measured times, acceptance), never the current round's target
output, so it cannot bias the output distribution: exactness holds for any K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Policy(Protocol):
    def next_k(self) -> int:
        """Drafts for the next round (0 = a plain step)."""

    def observe(self, k: int, accepted: int) -> None:
        """How many of the last speculative round's k drafts were accepted."""


@dataclass(frozen=True)
class Costs:
    """Seconds measured once per loaded pair on this machine (see api.calibrate).

    They are frozen so that K depends only on costs and on the seeded acceptance history: the
    same seed then gives the same tokens, which live timings would not."""

    plain_step: float  # one plain target step
    draft_step: float  # one draft token
    extra: float  # verification cost of one more position beyond a plain step


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round emits on average when each draft is accepted with probability alpha:
    1 + alpha + ... + alpha^k (the accepted prefix plus the target's own token)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class FixedK:
    """Always k drafts (adaptive=False): for comparisons and tests."""

    k: int

    def next_k(self) -> int:
        return self.k

    def observe(self, k: int, accepted: int) -> None:
        pass


class AdaptiveK:
    """Pick K in [1, k_max] maximising expected tokens per second; fall back to plain decoding
    (K = 0) when even the best K is expected to lose against it, and probe again later.

    Time of a round: k * draft_step + plain_step + k * extra; tokens: expected_tokens(alpha, k)
    with alpha, the per-draft acceptance, a running estimate from past rounds."""

    def __init__(self, k_max: int, costs: Costs, margin: float = 1.0, probe_after: int = 8):
        self.k_max, self.costs = k_max, costs
        self.margin = margin  # speculate only if expected speed >= margin x plain speed
        self.accepts, self.trials = 0.6, 1.0  # running counts; a prior of alpha = 0.6
        self.probe_after = self.backoff = probe_after
        self.plain_steps_left = 0  # plain steps before the next probe round
        self.probing = False

    @property
    def alpha(self) -> float:
        return self.accepts / self.trials

    def expected_speed(self, k: int) -> float:
        c = self.costs
        return expected_tokens(self.alpha, k) / (k * c.draft_step + c.plain_step + k * c.extra)

    def best_k(self) -> int:
        return max(range(1, self.k_max + 1), key=self.expected_speed)

    def next_k(self) -> int:
        if self.plain_steps_left > 0:
            self.plain_steps_left -= 1
            self.probing = self.plain_steps_left == 0
            return 0
        k = self.best_k()
        if self.probing:
            self.probing = False  # one speculative round to see whether drafting helps now
            return k
        if self.expected_speed(k) < self.margin / self.costs.plain_step:
            # Losing: decode plainly for a while (longer each time), then probe.
            self.plain_steps_left = self.backoff - 1
            self.backoff = min(self.backoff * 2, 256)
            return 0
        self.backoff = self.probe_after
        return k

    def observe(self, k: int, accepted: int) -> None:
        if k == 0:
            return
        # Per-draft acceptance from prefix lengths: `accepted` successes, then one failure
        # unless every draft was accepted (the maximum-likelihood estimate of a geometric run),
        # as running counts weighted towards recent rounds.
        rate = 0.3
        self.accepts = (1 - rate) * self.accepts + rate * accepted
        self.trials = (1 - rate) * self.trials + rate * (accepted + (accepted < k))
