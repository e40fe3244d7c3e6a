"""Speculative output must be distributed exactly as target-only output."""

import mlx.core as mx
import pytest
from support.exactness import (
    DEPTH,
    PROMPT,
    N,
    chi_square,
    exact_joint,
    resample_from_p,
    sample_prefixes,
)

import macspec
import macspec.core.verify as engine
from macspec.core.sampling import sample

OPTION_SETS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.8},
    {"temperature": 1.3, "top_k": 3},
    {"temperature": 1.0, "min_p": 0.15, "repetition_penalty": 1.5},
]


@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: ",".join(map(str, o.values())))
def test_speculative_distribution_matches_target(small_pair, options):
    expected = exact_joint(small_pair, PROMPT, DEPTH, **options)
    counts = sample_prefixes(small_pair, PROMPT, DEPTH, N, num_draft=2, adaptive=False, **options)
    assert chi_square(expected, counts) > 1e-3


def test_plain_decoding_distribution_matches_target(small_pair):
    expected = exact_joint(small_pair, PROMPT, 2, temperature=1.0)
    counts = sample_prefixes(small_pair, PROMPT, 2, N, speculative=False, temperature=1.0)
    assert chi_square(expected, counts) > 1e-3


def inverted_ratio(p, q, drafts, key):
    """Another: accept with probability min(1, q(x)/p(x)), the ratio upside down."""
    k = drafts.size
    u_key, r_key = mx.random.split(key)
    rows = mx.arange(k)
    ok = mx.random.uniform(shape=(k,), key=u_key) * p[rows, drafts] < q[rows, drafts]
    n = mx.sum(mx.cumprod(ok.astype(mx.int32)))
    q = mx.concatenate([q, mx.zeros((1, q.shape[1]))])
    residual = mx.maximum(mx.take(p, n, axis=0) - mx.take(q, n, axis=0), 0.0)
    return n, sample(residual[None], r_key)[0]


correct_accept = engine.accept


@pytest.mark.parametrize("broken", [resample_from_p, inverted_ratio])
def test_the_test_detects_a_broken_acceptance_rule(small_pair, monkeypatch, broken):
    monkeypatch.setattr(engine, "accept", broken)
    options = {"temperature": 1.0}
    expected = exact_joint(small_pair, PROMPT, DEPTH, **options)
    counts = sample_prefixes(small_pair, PROMPT, DEPTH, N, num_draft=2, adaptive=False, **options)
    assert chi_square(expected, counts) < 1e-5


def test_draft_equal_to_target_accepts_every_draft(tiny_dirs):
    same = macspec.load(tiny_dirs[0], tiny_dirs[0], drafter="model")
    for temperature in (0.0, 0.9):
        r = macspec.generate(
            same,
            "Once",
            max_tokens=30,
            num_draft=4,
            temperature=temperature,
            seed=5,
            adaptive=False,
        )
        assert r.stats.drafted > 0
        assert r.stats.accepted == r.stats.drafted
        assert r.stats.acceptance_rate == 1.0
