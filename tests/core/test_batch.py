"""Several generations verified in one target pass (core/batch.py, core/batch_rounds.py): each
answer is exactly what the same request gets alone, greedy and by seed, for rows with a draft
model, an n-gram copy and none, of different prompt lengths, joining and leaving; a long prompt
is read in chunks between the others' rounds; a pass that fails rewinds every row."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import mlx.core as mx
import pytest
from support.batching import open_row, run_batch, variants

import macspec
from macspec.api import stream as api
from macspec.api.options import GenerationOptions
from macspec.base.errors import CacheError
from macspec.core import hooks
from macspec.core.batch import shared_pass, shared_reason
from macspec.core.batch_k import PassPrices
from macspec.core.batch_rounds import PREFILL_CHUNK, BatchDriver, Row, row_rounds
from macspec.core.tally import Tally
from macspec.cpu.state import STATE

PROMPTS = [
    "the cat sat on the mat",
    "a b c a b c a b c a b",
    "once upon a time there was a little dog who ran and ran",
    "hello",
]


def first_rounds_and_answers(driver, requests, chunk):
    """Run `requests` [(pair, prompt, options)] as one batch, prompts read `chunk` ids at a
    time: the round that gave each row its first Round, and each answer's ids."""
    streams = dict(enumerate(open_row(p, prompt, chunk=chunk, **o) for p, prompt, o in requests))
    first, answers, n = [0] * len(requests), [[] for _ in requests], 0
    while streams:
        n += 1
        keys = list(streams)
        for i, (_, got) in zip(keys, driver.round([streams[i][1] for i in keys]), strict=True):
            assert not isinstance(got, Exception)
            if got is not None:
                first[i] = first[i] or n
                event = next(streams[i][0])
                answers[i] += event.emitted
                if event.finish_reason:
                    del streams[i]
    return first, answers


def alone(pair, prompt, **options):
    return macspec.generate(pair, prompt, **options).tokens


@pytest.fixture(scope="module")
def kinds(pair):
    return variants(pair)


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    """A pair whose drafter reads the target's hidden states (EAGLE, as the default pair's)."""
    from support.drafts import make_draft
    from support.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("batch-eagle")
    target = make_tiny_model(root / "target", seed=0, hidden=48, tie=False, scale=2.0)
    draft = make_draft(root / "draft", target, vocab_ids=[i for i in range(66) if i % 5 != 4])
    return variants(macspec.load(target, draft))


def test_the_tiny_pair_shares_passes(pair):
    assert shared_reason(pair.target, pair.vocab_size, pair.cache_kinds, False) == ""
    assert shared_reason(pair.target, pair.vocab_size, pair.cache_kinds, True) == (
        "a sharded target"
    )
    assert "window" in shared_reason(pair.target, pair.vocab_size, {"window": 2}, False)


@pytest.mark.parametrize("options", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}])
def test_each_answer_is_what_it_gets_alone(kinds, options):
    opts = {"max_tokens": 24, "adaptive": False, **options}
    requests = [
        (kinds["model"], PROMPTS[0], opts),
        (kinds["ngram"], PROMPTS[1], opts),
        (kinds["plain"], PROMPTS[2], opts),
        (kinds["model"], PROMPTS[3], {**opts, "num_draft": 2}),
    ]
    driver = BatchDriver(kinds["model"].target, kinds["model"].vocab_size)
    got, sizes = run_batch(driver, requests, join_after={3: 3})
    want = [alone(p, prompt, **o) for p, prompt, o in requests]
    assert got == want
    assert max(sizes) == 4 and driver.passes > 0
    assert driver.shared_rows > driver.passes  # rows really shared passes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_whose_drafter_reads_hidden_states_get_what_they_get_alone(eagle, temperature):
    opts = {"max_tokens": 24, "adaptive": False, "temperature": temperature, "seed": 3}
    requests = [
        (eagle["model"], PROMPTS[0], opts),
        (eagle["plain"], PROMPTS[1], opts),
        (eagle["model"], PROMPTS[2], {**opts, "num_draft": 3}),
    ]
    driver = BatchDriver(eagle["model"].target, eagle["model"].vocab_size)
    got, _ = run_batch(driver, requests, join_after={2: 2})
    assert got == [alone(p, prompt, **o) for p, prompt, o in requests]
    assert driver.shared_rows > driver.passes


def test_a_long_prompt_is_read_in_chunks_between_the_others_rounds(kinds):
    opts = {"max_tokens": 30, "temperature": 0.0, "adaptive": False}
    long_ids = [(5 * i + 1) % 60 + 3 for i in range(3 * PREFILL_CHUNK + 10)]
    requests = [(kinds["model"], PROMPTS[0], opts), (kinds["ngram"], long_ids, opts)]
    driver = BatchDriver(kinds["model"].target, kinds["model"].vocab_size)
    streams = dict(enumerate(open_row(p, prompt, **o) for p, prompt, o in requests))
    first = [0, 0]  # the round that gave each row its first Round
    for n in range(1, 6):
        keys = list(streams)
        for i, (_, got) in zip(keys, driver.round([streams[i][1] for i in keys]), strict=True):
            assert not isinstance(got, Exception)
            if got is not None:
                first[i] = first[i] or n
                if next(streams[i][0]).finish_reason:
                    del streams[i]
    # The short row answers from the first round on; the long one reads its 3 chunks first.
    assert first == [1, 4]


def test_a_long_prompt_is_read_in_chunks_where_the_drafter_reads_hidden_states(eagle):
    # The hidden states of every chunk, in order, feed the EAGLE draft: what the row gets alone.
    opts = {"max_tokens": 20, "temperature": 0.0, "adaptive": False}
    chunk = 64  # the tiny target's context holds 256 ids
    long_ids = [(7 * i + 2) % 60 + 3 for i in range(2 * chunk + 5)]
    requests = [(eagle["model"], PROMPTS[2], opts), (eagle["model"], long_ids, opts)]
    driver = BatchDriver(eagle["model"].target, eagle["model"].vocab_size)
    first, answers = first_rounds_and_answers(driver, requests, chunk)
    assert first == [1, 3]  # the long row reads its prompt in 3 chunks first
    assert answers == [alone(p, prompt, **o) for p, prompt, o in requests]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_model_reads_a_long_prompt_in_chunks_too(kinds, temperature):
    # The target's chunks, then the draft model's (resumed from its own state after each): the
    # same answer as alone, greedy and by seed.
    opts = {"max_tokens": 20, "temperature": temperature, "seed": 5, "adaptive": False}
    chunk = 64
    shift = int(temperature * 7)  # not a prompt the pair's prompt cache holds from the other case
    long_ids = [(3 * i + 4 + shift) % 60 + 3 for i in range(2 * chunk + 5)]
    requests = [(kinds["model"], PROMPTS[0], opts), (kinds["model"], long_ids, opts)]
    driver = BatchDriver(kinds["model"].target, kinds["model"].vocab_size)
    first, answers = first_rounds_and_answers(driver, requests, chunk)
    assert first == [1, 5]  # 3 chunks of the target's, then 3 of the draft's
    assert answers == [alone(p, prompt, **o) for p, prompt, o in requests]


def test_a_failed_shared_pass_rewinds_every_row(kinds, monkeypatch):
    opts = {"max_tokens": 8, "temperature": 0.0, "adaptive": False}
    streams = [open_row(kinds["model"], p, **opts) for p in PROMPTS[:2]]
    driver = BatchDriver(kinds["model"].target, kinds["model"].vocab_size)
    rows = [row for _, row in streams]
    driver.round(rows)  # the first round: plain steps
    targets = [row.rounds.gi_frame.f_locals["engine"].target for row in rows]
    lengths = [t.offset for t in targets]

    def broken(*args, **kwargs):  # the pass runs (every row's cache grows), then fails
        mx.eval(shared_pass(*args, **kwargs))
        raise CacheError("broken on purpose")

    monkeypatch.setattr("macspec.core.batch_rounds.shared_pass", broken)
    results = driver.round(rows)
    assert all(isinstance(got, CacheError) for _, got in results)
    assert [t.offset for t in targets] == lengths  # each row back where its round began


def test_a_4bit_model_with_int8_activations_gives_each_row_its_own_logits_bit_for_bit(
    tmp_path, monkeypatch
):
    # One attention over left-padded rows changed a row's logits by rounding, which int8
    # activations turned into quantization steps (the 1.5B real pair: 2e-2 of their scale).
    import mlx.nn as nn
    from mlx_lm.utils import load as mlx_load
    from support.tinymodels import make_tiny_model

    from macspec.core.batch import _check
    from macspec.cpu import kernels, products

    if not products.enabled():
        pytest.skip("no native products here")
    monkeypatch.setattr(STATE, "int8_activations", True)
    model, _ = mlx_load(str(make_tiny_model(tmp_path / "m", seed=3, hidden=64, scale=2.0)))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    kernels.accelerate(model)
    vocab = model.args.vocab_size
    assert _check(model, vocab) == 0.0
    assert shared_reason(model, vocab, {"attention": 2}, False) == ""


def three_rows(pair):
    """Three rows of a shared pass: (prompt, fed ids) each, and (its cache after the prompt, the
    fed ids) each."""
    from mlx_lm.models.cache import make_prompt_cache

    feeds = [([3, 4, 5], [6]), ([7], [8, 9, 10, 11]), ([12, 13], [14, 15])]
    rows = []
    for prompt, fed in feeds:
        cache = make_prompt_cache(pair.target)
        pair.target(mx.array(prompt)[None], cache=cache)
        rows.append((cache, mx.array(fed)))
    return feeds, rows


def test_one_shared_pass_gives_each_rows_own_logits(pair):
    feeds, rows = three_rows(pair)
    together = shared_pass(pair.target, pair.vocab_size, rows, hidden=True)
    for (p, f), (got, states) in zip(feeds, together, strict=True):
        want = pair.target(mx.array(p + f)[None])[0, len(p) :, : pair.vocab_size]
        assert got.shape == want.shape
        assert mx.allclose(got, want, atol=1e-4).item()
        trunk = pair.target.model(mx.array(p + f)[None])[0, len(p) :]
        assert mx.allclose(states, trunk, atol=1e-4).item()


@contextmanager
def rows_layer(function):
    """The shared pass's layers run by `function` (hooks.rows_layer) for the duration."""
    old = hooks.installed()
    hooks.install(dataclasses.replace(old, rows_layer=function))
    try:
        yield
    finally:
        hooks.install(old)


BY_MODULE = hooks.Hooks().rows_layer  # the core's own: each row's attention through the module


def test_a_shared_pass_reads_each_attention_weight_once_for_all_rows(pair):
    """llama/qwen2 attention's q/k/v/o products run once over the block (row-wise: each row's
    logits stay its own, bit for bit, as `_check` finds), not once per row and its padding
    (the core's own path, the accelerator's layer off)."""
    with rows_layer(BY_MODULE):
        _shared_pass_reads_each_weight_once(pair)


def _shared_pass_reads_each_weight_once(pair):
    from macspec.core.batch import _check

    attn = pair.target.model.layers[0].self_attn
    calls = {}

    def counted(name):
        own = attn[name]

        def call(x):
            calls[name] = calls.get(name, 0) + 1
            return own(x)

        return call

    _, rows = three_rows(pair)
    own = {name: attn[name] for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    try:
        for name in own:
            attn[name] = counted(name)
        shared_pass(pair.target, pair.vocab_size, rows)
    finally:
        for name, module in own.items():
            attn[name] = module
    assert calls == {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 1}
    assert _check(pair.target, pair.vocab_size) == 0.0


def _pass(pair, rows):
    out = shared_pass(pair.target, pair.vocab_size, rows, hidden=True)
    mx.eval(out)
    return out


def test_the_cpu_layer_of_a_shared_pass_gives_each_row_its_own_bits(pair):
    """The CPU's shared-pass layer (cpu/rows.py: q/k/v over the block, each row's attention over
    its own cache and the MLP in one primitive) runs for every layer, and every row of widths 1,
    4 and 2 gets the logits, hidden states and cache the module path gives and it gets alone."""
    from macspec.cpu import kernels
    from macspec.cpu import rows as cpu_rows

    if kernels.native_layers() is None or hooks.installed().name != "cpu":
        pytest.skip("no native layers here")
    taken = []

    def counted(*args):
        out = cpu_rows.rows_layer(*args)
        taken.append(out is not None)
        return out

    with rows_layer(counted):
        _, fast_rows = three_rows(pair)
        fast = _pass(pair, fast_rows)
    assert taken == [True] * len(pair.target.model.layers)
    with rows_layer(BY_MODULE):
        _, slow_rows = three_rows(pair)
        slow = _pass(pair, slow_rows)
    _, alone_rows = three_rows(pair)
    alone = [_pass(pair, [row])[0] for row in alone_rows]
    for got, by_module, by_itself in zip(fast, slow, alone, strict=True):
        for a, b, c in zip(got, by_module, by_itself, strict=True):
            assert mx.array_equal(a, b).item() and mx.array_equal(a, c).item()
    for (fc, _), (sc, _) in zip(fast_rows, slow_rows, strict=True):
        for f, s in zip(fc, sc, strict=True):
            assert f.offset == s.offset
            for x, y in ((f.keys, s.keys), (f.values, s.values)):
                assert mx.array_equal(x[..., : f.offset, :], y[..., : s.offset, :]).item()


def test_a_row_alone_in_its_round_runs_generate_rounds_own_round(kinds):
    """Alone, a row launches a plain step's next pass ahead (Target.launch), as alone it would,
    and drops it when others join."""
    opts = {"max_tokens": 12, "temperature": 0.0, "speculative": False}
    driver = BatchDriver(kinds["model"].target, kinds["model"].vocab_size)
    made = {}

    def rounds(*args, **kwargs):
        made["row"] = Row(row_rounds(*args, company=lambda: driver.company, **kwargs))
        return made["row"]

    pair = kinds["plain"]
    stream = api.open_stream(
        pair, api.prompt_ids(pair, PROMPTS[0]), GenerationOptions(**opts), rounds
    )
    row, target = made["row"], None
    got = []
    for _ in range(3):
        driver.round([row])
        got += next(stream).emitted
        target = target or row.rounds.gi_frame.f_locals["engine"].target
        assert target.ahead is not None and driver.passes == 0
    other, other_row = open_row(kinds["model"], PROMPTS[1], **opts)
    while True:
        results = driver.round([row, other_row])
        assert target.ahead is None
        ev = next(stream)
        got += ev.emitted
        if results[1][1] is not None and next(other).finish_reason:
            pass
        if ev.finish_reason:
            break
    assert got == alone(pair, PROMPTS[0], **opts)
    assert driver.passes > 0


class Pricey(dict):
    """Pass prices where any pass wider than plain steps costs 100 s (and stays so)."""

    def get(self, key, default=None):
        price = Tally(PassPrices.DECAY)
        price.add(0.01 if key[1] == 1 else 100.0, 1.0)
        return price


@pytest.mark.parametrize("wide", ["measured", "pricey"])
def test_adaptive_rows_with_their_k_chosen_for_the_batch_get_what_they_get_alone(kinds, wide):
    """Four adaptive rows (the batch chooses their K, batch_k.py) answer as alone, greedy: with
    the pair's measured costs, and where every wide pass is priced out (no drafts at all)."""
    opts = {"max_tokens": 20, "temperature": 0.0}
    requests = [(kinds["model"], p, opts) for p in PROMPTS[:3]] + [
        (kinds["ngram"], PROMPTS[1], opts)
    ]
    driver = BatchDriver(kinds["model"].target, kinds["model"].vocab_size)
    if wide == "pricey":
        driver.prices.seen = Pricey()
    got, sizes = run_batch(driver, requests)
    assert got == [alone(p, prompt, **o) for p, prompt, o in requests]
    assert max(sizes) == 4 and driver.shared_rows > driver.passes
    if wide == "pricey":
        assert driver.drafts == 0
    else:
        assert driver.drafts > 0


def test_a_shared_pass_holds_no_more_ids_than_give_each_row_its_bits(kinds, monkeypatch):
    """A backend whose rows are computed alike only in passes of up to 16 ids (hooks.alike_rows):
    four rows of 5 ids run as passes of at most 16 ids, and each answer is what it gets alone,
    greedy and by seed. (macspec's CPU kernels promise any width: tests/core/test_row_bits.py.)"""
    from dataclasses import replace

    from macspec.core import batch_rounds, hooks

    widths = []
    real = batch_rounds.shared_pass

    def recorded(model, vocab, rows, hidden=False):
        widths.append(len(rows) * max(t.size for _, t in rows))
        return real(model, vocab, rows, hidden)

    monkeypatch.setattr(batch_rounds, "shared_pass", recorded)
    old = hooks.install(replace(hooks.installed(), alike_rows=lambda model: 16))
    try:
        for options in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}):
            opts = {"max_tokens": 16, "adaptive": False, "num_draft": 4, **options}
            requests = [(kinds["ngram"], PROMPTS[1], opts)] * 2 + [
                (kinds["model"], p, opts) for p in PROMPTS[:2]
            ]
            driver = BatchDriver(kinds["model"].target, kinds["model"].vocab_size)
            assert driver.max_ids == 16
            got, _ = run_batch(driver, requests)
            assert got == [alone(p, prompt, **o) for p, prompt, o in requests]
    finally:
        hooks.install(old)
    assert max(widths) <= 16 and driver.shared_rows > driver.passes


def test_pass_groups_keep_each_pass_within_its_ids():
    from macspec.core.batch_rounds import pass_groups

    class F:
        def __init__(self, n):
            self.tokens = mx.zeros((n,))

    feeds = [(i, F(n)) for i, n in enumerate([5, 1, 5, 3, 20, 5])]
    assert pass_groups(feeds, None) == [feeds]
    groups = pass_groups(feeds, 16)
    assert sorted(i for g in groups for i, _ in g) == list(range(6))
    for g in groups:
        assert len(g) == 1 or len(g) * max(f.tokens.size for _, f in g) <= 16
    assert [[i for i, _ in g] for g in groups] == [[1, 3, 0], [2, 5], [4]]


def test_the_model_stays_wired_once_while_rows_run(kinds, monkeypatch):
    """Metal hygiene as generate_rounds has it: mlx-lm's wired_limit entered once for the whole
    batch when its first round runs, left when its last row ends, entered again for the next."""
    from macspec.core import memory

    held = []

    @contextmanager
    def wired(model):
        held.append("in")
        yield
        held.append("out")

    monkeypatch.setattr(memory, "wired_limit", wired)
    opts = {"max_tokens": 6, "temperature": 0.0, "adaptive": False}
    driver = BatchDriver(kinds["model"].target, kinds["model"].vocab_size)
    for n in (2, 1):
        rows = [open_row(kinds["model"], PROMPTS[i], **opts)[1] for i in range(n)]
        rounds = 0
        while rows:
            results = driver.round(rows)
            rows = [row for row, got in results if not isinstance(got, Exception)]
            rounds += 1
            assert held[-1] == ("out" if not rows else "in")
        assert rounds > 2 and held == ["in", "out"] * (3 - n)
    rows = [open_row(kinds["model"], PROMPTS[0], **opts)[1]]
    driver.round(rows)
    driver.release()  # the server's, when its last row was dropped
    assert held[-2:] == ["in", "out"]


@pytest.mark.parametrize("accelerated", [True, False])
def test_a_qwen2_model_whose_layers_are_a_slice_shares_passes(accelerated):
    """qwen2's forward pass reads `pipeline_layers`, a new slice of its trunk's list at each
    call: the shared pass must reach the layers there (it raised on the 1.5B real pair), with
    the CPU's layer and with the core's own (the accelerator's off)."""
    from mlx_lm.models import qwen2
    from support.tinymodels import llama_like

    from macspec.core.batch import _check
    from macspec.cpu import kernels
    from macspec.cpu import rows as cpu_rows

    model = llama_like(qwen2, model_type="qwen2")
    assert model.layers is not model.model.layers  # a copy: replacing its items reaches nothing
    kernels.accelerate(model)
    taken = []

    def counted(*args):
        out = cpu_rows.rows_layer(*args)
        taken.append(out is not None)
        return out

    with rows_layer(counted if accelerated else BY_MODULE):
        assert _check(model, 64) == 0.0
        assert shared_reason(model, 64, {"attention": 2}, False) == ""
    native = kernels.native_layers() is not None and hooks.installed().name == "cpu"
    assert taken == ([True] * 4 if accelerated and native else [])
