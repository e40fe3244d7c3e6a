"""Plain decoding one step ahead (engine/round.py): the next step is built and started from the
id still being computed. The tokens are those of one step at a time (same keys, same ids), the
caches end holding exactly the context, and the statistical test fails on a broken key order."""

import mlx.core as mx
import pytest
from exactness import chi_square, exact_joint, sample_prefixes

import macspec
import macspec.engine.round as engine
from macspec.engine.round import Target, Timing, decode
from macspec.engine.sampling import SamplingOptions


def plain_decode(pair, prompt, opts, *, max_tokens=20, eos=(), key=5):
    target = Target(pair.target, pair.vocab_size)
    rounds = decode(
        target,
        None,
        prompt,
        opts,
        max_tokens=max_tokens,
        num_draft=0,
        key=mx.random.key(key),
        eos_ids=set(eos),
        context_length=pair.context_length,
        timing=Timing(),
    )
    return target, rounds


@pytest.fixture(scope="module")
def endless(tiny_dirs):
    """The tiny pair with no end-of-text id: every answer has its full length."""
    p = macspec.load(*tiny_dirs)
    p.eos_token_ids = frozenset()
    return p


@pytest.fixture
def launches(monkeypatch):
    """How many steps were launched ahead (the only passes made rewindable in plain decoding)."""
    calls = []
    real = engine.next_id

    def spy(target, last, dist, key, rewindable=False):
        calls.append(rewindable)
        return real(target, last, dist, key, rewindable)

    monkeypatch.setattr(engine, "next_id", spy)
    return calls


def one_at_a_time(monkeypatch):
    monkeypatch.setattr(Target, "takes_lazy_ids", False)


OPTIONS = [
    {"temperature": 0.0},
    {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.02},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(map(str, o.values())))
def test_the_same_tokens_as_one_step_at_a_time(endless, monkeypatch, launches, options):
    options = {"max_tokens": 40, "speculative": False, "seed": 9, **options}
    ahead = macspec.generate(endless, "Once upon", **options)
    assert launches.count(True) == 39  # every step but the first was launched ahead
    one_at_a_time(monkeypatch)
    launches.clear()
    alone = macspec.generate(endless, "Once upon", **options)
    assert True not in launches
    assert ahead.tokens == alone.tokens
    assert len(ahead.tokens) == 40


def test_a_repetition_penalty_decodes_one_step_at_a_time(pair, launches):
    """Its distribution depends on the previous id's value, which a step ahead does not have."""
    options = {"max_tokens": 12, "speculative": False, "repetition_penalty": 1.3}
    r = macspec.generate(pair, "Once upon", **options)
    assert len(r.tokens) == 12
    assert True not in launches


def test_the_cache_holds_the_context_after_every_step(pair):
    prompt = pair.tokenizer.encode("The cat sat on the")
    target, rounds = plain_decode(pair, prompt, SamplingOptions(temperature=0.0), max_tokens=20)
    history = list(prompt)
    for r in rounds:
        history += r.emitted
        # Between rounds the next step has been launched: the cache is one id further on.
        assert target.offset == len(history) - (1 if r.finish_reason else 0)
        assert r.round_time > 0 and r.verify_time == r.round_time
    assert len(history) == len(prompt) + 20
    assert target.offset == len(history) - 1  # the finished generation launched nothing more


def test_a_step_launched_past_the_end_is_taken_back(pair):
    prompt = pair.tokenizer.encode("Once upon")
    opts = SamplingOptions(temperature=0.0)
    _, rounds = plain_decode(pair, prompt, opts, max_tokens=30)
    tokens = [t for r in rounds for t in r.emitted]
    # The 6th id as the end of text: the step after it was already running when it was read.
    target, rounds = plain_decode(pair, prompt, opts, max_tokens=30, eos={tokens[5]})
    emitted = [t for r in rounds for t in r.emitted]
    assert emitted == tokens[: tokens.index(tokens[5])]
    assert target.offset == len(prompt) + len(emitted)  # the context, the end id included
    # Closed between rounds by the consumer (a stop string, a client gone).
    target, rounds = plain_decode(pair, prompt, opts, max_tokens=30)
    for _ in range(3):
        next(rounds)
    rounds.close()
    assert target.offset == len(prompt) + 3 - 1
    # What the cache holds is the context: the next step gives the 4th id.
    logits = target.logits(mx.array([tokens[2]]))
    assert mx.argmax(logits[-1]).item() == tokens[3]


def test_a_sharded_target_is_fed_ids_it_can_send():
    """Rank 0 sends each pass's ids to the other ranks as a list: nothing is launched ahead."""
    from macspec.engine.distributed import LeaderTarget

    assert Target.takes_lazy_ids and not LeaderTarget.takes_lazy_ids


def test_plain_sampling_is_distributed_as_the_target(small_pair, launches):
    expected = exact_joint(small_pair, [3, 4, 5, 3], 3, temperature=1.0)
    counts = sample_prefixes(small_pair, [3, 4, 5, 3], 3, 1000, speculative=False, temperature=1.0)
    assert chi_square(expected, counts) > 1e-3
    assert True in launches


def test_the_test_detects_steps_that_share_a_key(small_pair, monkeypatch):
    """A step launched ahead with the key of the step before it: the ids are no longer drawn
    independently, and the statistical test above must see it."""
    real = engine.next_id
    last_key = {}

    def shared(target, last, dist, key, rewindable=False):
        key = last_key.get("key", key) if rewindable else key
        last_key["key"] = key
        return real(target, last, dist, key, rewindable)

    monkeypatch.setattr(engine, "next_id", shared)
    expected = exact_joint(small_pair, [3, 4, 5, 3], 3, temperature=1.0)
    counts = sample_prefixes(small_pair, [3, 4, 5, 3], 3, 1000, speculative=False, temperature=1.0)
    assert chi_square(expected, counts) < 1e-3
