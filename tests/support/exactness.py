"""Exactness checks shared by every drafter's tests.

`exact_joint` enumerates the target-only distribution of the first `depth` tokens from logits;
`chi_square` compares it with the empirical distribution of generations.
"""

from __future__ import annotations

import itertools
from collections import Counter

import mlx.core as mx
import numpy as np
from scipy.stats import chi2

import macspec
from macspec.core.sampling import SamplingOptions, distribution, penalty_windows, sample
from macspec.core.verify import accept


def exact_joint(pair: macspec.Pair, prompt: list[int], depth: int, **opts) -> dict[tuple, float]:
    """P(x_1..x_depth) under target-only sampling, by enumerating every prefix."""
    options = SamplingOptions(**opts)
    vocab = pair.vocab_size
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(depth):
        prefixes = [p for p, v in probs.items() if v > 0 and len(p) == max(map(len, probs))]
        seqs = mx.array([prompt + list(p) for p in prefixes])
        logits = pair.target(seqs)[:, -1, :vocab]
        rows = []
        for i, p in enumerate(prefixes):
            windows = penalty_windows(prompt + list(p), None, 1, options.repetition_context)
            rows.append(distribution(logits[i : i + 1], options, windows)[0])
        dist = np.array(mx.stack(rows))
        nxt = {}
        for i, p in enumerate(prefixes):
            for t in np.nonzero(dist[i] > 0)[0]:
                nxt[p + (int(t),)] = probs[p] * float(dist[i, t])
        probs = nxt
    return probs


def sample_prefixes(pair, prompt: list[int], depth: int, n: int, **options) -> Counter:
    """Counts of the first `depth` generated ids over n seeds."""
    counts: Counter = Counter()
    for seed in range(n):
        r = macspec.generate(pair, prompt, max_tokens=depth, seed=seed, **options)
        assert len(r.tokens) == depth
        counts[tuple(r.tokens)] += 1
    return counts


def chi_square(expected: dict[tuple, float], counts: Counter, min_expected: float = 5.0) -> float:
    """p-value of Pearson's test; cells expected below `min_expected` are pooled into one."""
    n = sum(counts.values())
    unexpected = [k for k in counts if expected.get(k, 0.0) == 0.0]
    if unexpected:
        return 0.0  # an impossible sequence was generated
    stat, dof, pool_e, pool_o = 0.0, -1, 0.0, 0
    for k, p in expected.items():
        e, o = n * p, counts.get(k, 0)
        if e < min_expected:
            pool_e, pool_o = pool_e + e, pool_o + o
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        dof += 1
    return float(chi2.sf(stat, max(dof, 1)))


def all_sequences(vocab: int, depth: int):
    return itertools.product(range(vocab), repeat=depth)


# The exactness tests' shared set-up (tests/core/test_exactness.py and the drafters' tests).
PROMPT = [3, 4, 5, 3]
DEPTH = (
    4  # token 1 is a plain step; tokens 2-4 come from one round with K=2 (accept, accept, bonus)
)
# Power (simulated from each broken rule's distribution, measured at N=1000): resampling from p
# gives p < 1e-5 in all of 400 simulated seed sets at N=1000 (600: 98%), on the n-gram drafter
# in 99.5% at 800 (600: 60%): the most subtle rule needs every one of the 1,000 samples.
N = 1000


def resample_from_p(p, q, drafts, key):
    """A classic bug: after a rejection, draw from p instead of norm(max(0, p - q))."""
    n, _ = accept(p, q, drafts, key)
    return n, sample(mx.take(p, n, axis=0)[None], mx.random.split(key)[1])[0]
