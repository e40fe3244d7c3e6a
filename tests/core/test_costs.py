"""The costs the adaptive policy prices rounds with: measured at load (a short context, and
the growth of each pass on caches padded to a long one), kept for the next load, priced at the
current context, and said in the load's note."""

import time
from dataclasses import replace

import pytest
from support.policies import policy_at
from support.tinymodels import make_tiny_model

import macspec
import macspec.core.target as target_module
from macspec.api.kept_costs import calibrate
from macspec.core import caches, measure
from macspec.core.adaptive import AdaptiveK
from macspec.core.policy import Costs
from macspec.cpu.state import STATE


@pytest.fixture(scope="module")
def roomy_pair(tmp_path_factory):
    """The tiny pair with room for calibrate()'s long prompt."""
    root = tmp_path_factory.mktemp("roomy")
    kw = {"seed": 0, "hidden": 48, "tie": False, "context": 1024}
    return macspec.load(
        make_tiny_model(root / "target", **kw), make_tiny_model(root / "draft", perturb=0.3, **kw)
    )


def test_calibration_measures_positive_costs(roomy_pair):
    c = calibrate(roomy_pair)
    assert c.plain_step > 0 and c.draft_step > 0
    # one more verified position's cost: what the 4-draft pass takes beyond a plain step, over 4
    # (the plain step the pass is compared with is at least c.plain_step, the faster of two)
    assert c.extra <= max(0.0, dict(c.verify)[4] - c.plain_step) / 4
    assert [k for k, _ in c.verify] == [1, 2, 4, 8, 16]
    assert all(t > 0 for _, t in c.verify)
    # The same after a long context (the pair's room: 1,024 - 256), for Costs.at: the short
    # costs, each grown by its pass's growth on padded caches (never less).
    far = c.later
    assert c.position == 32 and far.position == 768 and far.later is None
    assert far.plain_step >= c.plain_step > 0 and far.draft_step == c.draft_step
    assert [k for k, _ in far.verify] == [1, 2, 4, 8, 16]
    assert all(f >= t for (_, f), (_, t) in zip(far.verify, c.verify, strict=True))


def test_long_costs_add_each_widths_growth_to_the_short_ones(roomy_pair, monkeypatch):
    """grown(): a pass of w rows after n positions costs what it cost after the short prompt
    plus what a pass of w rows grows by there (timed on padded caches: here a fake clock of
    1 us a row per 100 cached positions), and Costs.at prices further contexts on that line."""
    seen = []

    def pass_time(model, cache, width):
        seen.append((width, caches.length(cache)))
        return 1e-3 + 1e-6 * width * caches.length(cache) / 100

    monkeypatch.setattr(measure, "_pass_time", pass_time)
    short = Costs(0.010, 0.004, 0.001, ((1, 0.011), (2, 0.012), (4, 0.014), (16, 0.030)), 32)
    far = measure.grown(roomy_pair, short, 732)
    # every width on the short cache and the padded one, taking turns, a warm-up cycle first
    assert sorted(set(seen)) == [(w, n) for w in (1, 2, 3, 5, 17) for n in (32, 732)]
    assert len(seen) == 5 * 2 * 4
    up = {w: 1e-6 * w * 7 for w in (1, 2, 3, 5, 17)}  # (732 - 32) / 100 = 7
    assert far.position == 732 and far.draft_step == short.draft_step  # the draft reads a window
    assert far.plain_step == pytest.approx(0.010 + up[1])
    assert dict(far.verify) == pytest.approx({n: t + up[n + 1] for n, t in short.verify})
    assert far.extra == pytest.approx(0.001 + (up[5] - up[1]) / 4)
    at = replace(short, later=far).at(32 + 4 * 700)  # four times as far past the short prompt
    assert at.pass_time(16) == pytest.approx(0.030 + 4 * up[17])


def test_long_costs_read_no_long_prompt_where_caches_pad(roomy_pair, prefilled, monkeypatch):
    padded = []
    real = measure.growth
    monkeypatch.setattr(measure, "growth", lambda *a, **k: padded.append(a[2]) or real(*a, **k))
    calibrate(roomy_pair)
    assert padded == [768] and max(prefilled) == 32  # only the short prompt was read


def test_caches_that_cannot_be_padded_read_a_long_prompt(roomy_pair, prefilled, monkeypatch):
    """Windows and recurrent states do not grow as full attention does: measured after a
    prompt of PREFILL_LONG ids, as before."""
    monkeypatch.setattr(measure, "growth", lambda *a, **k: None)
    c = calibrate(roomy_pair)
    assert c.later.position == measure.PREFILL_LONG and prefilled.count(measure.PREFILL_LONG) == 1


def test_a_draft_that_reads_the_whole_prompt_grows_too(roomy_pair, monkeypatch):
    grew = []
    real = measure.growth
    monkeypatch.setattr(measure, "growth", lambda *a, **k: grew.append(a[1]) or real(*a, **k))
    short = Costs(0.010, 0.004, 0.001, ((1, 0.011), (4, 0.014)), 32)
    monkeypatch.setattr(roomy_pair, "draft_context", 0)
    far = measure.grown(roomy_pair, short, 600)
    assert grew == [(1, 2, 5), (1,)] and far.draft_step >= short.draft_step
    monkeypatch.setattr(roomy_pair, "draft_context", 128)
    grew.clear()
    assert measure.grown(roomy_pair, short, 600).draft_step == short.draft_step
    assert grew == [(1, 2, 5)]


@pytest.fixture()
def padded(monkeypatch):
    """The long contexts the target's costs were grown to from now on (measure.growth)."""
    seen = []
    real = measure.growth

    def growth(model, widths, length, ids, reps=3):
        if len(widths) > 1:  # the target's (a draft's is timed at one row)
            seen.append(length)
        return real(model, widths, length, ids, reps)

    monkeypatch.setattr(measure, "growth", growth)
    return seen


@pytest.fixture()
def prefilled(monkeypatch):
    """The prompt length of every target start from now on (0: restored from a prompt cache)."""
    seen = []
    real = target_module.Target.start

    def start(self, prompt, max_step=1, cache=None):
        seen.append(len(prompt) if cache is None else 0)
        return real(self, prompt, max_step, cache)

    monkeypatch.setattr(target_module.Target, "start", start)
    return seen


def test_calibration_prefills_its_prompt_once(roomy_pair, prefilled):
    """The draft model's rounds leave the prompt's states for the filler's runs to restore."""
    calibrate(roomy_pair)
    assert prefilled.count(32) == 1 and prefilled.count(0) == 2  # once, then restored


def test_the_long_measurement_is_kept_for_the_next_load(
    roomy_pair, prefilled, padded, monkeypatch, tmp_path
):
    import json

    from macspec.api import kept_costs as cal

    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path))
    monkeypatch.setenv("MACSPEC_KEEP_COSTS", "1")
    # A tiny model's step (a millisecond) jitters by more than a real one's.
    monkeypatch.setattr(cal, "KEEP_SPREAD", 100.0)
    first = calibrate(roomy_pair)
    (kept,) = (tmp_path / "costs").glob("*.json")
    assert padded == [768]
    again = calibrate(roomy_pair)  # the short context measured again, the long one read
    assert padded == [768] and prefilled.count(32) == 2
    assert again.later == first.later and again.later.later is None
    # Stale, damaged or switched off: measured again (and kept again, whole).
    data = json.loads(kept.read_text())
    data["measured"] -= (cal.KEEP_DAYS + 1) * 86400
    kept.write_text(json.dumps(data))
    calibrate(roomy_pair)
    assert len(padded) == 2 and json.loads(kept.read_text())["measured"] > data["measured"]
    kept.write_text("{not json")
    calibrate(roomy_pair)
    assert len(padded) == 3
    # Kept while the machine ran far slower (or faster): this load measures its own.
    monkeypatch.setattr(cal, "KEEP_SPREAD", 0.25)
    for factor in (1000.0, 0.001):
        data = json.loads(kept.read_text())
        data["short_plain_step"] *= factor
        kept.write_text(json.dumps(data))
        calibrate(roomy_pair)
    assert len(padded) == 5
    monkeypatch.setenv("MACSPEC_KEEP_COSTS", "0")
    kept.unlink()
    calibrate(roomy_pair)
    assert len(padded) == 6 and not kept.exists()


def test_costs_kept_under_other_cpu_kernels_are_measured_again(
    roomy_pair, padded, monkeypatch, tmp_path
):
    from macspec.api import kept_costs as cal
    from macspec.core import hooks

    if hooks.installed().name != "cpu":
        pytest.skip("the CPU package is not installed")
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path))
    monkeypatch.setenv("MACSPEC_KEEP_COSTS", "1")
    monkeypatch.setattr(cal, "KEEP_SPREAD", 100.0)
    calibrate(roomy_pair)
    calibrate(roomy_pair)
    assert len(padded) == 1
    monkeypatch.setattr(STATE, "ext_build", "another build of the kernels")
    calibrate(roomy_pair)
    assert len(padded) == 2
    monkeypatch.setattr(STATE, "repack_weights", not STATE.repack_weights)
    calibrate(roomy_pair)
    assert len(padded) == 3


def test_a_short_context_pair_is_measured_once(pair):
    assert pair.context_length == 256  # no room for a long prompt
    assert calibrate(pair).later is None


# A short and a long context's costs (seconds): every pass reads all the cached positions.
SHORT = Costs(plain_step=1.0, draft_step=0.1, extra=0.1, verify=((1, 1.2), (4, 1.6)), position=32)
GROWING = Costs(
    plain_step=1.0,
    draft_step=0.1,
    extra=0.1,
    verify=((1, 1.2), (4, 1.6)),
    position=32,
    later=Costs(
        plain_step=1.5, draft_step=0.2, extra=0.3, verify=((1, 2.0), (4, 3.0)), position=544
    ),
)


def test_costs_grow_linearly_with_the_context():
    half = GROWING.at(288)
    assert (half.plain_step, half.draft_step, half.extra) == pytest.approx((1.25, 0.15, 0.2))
    assert dict(half.verify) == pytest.approx({1: 1.6, 4: 2.3})
    assert half.position == 288 and half.later is None
    far = GROWING.at(1056)  # past the long measurement: the same slope goes on
    assert far.plain_step == pytest.approx(2.0)
    assert dict(far.verify) == pytest.approx({1: 2.8, 4: 4.4})
    assert GROWING.at(0).plain_step == 1.0  # never below the short context's
    assert SHORT.at(5000) is SHORT  # measured at one context only: priced as measured
    # A long measurement below the short one (noise) does not make long contexts cheaper.
    noisy = Costs(1.0, 0.1, 0.1, ((1, 1.2),), 32, later=Costs(0.9, 0.05, 0.1, ((1, 1.1),), 544))
    assert noisy.at(2000).plain_step == 1.0 and dict(noisy.at(2000).verify) == {1: 1.2}
    # The plain step alone (what loop.Timing asks each round) is at()'s, everywhere.
    for costs in (GROWING, SHORT, noisy):
        for position in (0, 32, 288, 544, 1056, 5000):
            assert costs.plain_at(position) == costs.at(position).plain_step


def test_policy_prices_rounds_at_the_current_context():
    """Half the drafts accepted pays after a short prompt; after 2,000 tokens the passes cost
    so much more than a plain step that decoding plainly is faster."""
    assert policy_at(0.5, GROWING).next_k(position=40) >= 1
    late = policy_at(0.5, GROWING)
    assert late.next_k(position=2000) == 0
    assert late.now.plain_step == pytest.approx(1.0 + 0.5 * (1984 - 32) / 512)  # whole steps
    # Unmeasured growth (one context only): the same choice at every position.
    assert policy_at(0.5, SHORT).next_k(position=2000) >= 1


def test_decode_tells_the_policy_the_context_length(pair, monkeypatch):
    seen = []
    real = AdaptiveK.next_k

    def spy(self, label=None, launched=False, position=0):
        seen.append(position)
        return real(self, label, launched, position)

    monkeypatch.setattr(AdaptiveK, "next_k", spy)
    prompt = pair.tokenizer.encode("Tell me a story")
    events = list(macspec.stream_generate(pair, prompt, max_tokens=30, temperature=0))
    # Each round's choice is made with the ids the target's cache holds before it.
    held = [len(prompt) + sum(len(e.emitted) for e in events[:i]) - 1 for i in range(len(events))]
    assert seen == held[1:]  # (the first token comes from the prefill's step)


def test_the_calibration_note_says_both_contexts(pair, monkeypatch):
    monkeypatch.setattr(pair, "costs", GROWING)
    monkeypatch.setattr(pair, "calibration_time", 3.0)
    assert pair.calibration_note() == (
        "measured this machine in 3.0s: a plain step 1000 ms, verifying 4 drafts 1.60x that; "
        "after 544 tokens a plain step 1500 ms, 4 drafts 2.00x"
    )
    # A long measurement read from an earlier load says when it was made.
    monkeypatch.setattr(pair, "costs", replace(GROWING, measured=1e9))
    assert pair.calibration_note().endswith(
        time.strftime("4 drafts 2.00x (kept from %Y-%m-%d %H:%M)", time.localtime(0))
    )


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])  # sliding windows; recurrent
def test_growth_refuses_caches_that_do_not_grow_as_full_attention(arch):
    from support.archzoo import build_model, make_prompt

    assert measure.growth(build_model(arch), (1, 2), 200, make_prompt()) is None


def test_growth_times_a_padded_cache_and_leaves_the_model_as_it_was(roomy_pair):
    ids = [(7 * i) % roomy_pair.vocab_size for i in range(1, 33)]
    more = measure.growth(roomy_pair.target, (1, 3), 700, ids, reps=1)
    assert set(more) == {1, 3} and all(v >= 0.0 for v in more.values())
    # the padded passes ran over 700 positions: a fresh greedy answer is unchanged by them
    prompt = "hello there"
    a = macspec.generate(roomy_pair, prompt, max_tokens=8, temperature=0, speculative=False)
    more = measure.growth(roomy_pair.target, (1,), 700, ids, reps=1)
    b = macspec.generate(roomy_pair, prompt, max_tokens=8, temperature=0, speculative=False)
    assert a.text == b.text
