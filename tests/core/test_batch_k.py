"""The rows' K for a shared pass chosen for the batch (core/batch_k.py): the choice is the best
of every combination, it drafts less where a wide pass costs more than it brings, rows with a
fixed K keep it, and a row's bid carries its own policy's acceptance estimates."""

from __future__ import annotations

import itertools
import random

import pytest

from macspec.core.adaptive import AdaptiveK
from macspec.core.batch_k import Bid, PassPrices, bid, choose_ks, pass_time
from macspec.core.observed import Observed
from macspec.core.policy import Costs, FixedK


def chain(rate: float, k: int) -> tuple[float, ...]:
    """Expected tokens of rounds with 0..k drafts, each accepted with `rate` after the last."""
    return tuple(sum(rate**i for i in range(j + 1)) for j in range(k + 1))


def overhead_and_ids(rows: int, width: int) -> float:
    """A pass costing 30 ms plus 4 ms an id fed: far from free to widen."""
    return 0.03 + 0.004 * rows * width


def rate_of(bids, ks, price) -> float:
    tokens = sum(1.0 if b.tokens is None else b.tokens[k] for b, k in zip(bids, ks, strict=True))
    seconds = price(len(bids), 1 + max(ks)) + sum(
        k * b.draft_step for b, k in zip(bids, ks, strict=True)
    )
    return tokens / seconds


def test_alone_a_row_drafts_but_four_rows_draft_less():
    eagle = Bid(4, chain(0.6, 4), draft_step=0.002)
    # Alone: K=2 gives 1.96 tokens in 46 ms (42.6/s), K=4 2.31 in 58 ms (39.8/s).
    assert choose_ks([eagle], overhead_and_ids) == [2]
    # Four rows: K=1 gives 6.4 tokens in 70 ms (91.4/s), plain steps 4 in 46 ms (87.0/s),
    # K=2 7.84 in 94 ms (83.4/s).
    assert choose_ks([eagle] * 4, overhead_and_ids) == [1, 1, 1, 1]
    copy = Bid(8, chain(0.9, 8), draft_step=0.0)  # free drafts, a pass as cheap wide as narrow
    assert choose_ks([copy] * 4, lambda rows, width: 0.05) == [8, 8, 8, 8]


def test_fixed_rows_keep_their_k_and_set_the_narrowest_pass():
    fixed, copy = Bid(3), Bid(16, chain(0.9, 16), draft_step=0.0)
    steep = lambda rows, width: 0.03 if width <= 4 else 10.0  # noqa: E731
    assert choose_ks([fixed, copy], steep) == [3, 3]  # the copy fills the fixed row's width
    assert choose_ks([Bid(0), Bid(0)], steep) == [0, 0]
    assert choose_ks([fixed, copy], None) == [3, 16]  # nothing measured: each its own K


@pytest.mark.parametrize("seed", range(30))
def test_the_choice_is_the_best_of_every_combination(seed):
    rng = random.Random(seed)
    bids = []
    for _ in range(rng.randint(1, 4)):
        k = rng.randint(0, 4)
        if rng.random() < 0.25:
            bids.append(Bid(k))
        else:
            bids.append(Bid(k, chain(rng.uniform(0.1, 0.95), k), rng.choice([0.0, 0.003, 0.02])))
    per_id, cliff, base = (
        rng.uniform(0.0005, 0.01),
        rng.choice([8, 17, 99]),
        rng.uniform(0.01, 0.05),
    )

    def price(rows, width):
        return base + per_id * rows * width * (3 if rows * width >= cliff else 1)

    ranges = [range(b.k + 1) if b.tokens is not None else [b.k] for b in bids]
    best = max(rate_of(bids, list(ks), price) for ks in itertools.product(*ranges))
    got = choose_ks(bids, price)
    assert all(0 <= k <= b.k for k, b in zip(got, bids, strict=True))
    assert rate_of(bids, got, price) == pytest.approx(best, rel=1e-12)


def costs() -> Costs:
    verify = ((1, 0.012), (2, 0.013), (4, 0.016), (8, 0.03), (16, 0.09))
    return Costs(plain_step=0.01, draft_step=0.002, extra=0.0015, verify=verify)


def test_a_bid_carries_the_rows_own_estimates():
    policy = Observed(AdaptiveK(4, costs(), copy_max=16, priors={4: 0.8}))
    for accepted in (3, 2, 4):
        policy.next_k(None)
        policy.observe(4, accepted)
    model = bid(policy, None, 4, position=40)
    arm = policy.inner.arm(None)
    assert model.tokens == tuple(arm.expected_tokens(j) for j in range(5))
    assert model.tokens[0] == 1.0 and model.draft_step == 0.002 and model.position == 40
    assert model.costs is policy.inner.costs
    copy = bid(policy, 4, 8, position=40)  # a copied n-gram costs no draft time
    assert copy.draft_step == 0.0 and copy.tokens[1] == pytest.approx(0.8 / 1.0 + 1.0)
    assert bid(FixedK(3), None, 3, 40) == Bid(3, position=40)  # a fixed K: no estimate
    assert bid(policy, None, 0, 40).tokens is None  # a plain step stays one


def test_a_pass_is_priced_from_the_measured_ones_until_one_of_its_size_is_seen():
    c = costs()
    assert pass_time(c, 1, 5, 0) == c.pass_time(4)
    assert pass_time(c, 4, 2, 0) == c.pass_time(7)  # 8 ids fed: as one row of 8
    prices = PassPrices()
    price = prices.pricing(c, 0)
    assert price(4, 2) == c.pass_time(7)
    prices.observe(4, 2, 0.05)
    prices.observe(4, 2, 0.15)
    # a decaying mean (core/tally.py): the earlier pass counts 0.7 times the latest
    assert price(4, 2) == pytest.approx((0.7 * 0.05 + 0.15) / (0.7 + 1))
    assert price(4, 3) == c.pass_time(11)


def test_a_round_over_the_id_cap_is_priced_as_the_passes_it_runs_as():
    """batch_rounds.pass_groups splits a round of more than max_ids ids: 5 rows of width 5 with
    16 ids a pass run as 3 + 2 rows (pass_groups puts 3 rows of 5 in one pass)."""
    prices = PassPrices()
    for rows, width, seconds in [(3, 5, 0.05), (2, 5, 0.04), (5, 5, 0.2), (3, 3, 0.03)]:
        prices.observe(rows, width, seconds)
    capped, whole = prices.pricing(costs(), 0, 16), prices.pricing(costs(), 0)
    assert capped(5, 5) == pytest.approx(0.05 + 0.04) and whole(5, 5) == pytest.approx(0.2)
    assert capped(3, 5) == whole(3, 5) == pytest.approx(0.05)  # 15 ids: one pass
    assert capped(6, 5) == pytest.approx(2 * 0.05)
    assert capped(1, 20) == whole(1, 20)  # a row wider than the cap runs alone, as alone
