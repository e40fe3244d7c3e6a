"""Log probabilities (core/logprobs.py): each emitted id's, from the target's sampling
distribution after the transforms (and a grammar's mask), the same with and without speculation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import macspec
from macspec.core.sampling import SamplingOptions, distribution


def run(pair, prompt, **kw):
    events = list(macspec.stream_generate(pair, prompt, **kw))
    return [t for ev in events for t in ev.emitted], [x for ev in events for x in ev.logprobs]


def assert_same(a, b):
    assert [x.id for x in a] == [x.id for x in b]
    assert np.allclose([x.logprob for x in a], [x.logprob for x in b], atol=1e-4)
    for x, y in zip(a, b, strict=True):
        assert [i for i, _ in x.top] == [i for i, _ in y.top]
        assert np.allclose([v for _, v in x.top], [v for _, v in y.top], atol=1e-4)


@pytest.mark.parametrize(
    "extra", [{}, {"grammar": 'start: /[a-e ]+/ "."'}, {"repetition_penalty": 1.3}]
)
def test_greedy_logprobs_are_the_same_with_and_without_speculation(pair, extra):
    kw = {"max_tokens": 24, "top_logprobs": 5, **extra}
    ids, spec = run(pair, "hello there", num_draft=3, adaptive=False, **kw)
    plain_ids, plain = run(pair, "hello there", speculative=False, **kw)
    assert ids == plain_ids and len(spec) == len(ids) == 24
    assert_same(spec, plain)
    assert all(len(x.top) == 5 and x.top[0][0] == x.id for x in spec)  # greedy: the top one


def test_sampled_logprobs_are_the_targets_transformed_distribution(pair):
    """At T=0.7, top_k=8 the speculative answer's logprobs are the rows the target alone gives
    those ids (read by one forward pass over prompt + answer)."""
    opts = {"temperature": 0.7, "top_k": 8}
    prompt = pair.tokenizer.encode("once upon")
    ids, lps = run(pair, prompt, max_tokens=20, seed=3, num_draft=3, top_logprobs=8, **opts)
    logits = pair.target(mx.array([prompt + ids]))[0, len(prompt) - 1 : -1, : pair.vocab_size]
    with np.errstate(divide="ignore"):  # ids top-k leaves out: log 0
        ref = np.log(np.array(distribution(logits, SamplingOptions(**opts))))
    assert [x.id for x in lps] == ids
    assert np.allclose([x.logprob for x in lps], ref[np.arange(len(ids)), ids], atol=1e-4)
    for row, x in zip(ref, lps, strict=True):
        assert len(x.top) == 8  # top_k leaves 8 ids of probability > 0
        assert np.allclose([v for _, v in x.top], np.sort(row)[::-1][:8], atol=1e-4)


def test_stop_strings_cut_the_logprobs_with_the_ids(pair):
    full, _ = run(pair, "hello there", max_tokens=12, top_logprobs=0)
    stop = pair.tokenizer.decode(full[4:6])
    events = list(
        macspec.stream_generate(pair, "hello there", max_tokens=12, top_logprobs=0, stop=[stop])
    )
    for ev in events:
        assert [x.id for x in ev.logprobs] == list(ev.emitted)
        assert all(x.top == () for x in ev.logprobs)
