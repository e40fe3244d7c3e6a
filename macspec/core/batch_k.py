"""How many drafts each row of a shared pass proposes (core/batch_rounds.py), chosen for the batch.

Alone, a row's policy (policy.py, observed.py) prices its K as if its pass were its own. In a
shared pass every row is padded to the widest one, so one row's long proposal widens every
row, and on a CPU a wide many-row pass costs far more than a one-row one. `choose_ks` picks the
rows' K together, from each row's own acceptance estimates and the pair's measured costs.

Like the per-row policy it reads only past rounds and costs, never the round's own output: it
changes how many drafts are proposed, never whether one is accepted, so each row's output is
distributed as its target's whatever it picks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .adaptive import AdaptiveK
from .observed import Observed
from .policy import Costs, Label, Policy
from .tally import Tally


@dataclass(frozen=True)
class Bid:
    """One row's offer for a shared pass: its own policy's K (the most it drafts), and where
    the policy estimates its acceptance, the tokens a round with 0..k drafts emits on average
    (`tokens[0]` = 1, a plain step) and the seconds one of its drafts costs. Without an
    estimate (a fixed K) the row drafts exactly k."""

    k: int
    tokens: tuple[float, ...] | None = None
    draft_step: float = 0.0
    costs: Costs | None = None  # the pair's measured costs (short context), to price passes
    position: int = 0  # the ids the row's target cache holds


def bid(policy: Policy, label: Label, k: int, position: int) -> Bid:
    """The row's Bid for its policy's choice `k` (label: the drafter's, for this proposal)."""
    chain = policy.inner if isinstance(policy, Observed) else policy
    if not isinstance(chain, AdaptiveK) or k == 0:
        return Bid(k, position=position)
    arm = chain.arm(label)
    tokens = tuple(arm.expected_tokens(j) for j in range(k + 1))
    draft = chain.now.draft_step if label is None else 0.0  # copied n-gram ids cost nothing
    return Bid(k, tokens, draft, chain.costs, position)


def pass_time(costs: Costs, rows: int, width: int, position: int) -> float:
    """Seconds of a shared pass over `rows` rows of `width` ids, the longest row after
    `position` cached ids, from the pair's measured one-row passes: one over as many ids at a
    short context (the weights' work grows with the ids fed), plus, per row, what a pass of
    `width` ids costs more at that context (each row attends over its own keys; Costs.at)."""
    base = costs.pass_time(rows * width - 1)
    later = costs.at(position).pass_time(width - 1) - costs.pass_time(width - 1)
    return base + rows * max(0.0, later)


class PassPrices:
    """Seconds of shared passes by (rows, width): what the driver's own passes of that size
    took (a decaying average), else `pass_time` from the pair's measured costs. The measured
    one-row passes miss what a shared pass adds per row (each row's cache copied into the
    block, its mask), which on a CPU is a large part of a narrow pass."""

    DECAY = 0.7  # each earlier pass counts this much less than the one after it

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], Tally] = {}

    def observe(self, rows: int, width: int, seconds: float) -> None:
        self.seen.setdefault((rows, width), Tally(self.DECAY)).add(seconds, 1.0)

    def pricing(
        self, costs: Costs, position: int, max_ids: int | None = None
    ) -> Callable[[int, int], float]:
        """price(rows, width) for choose_ks, at `position` cached ids; with `max_ids`, a round
        of more ids runs as passes of at most that many (batch_rounds.pass_groups): their sum."""

        def one(rows: int, width: int) -> float:
            seen = self.seen.get((rows, width))
            return seen.mean if seen is not None else pass_time(costs, rows, width, position)

        def price(rows: int, width: int) -> float:
            if max_ids is None or rows * width <= max_ids:
                return one(rows, width)
            per = max(1, max_ids // width)  # rows a pass
            full, rest = divmod(rows, per)
            return full * one(per, width) + (one(rest, width) if rest else 0.0)

        return price


def choose_ks(bids: Sequence[Bid], price: Callable[[int, int], float] | None) -> list[int]:
    """Each row's K for one shared pass. Rule: maximise the batch's expected tokens per second,

        sum_r tokens_r[k_r] / (price(rows, 1 + max_r k_r) + sum_r k_r * draft_step_r),

    over 0 <= k_r <= the row's own K (rows without an estimate keep theirs). `price(rows,
    width)`: seconds of the shared pass; None (nothing measured): every row keeps its own K.
    For each width the best K's are found by Dinkelbach's iteration (rows then choose
    independently: k_r maximises tokens_r[k] - rate * k * draft_step_r); ties go to the
    narrower pass."""
    own = [b.k for b in bids]
    if price is None or all(b.tokens is None for b in bids):
        return own
    narrowest = 1 + max((b.k for b in bids if b.tokens is None), default=0)
    best, best_rate = own, -1.0
    for width in range(narrowest, 2 + max(own)):
        ks = [b.k if b.tokens is None else min(b.k, width - 1) for b in bids]
        for _ in range(4 * len(bids) + 4):  # converges in a few steps; bounded all the same
            rate = _rate(bids, ks, price(len(bids), width))
            again = [_best_k(b, k, width, rate) for b, k in zip(bids, ks, strict=True)]
            if again == ks:
                break
            ks = again
        rate = _rate(bids, ks, price(len(bids), 1 + max(ks)))
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = ks, rate
    return best


def _rate(bids: Sequence[Bid], ks: list[int], verify: float) -> float:
    """Expected tokens per second of a round with these K's and a pass of `verify` seconds."""
    pairs = list(zip(bids, ks, strict=True))
    tokens = sum(1.0 if b.tokens is None else b.tokens[k] for b, k in pairs)
    return tokens / (verify + sum(k * b.draft_step for b, k in pairs))


def _best_k(b: Bid, k: int, width: int, rate: float) -> int:
    """The row's K within `width` that adds the most tokens beyond what its drafting costs at
    `rate` tokens a second (its own K where it has no estimate)."""
    if b.tokens is None:
        return k
    top = min(b.k, width - 1)
    return max(range(top + 1), key=lambda j: (b.tokens[j] - rate * j * b.draft_step, -j))
