"""CPU kernels (macspec/kernels.py): same numbers as mlx-lm's layers, same weights and files."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import make_prompt_cache
from support.tinymodels import chunk_logits, llama_like

from macspec.cpu import kernels
from macspec.cpu.state import STATE

pytestmark = pytest.mark.usefixtures("float32_kv")  # held to mlx-lm's float32 caches

CHUNKS = [[3, 9, 27, 17, 51, 25, 11], [5], [40, 2, 33, 8], [13], [60, 1]]


@pytest.mark.parametrize(
    "module,over",
    [
        (llama, {}),
        (llama, {"rope_traditional": True}),
        (llama, {"num_key_value_heads": 6}),
        (llama, {"rope_scaling": {"type": "linear", "factor": 2.0}}),
        (qwen2, {"model_type": "qwen2"}),
    ],
)
@pytest.mark.parametrize("native", [True, False])  # the native primitives where built, or mlx ops
def test_accelerated_layers_give_mlx_lm_logits(module, over, native, monkeypatch):
    monkeypatch.setattr(STATE, "native_layers", native)
    model = llama_like(module, **over)
    stock = chunk_logits(model, CHUNKS)
    assert kernels.accelerate(model) == 2
    fast = chunk_logits(model, CHUNKS)
    for a, b in zip(stock, fast, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-5)
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_same_weights_same_names_and_stock_restores():
    model = llama_like(llama)
    before = {k: v for k, v in tree_flatten(model.parameters())}
    kernels.accelerate(model)
    after = dict(tree_flatten(model.parameters()))
    assert list(before) == list(after)
    assert all(before[k] is after[k] for k in before)
    attn = model.model.layers[0].self_attn
    assert type(attn) is not llama.Attention and isinstance(attn, llama.Attention)
    with kernels.stock(model):
        assert type(attn) is llama.Attention and type(model.model.layers[1].mlp) is llama.MLP
    assert type(attn) is not llama.Attention
    # One RoPE table serves every layer.
    assert isinstance(STATE.rope(attn), kernels.TableRoPE)
    assert STATE.rope(attn) is STATE.rope(model.model.layers[1].self_attn)


def test_nothing_is_marked_on_mlx_lms_modules_and_what_is_kept_goes_with_them():
    # What the accelerator keeps of a module (cpu/state.py) is its own, not attributes on the
    # module, and it is dropped when the module is collected.
    import gc
    import weakref

    model = llama_like(llama)
    kernels.accelerate(model)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
    marks = [k for _, m in model.named_modules() for k in vars(m) if k.startswith("_macspec")]
    assert marks == []
    attn = model.model.layers[0].self_attn
    assert STATE.kept(attn) is not None
    key, ref = id(attn), weakref.ref(attn)
    del attn, model, cache
    gc.collect()
    assert ref() is None and key not in STATE._kept


def test_a_mask_array_takes_mlx_lms_path():
    model = llama_like(llama)
    attn = model.model.layers[0].self_attn
    x = mx.random.normal((1, 5, 48), key=mx.random.key(1))
    mask = mx.array(np.tril(np.ones((5, 5), dtype=bool)) & ~np.eye(5, k=-3, dtype=bool))
    want = np.array(attn(x, mask=mask))
    kernels.accelerate(model)
    np.testing.assert_allclose(np.array(attn(x, mask=mask)), want, atol=1e-6)


def test_float16_layers_stay_float16():
    model = llama_like(llama)
    model.set_dtype(mx.float16)
    kernels.accelerate(model)
    cache = make_prompt_cache(model)
    out = model(mx.array([[1, 2, 3]]), cache=cache)
    assert out.dtype == mx.float16
    assert cache[0].keys.dtype == mx.float16


def test_the_rope_table_grows_past_its_first_size():
    rope = nn.RoPE(8, base=10000.0)
    table = kernels.TableRoPE(rope, size=4)
    x = mx.random.normal((1, 2, 3, 8), key=mx.random.key(2))
    q, k = table.pair(x, x * 2, offset=6)
    assert table.size >= 9
    np.testing.assert_allclose(np.array(q), np.array(rope(x, offset=6)), atol=1e-5)
    np.testing.assert_allclose(np.array(k), np.array(rope(x * 2, offset=6)), atol=1e-5)


def test_softmax_matches_float64():
    x = mx.concatenate(
        [mx.random.normal((3, 4000), key=mx.random.key(0)) * 20, mx.full((3, 1), -mx.inf)], axis=1
    )
    got = np.array(kernels.softmax(x))
    xs = np.array(x).astype(np.float64)
    want = np.exp(xs - xs.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    big = want > 1e-30
    assert np.max(np.abs(got[big] - want[big]) / want[big]) < 1e-5
    assert (got[:, -1] == 0).all() and np.allclose(got.sum(-1), 1, atol=1e-6)


def test_softmax_compiles_a_bounded_number_of_shapes(monkeypatch):
    # Attention's scores grow by one key a token: one traced graph per length would grow the
    # process through a long generation, so the compiled exp is rebuilt after `limit` shapes.
    monkeypatch.setattr(STATE, "native_layers", False)  # the mlx-op path's compiled exp
    builds = []
    real = kernels._compiled
    monkeypatch.setattr(kernels, "_compiled", lambda fn: builds.append(fn) or real(fn))
    bounded = kernels._BoundedCompile(kernels._shifted_exp, limit=4)
    monkeypatch.setattr(kernels, "_softmax_exp", bounded)
    x = mx.random.normal((2, 12), key=mx.random.key(1))
    counts = []
    for length in (5, 6, 7, 8, 5, 9, 10):
        got = np.array(kernels.softmax(x[:, :length]))
        np.testing.assert_allclose(got, np.array(mx.softmax(x[:, :length], axis=-1)), rtol=1e-5)
        counts.append(len(builds))
        assert len(bounded.shapes) <= 4
    # Compiled on first use; four shapes and a repeat share it; the fifth shape starts afresh.
    assert counts == [1, 1, 1, 1, 1, 2, 2]
    assert bounded.shapes == {((2, 9), (2, 1)), ((2, 10), (2, 1))}


def test_every_compiled_kernel_is_bounded(monkeypatch):
    # Prefill lengths differ per prompt, so RoPE and SwiGLU see new shapes too: a chat of many
    # turns must not keep one traced graph per prompt length in any of them (the mlx-op path,
    # which runs where the native primitives are not built).
    monkeypatch.setattr(STATE, "native_layers", False)
    model = llama_like(llama)
    kernels.accelerate(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = mx.random.normal((1, 7, 48), key=mx.random.key(4))
    for length in (3, 5, 7):
        mlp(x[:, :length])
        attn(x[:, :length], mask="causal")
    for bounded in (kernels._softmax_exp, kernels._swiglu_fast, STATE.rope(attn)._pair):
        assert isinstance(bounded, kernels._BoundedCompile)
        assert bounded.limit == 128 and len(bounded.shapes) >= 3


def test_swiglu_and_exp_limits():
    g = mx.array([-200.0, -30.0, -1.0, 0.0, 1.0, 30.0, 200.0])
    u = mx.ones_like(g)
    got = np.array(kernels._swiglu(g, u))
    want = [x / (1 + math.exp(-x)) if x > -100 else 0.0 for x in np.array(g).tolist()]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30)
    assert np.array(kernels._exp(mx.array([-mx.inf, -1000.0, 0.0]))).tolist() == [0.0, 0.0, 1.0]


def test_load_accelerates_the_target(pair):
    layer = pair.target.model.layers[0]
    assert STATE.is_switched(layer.self_attn)
    assert STATE.is_switched(layer.mlp)


def test_nothing_changes_off_the_cpu_backend(monkeypatch):
    """Metal and CUDA keep mlx's own mx.fast kernels: no layer is switched there."""
    monkeypatch.setattr(kernels, "on_cpu", lambda: False)
    model = llama_like(llama)
    assert kernels.accelerate(model) == 0
    assert type(model.model.layers[0].self_attn) is llama.Attention
    x = mx.array([[1.0, 2.0, -mx.inf]])
    assert np.array_equal(np.array(kernels.softmax(x)), np.array(mx.softmax(x, axis=-1)))


def test_every_third_layer_starts_evaluating_the_pass(monkeypatch):
    # The stream computes the first layers while Python builds the rest of the graph.
    model = llama_like(llama, num_hidden_layers=7)
    stock = chunk_logits(model, CHUNKS)
    kernels.accelerate(model)
    started = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: started.append(a) or real(*a))
    fast = chunk_logits(model, CHUNKS)
    assert len(started) == 2 * len(CHUNKS)  # after layers 3 and 6 of every pass
    for a, b in zip(stock, fast, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-5)
    with kernels.stock(model):
        assert type(model.model.layers[2]) is llama.TransformerBlock


def test_loading_installs_the_cpu_hooks_only_over_the_plain_defaults():
    from dataclasses import replace

    from macspec import cpu
    from macspec.core import hooks

    old = hooks.install(hooks.Hooks())
    try:
        cpu.install_default()  # what api/loading.py does at each load
        assert cpu.installed()
        mine = replace(hooks.installed(), name="mine")
        hooks.install(mine)
        cpu.install_default()
        assert hooks.installed() is mine
    finally:
        hooks.install(old)
