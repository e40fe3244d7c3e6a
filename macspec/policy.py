"""How many tokens to draft next round, and whether to speculate at all.

The choice uses only past rounds (measured times, acceptance), never the current round's target
output, so it cannot bias the output distribution: exactness holds for any K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Policy(Protocol):
    def next_k(self, plain_step: float | None) -> int:
        """Drafts for the next round (0 = a plain step), given the measured plain step time."""

    def observe(self, k: int, accepted: int, draft_time: float, verify_time: float) -> None:
        """What the last speculative round did."""


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round emits on average when each draft is accepted with probability alpha:
    1 + alpha + ... + alpha^k (the accepted prefix plus the target's own token)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class FixedK:
    """Always k drafts (adaptive=False): for comparisons and tests."""

    k: int

    def next_k(self, plain_step: float | None) -> int:
        return self.k

    def observe(self, k: int, accepted: int, draft_time: float, verify_time: float) -> None:
        pass


class AdaptiveK:
    """Pick K in [1, k_max] maximising expected tokens per second; fall back to plain decoding
    (K = 0) when even the best K is expected to lose against it, and probe again later.

    Cost model per round: k * draft_step + verify(k), verify(k) = plain_step + k * extra,
    with draft_step, extra and the acceptance rate alpha as running averages of measurements."""

    def __init__(self, k_max: int, margin: float = 1.0, probe_after: int = 8):
        self.k_max = k_max
        self.margin = margin  # speculate only if expected speed >= margin x plain speed
        self.accepts, self.trials = 0.6, 1.0  # running counts; a prior of alpha = 0.6
        self.draft_step: float | None = None
        self.extra: float | None = None  # verify cost of one more position, beyond a plain step
        self.plain_steps_left = 0  # plain steps before the next probe round
        self.probe_after = probe_after
        self.backoff = probe_after
        self.plain_rounds = 0
        self.probing = False
        self._plain_step: float | None = None

    @property
    def alpha(self) -> float:
        return self.accepts / self.trials

    def expected_speed(self, k: int, plain_step: float) -> float:
        draft = self.draft_step if self.draft_step is not None else 0.1 * plain_step
        extra = self.extra if self.extra is not None else 0.1 * plain_step
        return expected_tokens(self.alpha, k) / (k * draft + plain_step + k * extra)

    def best_k(self, plain_step: float) -> int:
        return max(range(1, self.k_max + 1), key=lambda k: self.expected_speed(k, plain_step))

    def next_k(self, plain_step: float | None) -> int:
        if plain_step is None:
            return self.k_max
        self._plain_step = plain_step
        if self.plain_steps_left > 0:
            self.plain_steps_left -= 1
            self.plain_rounds += 1
            self.probing = self.plain_steps_left == 0
            return 0
        k = self.best_k(plain_step)
        if self.probing:
            self.probing = False  # one speculative round to measure whether drafting helps now
            return k
        if self.expected_speed(k, plain_step) < self.margin / plain_step:
            # Losing: decode plainly for a while, then probe with one speculative round.
            self.plain_steps_left = self.backoff - 1
            self.backoff = min(self.backoff * 2, 256)
            self.plain_rounds += 1
            return 0
        self.backoff = self.probe_after
        return k

    def observe(self, k: int, accepted: int, draft_time: float, verify_time: float) -> None:
        if k == 0:
            return
        rate = 0.3  # weight of the newest round in the running averages
        # Per-draft acceptance from prefix lengths: `accepted` successes, then one failure
        # unless every draft was accepted (the maximum-likelihood estimate of a geometric run).
        self.accepts = (1 - rate) * self.accepts + rate * accepted
        self.trials = (1 - rate) * self.trials + rate * (accepted + (accepted < k))
        step = draft_time / k
        self.draft_step = (
            step if self.draft_step is None else (1 - rate) * self.draft_step + rate * step
        )
        if self._plain_step is not None:
            extra = max(0.0, verify_time - self._plain_step) / k
            self.extra = extra if self.extra is None else (1 - rate) * self.extra + rate * extra
