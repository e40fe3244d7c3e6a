"""Plain steps one pass ahead (core/loop.py): a plain step starts the pass over its id before
reading it (Target.launch), and the next round, plain or speculative, uses that pass as its
first row. The tokens are those of one step at a time, the caches end holding exactly the
context, and the statistical tests fail on a launched pass whose logits are stale."""

import mlx.core as mx
import pytest
from support.drafts import make_draft
from support.exactness import chi_square, exact_joint, sample_prefixes
from support.tinymodels import make_tiny_model

import macspec
from macspec.api import stream as api
from macspec.base.errors import CacheError
from macspec.core import caches
from macspec.core.loop import Engine, Limits, Sampling, Timing, generate_rounds
from macspec.core.policy import FixedK, Policy
from macspec.core.sampling import SamplingOptions
from macspec.core.target import Target


def plain_decode(pair, prompt, opts, *, max_tokens=20, eos=(), key=5):
    target = Target(pair.target, pair.vocab_size)
    rounds = generate_rounds(
        Engine(target, None, FixedK(0), Timing()),
        prompt,
        Sampling(opts, mx.random.key(key)),
        Limits(max_tokens, frozenset(eos), pair.context_length),
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
    """The ids each launched pass fed (lazy arrays)."""
    fed = []
    real = Target.launch

    def spy(self, last):
        fed.append(last)
        real(self, last)

    monkeypatch.setattr(Target, "launch", spy)
    return fed


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
    assert len(launches) == 39  # every step's pass but the first was launched
    one_at_a_time(monkeypatch)
    launches.clear()
    alone = macspec.generate(endless, "Once upon", **options)
    assert not launches
    assert ahead.tokens == alone.tokens
    assert len(ahead.tokens) == 40


def test_a_repetition_penalty_is_applied_with_the_ids_read(endless, monkeypatch, launches):
    """The penalty needs the previous id's value: it is applied when the launched pass's logits
    are sampled, in the next round, with the ids read by then."""
    options = {"max_tokens": 24, "speculative": False, "seed": 4, "temperature": 1.0}
    options["repetition_penalty"] = 1.8
    ahead = macspec.generate(endless, "Once upon", **options)
    assert len(launches) == 23
    one_at_a_time(monkeypatch)
    assert macspec.generate(endless, "Once upon", **options).tokens == ahead.tokens


def test_the_cache_holds_the_context_after_every_step(pair):
    prompt = pair.tokenizer.encode("The cat sat on the")
    target, rounds = plain_decode(pair, prompt, SamplingOptions(temperature=0.0), max_tokens=20)
    history = list(prompt)
    for r in rounds:
        history += r.emitted
        assert target.offset == len(history) - 1
        # Between rounds the next pass has been launched: the layers hold one id more.
        assert caches.length(target.cache) == len(history) - (1 if r.finish_reason else 0)
        assert r.round_time >= r.verify_time > 0
    assert len(history) == len(prompt) + 20
    assert target.ahead is None  # the last step launched nothing


def test_a_pass_launched_past_the_end_is_taken_back(pair):
    prompt = pair.tokenizer.encode("Once upon")
    opts = SamplingOptions(temperature=0.0)
    _, rounds = plain_decode(pair, prompt, opts, max_tokens=30)
    tokens = [t for r in rounds for t in r.emitted]
    # The 6th id as the end of text: the pass after it was already running when it was read.
    target, rounds = plain_decode(pair, prompt, opts, max_tokens=30, eos={tokens[5]})
    emitted = [t for r in rounds for t in r.emitted]
    assert emitted == tokens[: tokens.index(tokens[5])]
    assert target.ahead is None
    assert caches.length(target.cache) == len(prompt) + len(emitted)  # the end id included
    # Closed between rounds by the consumer (a stop string, a client gone).
    target, rounds = plain_decode(pair, prompt, opts, max_tokens=30)
    for _ in range(3):
        next(rounds)
    rounds.close()
    assert target.ahead is None
    assert caches.length(target.cache) == len(prompt) + 3 - 1
    # What the cache holds is the context: the next step gives the 4th id.
    logits = target.logits(mx.array([tokens[2]]))
    assert mx.argmax(logits[-1]).item() == tokens[3]


def test_a_launched_pass_must_have_fed_the_id_read(pair):
    prompt = pair.tokenizer.encode("Once upon")
    target = Target(pair.target, pair.vocab_size)
    target.start(prompt)
    target.launch(mx.array([7]))
    assert target.offset == len(prompt) - 1
    with pytest.raises(CacheError, match="fed id 7, not 8"):
        target.logits(mx.array([8, 9]))


def test_a_sharded_target_is_fed_ids_it_can_send():
    """Rank 0 sends each pass's ids to the other ranks as a list: nothing is launched ahead."""
    from macspec.core.sharded import LeaderTarget

    assert Target.takes_lazy_ids and not LeaderTarget.takes_lazy_ids


class Alternate(Policy):
    """Plain, then k drafts, in turn, each plain step launching the pass the speculative round
    then starts from."""

    max_k = 2

    def __init__(self):
        self.turn = 0

    def next_k(self, label=None, launched=False, position=0):
        self.turn += 1
        return 0 if self.turn % 2 else 2

    def observe(self, k, accepted):
        pass

    def observe_time(self, k, tokens, seconds):
        pass

    def expects_plain(self):
        return True


def stale_launches(monkeypatch):
    """A broken launch: its pass runs, but the next round is handed the launch before's."""
    real = Target.launch
    memo = {}

    def stale(self, last):
        real(self, last)
        logits, hidden, fed = self.ahead
        previous = memo.get("logits")
        memo["logits"] = logits
        if previous is not None:
            self.ahead = (previous, hidden, fed)

    monkeypatch.setattr(Target, "launch", stale)


# Power: a stale launch moves the distribution far (chi-square ~5,000 on 33 degrees of freedom
# at N=1000, ~2,600 on 45 for the rounds); with N=300 it gives p < 1e-5 in every simulated
# seed set, and the exact paths still pass at 1e-3 as before.
N = 300


@pytest.mark.parametrize("broken", [False, True], ids=["launched", "stale"])
def test_plain_sampling_is_distributed_as_the_target(small_pair, launches, monkeypatch, broken):
    if broken:
        stale_launches(monkeypatch)
    prompt = [3, 4, 5, 3]
    expected = exact_joint(small_pair, prompt, 3, temperature=1.0)
    counts = sample_prefixes(small_pair, prompt, 3, N, speculative=False, temperature=1.0)
    assert (chi_square(expected, counts) > 1e-3) != broken
    assert launches or broken


@pytest.mark.parametrize("broken", [False, True], ids=["launched", "stale"])
def test_speculative_rounds_after_launched_passes_are_exact(
    small_pair, launches, monkeypatch, broken
):
    """Plain step (launching), 2 drafts verified from the launched pass, plain step, ...: the
    first 4 ids are distributed as the target's own, and the test sees a stale launch."""
    monkeypatch.setattr(api, "_fixed", lambda opts: Alternate())
    if broken:
        stale_launches(monkeypatch)
    prompt = [3, 4, 5, 3]
    options = {"temperature": 1.0, "adaptive": False, "num_draft": 2}
    expected = exact_joint(small_pair, prompt, 4, temperature=1.0)
    counts = sample_prefixes(small_pair, prompt, 4, N, **options)
    assert (chi_square(expected, counts) > 1e-3) != broken


def test_greedy_speculation_from_launched_passes_equals_plain(endless, monkeypatch, launches):
    plain = macspec.generate(endless, "Once upon", max_tokens=40, speculative=False)
    monkeypatch.setattr(api, "_fixed", lambda opts: Alternate())
    spec = macspec.generate(endless, "Once upon", max_tokens=40, adaptive=False)
    assert spec.tokens == plain.tokens
    assert spec.stats.speculative_rounds >= 10
    assert len(launches) >= 10 + 39


def test_a_feature_draft_gets_the_same_hidden_states_from_launched_passes(
    tmp_path, monkeypatch, launches
):
    """EAGLE drafts from the target's hidden states: a launched pass must hand it those of the
    ids it fed, so every round proposes exactly the drafts it proposes one step at a time."""
    target = make_tiny_model(tmp_path / "target", seed=0, hidden=48, tie=False, scale=2.0)
    pair = macspec.load(target, make_draft(tmp_path / "draft", target))
    pair.eos_token_ids = frozenset()
    monkeypatch.setattr(api, "_fixed", lambda opts: Alternate())

    def rounds():
        events = macspec.stream_generate(pair, "Once upon", max_tokens=30, adaptive=False)
        return [(e.accepted, e.rejected, e.emitted) for e in events]

    launched = rounds()
    assert len(launches) >= 10
    one_at_a_time(monkeypatch)
    assert rounds() == launched
