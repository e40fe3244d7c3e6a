"""Greedy equality, cache rewinding, stops, statistics and streaming events."""

import mlx.core as mx
import pytest

import macspec
from macspec.base.errors import CacheError
from macspec.core import caches
from macspec.core.drafters import ModelDrafter
from macspec.core.loop import Engine, Limits, Sampling, Timing, generate_rounds
from macspec.core.policy import FixedK
from macspec.core.round import Step, alone, chain_round, tree_round
from macspec.core.sampling import SamplingOptions
from macspec.core.target import Target
from macspec.core.tree import TreeShape
from macspec.core.verify import make_dist

PROMPTS = ["Once upon", "The cat sat on the", "42 is", [1, 20, 30, 40, 50, 60]]


@pytest.mark.parametrize("prompt", PROMPTS, ids=str)
def test_greedy_speculative_equals_greedy_target_only(pair, prompt):
    plain = macspec.generate(pair, prompt, max_tokens=48, speculative=False)
    assert plain.stats.drafted == 0
    rejected = 0
    for k in (1, 2, 3, 5, 8):
        spec = macspec.generate(pair, prompt, max_tokens=48, num_draft=k, adaptive=False)
        assert spec.tokens == plain.tokens, f"K={k}"
        assert spec.text == plain.text
        rejected += spec.stats.drafted - spec.stats.accepted
    assert rejected > 0  # the draft disagrees sometimes, so rewinding was exercised


def test_same_seed_same_tokens(pair):
    # Fixed K: adaptive K follows observed round times, and another K draws other randomness.
    opts = {"max_tokens": 30, "temperature": 0.9, "adaptive": False}
    a = macspec.generate(pair, "Hi", seed=11, **opts)
    b = macspec.generate(pair, "Hi", seed=11, **opts)
    c = macspec.generate(pair, "Hi", seed=12, **opts)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def _fresh_logits(model, tokens):
    return model(mx.array(tokens)[None])[0, -1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_after_rejections_match_fresh_recomputation(pair, temperature):
    target = Target(pair.target, pair.vocab_size)
    drafter = ModelDrafter(pair.draft, pair.vocab_size)
    prompt = pair.tokenizer.encode("Rewind me")
    history = list(prompt)
    rounds = generate_rounds(
        Engine(target, drafter, FixedK(4), Timing()),
        prompt,
        Sampling(SamplingOptions(temperature=temperature), mx.random.key(3)),
        Limits(60, frozenset(), pair.context_length),
    )
    rejections = 0
    for r in rounds:
        history += r.emitted
        rejections += len(r.rejected)
        # Target cache: everything but the last id; feeding it must match a fresh pass.
        assert target.offset == len(history) - 1
        cached = pair.target(mx.array(history[-1:])[None], cache=target.cache)[0, -1]
        target.trim_to(len(history) - 1)  # undo the check's own step
        assert mx.allclose(cached, _fresh_logits(pair.target, history), atol=1e-4)
        # Draft cache: everything but its pending ids.
        assert drafter.cache[0].offset + len(drafter.pending) == len(history)
        assert drafter.pending == history[len(history) - len(drafter.pending) :]
    assert rejections > 0


@pytest.mark.parametrize("k", [3, TreeShape(2, 2, 4)], ids=["chain", "tree"])
def test_a_round_that_fails_half_way_keeps_nothing(pair, monkeypatch, k):
    """round.Rewind: a round whose target pass fails after feeding its ids leaves the target
    and the drafter where the round began (the next round would start clean)."""
    target = Target(pair.target, pair.vocab_size)
    drafter = ModelDrafter(pair.draft, pair.vocab_size)
    prompt = pair.tokenizer.encode("Rewind me")
    target.start(prompt, max_step=8)
    drafter.start(prompt, max_step=8)
    # The ids the drafter holds, read (its cache) or waiting (pending): a round may read the
    # waiting ones first (the prompt, after start), which its failure need not undo.
    before = (target.offset, caches.length(drafter.cache) + len(drafter.pending))
    real = Target.logits

    def broken(self, tokens, rewindable=False):  # the pass runs (the caches grow), then fails
        mx.eval(real(self, tokens, rewindable))
        raise CacheError("broken on purpose")

    monkeypatch.setattr(Target, "logits", broken)
    step = Step(prompt[-1], k, make_dist(SamplingOptions(), prompt), mx.random.key(0), 0.0)
    with pytest.raises(CacheError, match="on purpose"):
        if isinstance(k, TreeShape):
            tree_round(target, drafter, step)
        else:
            alone(chain_round(target, drafter, step))
    assert (target.offset, caches.length(drafter.cache) + len(drafter.pending)) == before
    assert drafter.pending == prompt[len(prompt) - len(drafter.pending) :]


def test_max_tokens_smaller_than_k(pair):
    plain = macspec.generate(pair, "Short", max_tokens=3, speculative=False)
    for max_tokens in (1, 2, 3):
        r = macspec.generate(pair, "Short", max_tokens=max_tokens, num_draft=6, adaptive=False)
        assert r.tokens == plain.tokens[:max_tokens]
        assert r.finish_reason == "length"
        assert r.stats.generated_tokens == max_tokens


def test_never_overshoots_max_tokens_when_all_drafts_accepted(tiny_dirs):
    same = macspec.load(tiny_dirs[0], tiny_dirs[0], drafter="model")
    for max_tokens in range(1, 12):
        r = macspec.generate(same, "Go", max_tokens=max_tokens, num_draft=4, adaptive=False)
        assert len(r.tokens) == max_tokens


def test_eos_inside_an_accepted_run(tiny_dirs):
    # Every draft accepted (drafter="model": a copied n-gram may be rejected): EOS lands mid-round
    same = macspec.load(tiny_dirs[0], tiny_dirs[0], drafter="model")
    plain = macspec.generate(same, "The end", max_tokens=40, speculative=False)
    eos = plain.tokens[9]
    first = plain.tokens.index(eos)
    same.eos_token_ids = frozenset({eos})
    r = macspec.generate(same, "The end", max_tokens=40, num_draft=5, adaptive=False)
    assert r.tokens == plain.tokens[:first]
    assert r.finish_reason == "stop"
    assert r.stats.accepted == r.stats.drafted  # the EOS came from an accepted draft run


def test_stop_string_cuts_text_and_tokens(pair):
    plain = macspec.generate(pair, "Stop here", max_tokens=40, speculative=False)
    text = plain.text
    stop = text[12:15]
    cut = text.index(stop)
    r = macspec.generate(
        pair, "Stop here", max_tokens=40, num_draft=4, stop=[stop, "never"], adaptive=False
    )
    assert r.finish_reason == "stop_string"
    assert r.text == text[:cut]
    # Tokens run up to and including the one that completed the stop string.
    assert r.tokens == plain.tokens[: len(r.tokens)]
    assert pair.tokenizer.decode(r.tokens).startswith(text[:cut] + stop)
    assert not pair.tokenizer.decode(r.tokens[:-1]).startswith(text[:cut] + stop)


def test_stream_events_add_up(pair):
    stream = macspec.stream_generate(
        pair, "Count", max_tokens=25, num_draft=3, temperature=0.8, seed=2, adaptive=False
    )
    events = list(stream)
    result = macspec.generate(
        pair, "Count", max_tokens=25, num_draft=3, temperature=0.8, seed=2, adaptive=False
    )
    assert [t for e in events for t in e.emitted] == result.tokens
    assert "".join(e.text for e in events) == result.text
    assert not events[0].speculative and events[0].num_draft == 0  # first token: a timed plain step
    for e in events[1:]:
        assert e.speculative
        assert e.num_draft == len(e.accepted) + len(e.rejected)
        if e.target_token is not None:
            assert e.emitted == e.accepted + (e.target_token,)
        assert e.plain_step_time > 0 and e.round_time > 0
    s = stream.stats()
    assert events[-1].stats == s and s.generated_tokens == 25  # the last event's totals are final
    # The same seed gives the same rounds (timings and the prompt cache's share aside).
    same = ("rounds", "speculative_rounds", "drafted", "accepted", "per_position_acceptance")
    assert {f: getattr(s, f) for f in same} == {f: getattr(result.stats, f) for f in same}
    assert s.drafted == sum(e.num_draft for e in events)
    assert s.accepted == sum(len(e.accepted) for e in events)
    assert s.acceptance_rate == s.accepted / s.drafted
    assert s.speculative_rounds == len(events) - 1
    assert s.mean_accepted_length == sum(len(e.emitted) for e in events[1:]) / (len(events) - 1)
    assert len(s.per_position_acceptance) == 3
    # The counts behind the rates, by position: a draft at position i was proposed in every
    # round of more than i drafts, accepted in every round that kept more than i.
    assert s.drafted_at == tuple(sum(e.num_draft > i for e in events) for i in range(3))
    assert s.accepted_at == tuple(sum(len(e.accepted) > i for e in events) for i in range(3))
    assert s.per_position_acceptance == tuple(
        a / d for a, d in zip(s.accepted_at, s.drafted_at, strict=True)
    )
    assert events[-1].finish_reason == "length"


def test_stopping_a_stream_early_leaves_the_pair_ready(pair):
    stream = macspec.stream_generate(pair, "Again", max_tokens=200, num_draft=3)
    next(stream), next(stream)
    stream.close()
    a = macspec.generate(pair, "Again", max_tokens=20, num_draft=3)
    b = macspec.generate(pair, "Again", max_tokens=20, speculative=False)
    assert a.tokens == b.tokens


def test_padded_embedding_rows_are_never_sampled(small_pair):
    assert small_pair.vocab_size == 7  # 9 embedding rows, 7 tokens
    for seed in range(20):
        r = macspec.generate(small_pair, [3, 4], max_tokens=8, temperature=2.0, seed=seed)
        assert max(r.tokens) < 7


def test_generation_stops_at_the_context_length(tmp_path):
    from support.tinymodels import make_tiny_model

    d = make_tiny_model(tmp_path / "m", context=16)
    pair = macspec.load(d, d)
    pair.eos_token_ids = frozenset()
    r = macspec.generate(pair, [5, 6, 7, 8, 9], max_tokens=100, num_draft=4, adaptive=False)
    assert r.finish_reason == "context"
    assert len(r.tokens) == 16 - 5


def test_sample_follows_the_probabilities_and_never_picks_a_zero():
    """The inverse-CDF sampler: frequencies match unnormalised weights (chi-square), ids of
    probability 0 (leading, inner and trailing) never come out, and one-hot rows are exact."""
    from scipy.stats import chisquare

    from macspec.core.sampling import sample

    weights = mx.array([[0.0, 2.0, 0.0, 5.0, 3.0, 0.0]])  # sums to 10: unnormalised
    keys = mx.random.split(mx.random.key(7), 4000)
    drawn = mx.concatenate([sample(weights, k) for k in keys]).tolist()
    counts = [drawn.count(i) for i in range(6)]
    assert counts[0] == counts[2] == counts[5] == 0
    assert chisquare([counts[1], counts[3], counts[4]], [800, 2000, 1200]).pvalue > 1e-3
    rows = mx.array([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    assert sample(rows, mx.random.key(1)).tolist() == [2, 0, 1]


@pytest.mark.parametrize(
    "options",
    [
        SamplingOptions(),
        SamplingOptions(temperature=0.8, top_p=0.7, repetition_penalty=1.5),
        SamplingOptions(temperature=1.2, top_k=3, min_p=0.05, repetition_penalty=0.8),
    ],
    ids=["greedy", "top-p+penalty", "top-k+min-p+penalty"],
)
def test_distribution_over_a_drafter_vocabulary_equals_the_full_one(options):
    """make_dist with `columns` (a drafter's own ids) gives the full-vocabulary distribution
    restricted to those ids, the repetition penalty included (windows hold ids the drafter
    lacks, which must not shift anything)."""
    from macspec.core.verify import make_dist

    vocab, ids = 12, [1, 2, 4, 7, 8, 11]
    logits_small = mx.array([[2.0, -1.0, 0.5, 3.0, 1.5, -0.2], [0.1, 2.5, -0.7, 0.3, 1.9, 2.4]])
    full = mx.put_along_axis(
        mx.full((2, vocab), -mx.inf),
        mx.broadcast_to(mx.array(ids)[None], (2, 6)),
        logits_small,
        axis=-1,
    )
    columns = mx.array([ids.index(i) if i in ids else len(ids) for i in range(vocab)])
    dist = make_dist(options, [3, 7, 5, 2, 9])  # history with ids in and out of the drafter's
    extra = mx.array([8])
    want = dist.probs(full, extra, 0)
    got = dist.probs(logits_small, extra, 0, columns)
    assert mx.allclose(got, want[:, mx.array(ids)], atol=1e-6).item()
    assert mx.allclose(want.sum(axis=1), mx.ones(2), atol=1e-5).item()
