"""The greedy short cut of verification (verify.judge, verify.plain_step): the argmax of each
row instead of building one-hot rows over the vocabulary and sampling from them. It must give
exactly accept()'s (n, token) and sample()'s id, for any q the drafter sends."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from macspec.core.drafters.base import Proposal
from macspec.core.sampling import SamplingOptions, distribution, sample
from macspec.core.verify import accept, accept_greedy, judge, make_dist, one_hot

VOCAB = 50


def _rows(rng: np.random.Generator, k: int, hits: int) -> tuple[mx.array, mx.array]:
    """Logits (k+1, V) and k drafts whose first `hits` are their rows' argmax, the next not."""
    logits = rng.normal(size=(k + 1, VOCAB)).astype(np.float32)
    best = logits.argmax(axis=1)
    drafts = [int(best[i]) if i < hits else int((best[i] + 1 + i) % VOCAB) for i in range(k)]
    return mx.array(logits), mx.array(drafts, dtype=mx.uint32)


@pytest.mark.parametrize("q_kind", ["one-hot", "soft", "none"])
def test_greedy_accept_equals_the_rule_for_every_q(q_kind):
    rng = np.random.default_rng(0)
    greedy = SamplingOptions()
    for k in range(5):
        for hits in range(k + 1):
            logits, drafts = _rows(rng, k, hits)
            if q_kind == "soft":
                q = mx.softmax(mx.array(rng.normal(size=(k, VOCAB)).astype(np.float32)), axis=-1)
            else:
                q = one_hot(drafts, VOCAB)
            p = distribution(logits, greedy)
            for seed in range(3):
                want = accept(p, q, drafts, mx.random.key(seed))
                got = accept_greedy(mx.argmax(logits, axis=-1), drafts)
                assert (got[0].item(), got[1].item()) == (want[0].item(), want[1].item())
            assert got[0].item() == hits


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_judge_takes_the_short_cut_only_where_it_is_the_same(penalty):
    """Greedy (with a repetition penalty too): judge equals the full rule; with `seen` (log
    probabilities) the rows are built and kept; at T > 0 there is no short cut."""
    rng = np.random.default_rng(1)
    history = [int(i) for i in rng.integers(0, VOCAB, 30)]
    greedy = make_dist(SamplingOptions(repetition_penalty=penalty), history)
    assert greedy.greedy
    hot = make_dist(SamplingOptions(temperature=0.7), history)
    assert not hot.greedy and hot.best(mx.zeros((1, VOCAB)), None, 0) is None
    for hits in range(4):
        logits, drafts = _rows(rng, 3, hits)
        proposal = Proposal(drafts, None)
        p = greedy.probs(logits, drafts, 0)
        want = accept(p, one_hot(drafts, VOCAB), drafts, mx.random.key(0))
        got = judge(logits, proposal, greedy, mx.random.key(0))
        seen: list = []
        kept = judge(logits, proposal, greedy, mx.random.key(0), seen)
        assert [int(a.item()) for a in got] == [int(a.item()) for a in want]
        assert [int(a.item()) for a in kept] == [int(a.item()) for a in want]
        assert len(seen) == 1 and mx.array_equal(seen[0][2], p).item()


def test_greedy_ids_are_what_sample_draws_from_the_one_hot():
    rng = np.random.default_rng(2)
    history = [int(i) for i in rng.integers(0, VOCAB, 30)]
    dist = make_dist(SamplingOptions(repetition_penalty=1.5), history)
    logits = mx.array(rng.normal(size=(4, VOCAB)).astype(np.float32))
    extra = mx.array([1, 2, 3], dtype=mx.uint32)
    drawn = sample(dist.probs(logits, extra, 0), mx.random.key(3))
    assert drawn.tolist() == dist.best(logits, extra, 0).tolist()
