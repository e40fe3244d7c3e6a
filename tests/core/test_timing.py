"""The plain-decoding reference behind the statistics' "x plain" (loop.Timing): plain steps
that ran as plain decoding runs, timed from readout to readout as every round is, carried to a
round's context by the pair's measured costs. The load's calibration is not one of them."""

import time

import mlx.core as mx
import pytest

import macspec
from macspec.api.stream import _StatsCounter
from macspec.core.loop import Engine, Limits, Round, Sampling, Timing, generate_rounds
from macspec.core.policy import Costs, FixedK
from macspec.core.sampling import SamplingOptions
from macspec.core.target import Target

# A plain step of 20 ms after no cached ids, 60 ms after 4,096: 40 ms after 2,048.
COSTS = Costs(
    plain_step=0.02,
    draft_step=0.005,
    extra=0.002,
    position=0,
    later=Costs(plain_step=0.06, draft_step=0.005, extra=0.004, position=4096),
)


def test_a_plain_step_is_carried_to_another_context_by_the_costs():
    timing = Timing()
    assert timing.plain_step(2048) is None  # nothing observed, nothing measured
    assert timing.plain_step(2048, COSTS) == pytest.approx(0.04)  # the costs' own step there
    timing.observe_plain_step(0.03, 0)  # this run's steps: 1.5x what the load measured
    assert timing.plain_step(2048) == pytest.approx(0.03)  # without costs: as observed
    assert timing.plain_step(2048, COSTS) == pytest.approx(0.06)
    assert timing.plain_step(0, COSTS) == pytest.approx(0.03)
    timing.observe_plain_step(0.05, 2048)  # 1.25x there
    timing.observe_plain_step(0.02, 2048)  # 0.5x: the mean of the three is 1.0833x
    assert timing.plain_step(4096, COSTS) == pytest.approx(0.06 * 3.25 / 3)
    assert timing.plain_step(0, COSTS) == pytest.approx(0.02 * 3.25 / 3)


def _decode(pair, k, max_tokens, timing, pause=0.0):
    target = Target(pair.target, pair.vocab_size)
    drafter = pair.make_drafter(False) if k else None
    engine = Engine(target, drafter, FixedK(k), timing, costs=COSTS)
    rounds = generate_rounds(
        engine,
        pair.tokenizer.encode("Once upon a time"),
        Sampling(SamplingOptions(), mx.random.key(0)),
        Limits(max_tokens, frozenset(), pair.context_length),
    )
    out = []
    for r in rounds:
        out.append(r)
        time.sleep(pause)  # the caller's work between rounds (a chat drawing, a server sending)
    return out


def test_only_plain_steps_run_one_pass_ahead_are_observed(pair):
    timing = Timing()
    rounds = _decode(pair, 0, 10, timing)
    prompt = len(pair.tokenizer.encode("Once upon a time"))
    # The first step's pass was not launched by another: it is not plain decoding's pace.
    assert [p for p, _ in timing.recent] == list(range(prompt, prompt + 9))
    assert [s for _, s in timing.recent] == [r.verify_time for r in rounds[1:]]
    chains = Timing()
    _decode(pair, 3, 12, chains)
    assert not chains.recent  # speculative rounds after a first step that launched nothing


def test_every_round_alone_counts_the_callers_time_since_the_last(pair):
    for k in (0, 3):
        rounds = _decode(pair, k, 8, Timing(), pause=0.05)
        assert len(rounds) > 1
        assert all(r.round_time >= 0.05 for r in rounds[1:]), k
        assert all(r.draft_time + r.verify_time < r.round_time for r in rounds[1:] if r.num_draft)


def test_a_rounds_reference_is_the_plain_step_at_its_context(pair):
    timing = Timing()
    timing.observe_plain_step(0.03, 0)
    rounds = _decode(pair, 3, 12, timing)
    prompt = len(pair.tokenizer.encode("Once upon a time"))
    held = prompt - 1
    for r in rounds:
        assert r.plain_step_time == pytest.approx(timing.plain_step(held, COSTS))
        held += len(r.emitted)
    assert rounds[-1].plain_step_time > rounds[0].plain_step_time  # grown with the context


def test_the_load_leaves_the_timing_to_real_steps(tiny_dirs):
    p = macspec.load(*tiny_dirs)
    assert p.costs is not None and not p.timing.recent  # calibration timed apart
    spec = macspec.generate(p, "Hi", max_tokens=6, num_draft=2, adaptive=False)
    assert spec.stats.plain_step_time > 0  # priced by the costs until a plain step is seen
    macspec.generate(p, "Hi", max_tokens=6, speculative=False)
    assert len(p.timing.recent) == 5


def _round(emitted, plain, seconds):
    return Round([], [], emitted, None, 0, 0.0, seconds, seconds, plain, None)


def test_the_answers_reference_weighs_each_rounds_by_its_tokens():
    counter = _StatsCounter(prompt_tokens=4, seed=0)
    counter.add(_round([1, 2, 3], 0.01, 0.02), 3)
    counter.add(_round([4], 0.02, 0.02), 1)
    counter.add(_round([5], 0.0, 0.02), 1)  # a round with no reference counts in neither sum
    s = counter.stats()
    assert s.plain_step_time == pytest.approx((3 * 0.01 + 0.02) / 4)
    assert s.tokens_per_second == pytest.approx(5 / 0.06)
