"""Native few-row products (cpu/products.py, cpu/native.py): mlx's numbers, same weights."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support.tinymodels import chunk_logits, llama_like

from macspec.api.mlx_thread import MlxThread
from macspec.cpu import kernels, native, products
from macspec.cpu.state import STATE

ext = native.load()
pytestmark = [
    pytest.mark.skipif(ext is None, reason=f"native products unavailable: {STATE.ext_reason}"),
    pytest.mark.usefixtures("float32_kv"),  # held to mlx-lm's float32 caches
]


def _normal(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


@pytest.fixture
def threads():
    """Set the pool's thread count for one test; restored afterwards."""
    before = ext.threads()
    yield ext.set_threads
    ext.set_threads(before)


@pytest.mark.parametrize("n,k", [(1536, 576), (577, 1536), (40, 100), (3, 16), (17, 33)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16])
def test_linear_agrees_with_mlx(n, k, rows):
    x, w = _normal((1, rows, k), 0), _normal((n, k), 1)
    got, want = np.array(ext.linear(x, w)), np.array(x @ w.T)
    assert got.shape == (1, rows, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * k)


@pytest.mark.parametrize("count", [1, 2])
def test_every_row_is_the_same_whatever_the_rows_and_threads(threads, count):
    # A plain step and a verification pass then agree bit for bit on their products.
    threads(count)
    x, w = _normal((9, 200), 2), _normal((300, 200), 3)
    alone = [np.array(ext.linear(x[i : i + 1], w)) for i in range(9)]
    for rows in (2, 5, 9):
        together = np.array(ext.linear(x[:rows], w))
        for i in range(rows):
            assert np.array_equal(together[i], alone[i][0])
    wq, s, b = mx.quantize(w[:, :192], group_size=64, bits=4)
    q_alone = np.array(ext.qlinear(x[:1, :192], wq, s, b, 64, 4))
    assert np.array_equal(np.array(ext.qlinear(x[:6, :192], wq, s, b, 64, 4))[0], q_alone[0])


def test_compiled_functions_trace_the_native_product():
    # mx.compile records the primitive and replays it with new inputs (README: why the pass
    # itself is not compiled is the caches, not the primitives).
    w = _normal((300, 200), 4)
    f = mx.compile(lambda x: ext.linear(x, w) * 2)
    for seed in (5, 6):  # the second call replays the traced graph on other values
        x = _normal((1, 3, 200), seed)
        assert np.array_equal(np.array(f(x)), np.array(ext.linear(x, w) * 2))


def test_strided_input_is_read_as_its_values():
    x = _normal((64, 5), 4).T  # a transposed view: not row-contiguous
    w = _normal((30, 64), 5)
    np.testing.assert_allclose(np.array(ext.linear(x, w)), np.array(x @ w.T), atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_quantized_agrees_with_mlx(bits, group, dtype):
    w = _normal((200, 384), 6)
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    s, b = s.astype(dtype), b.astype(dtype)
    x = _normal((1, 5, 384), 7)
    got = np.array(ext.qlinear(x, wq, s, b, group, bits))
    # the same dequantized weights in float32 products: only the summation order differs
    dense = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group, bits)
    want = np.array(x @ dense.T)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_unsupported_layouts_are_refused():
    w = _normal((16, 96), 8)
    with pytest.raises(ValueError):
        ext.linear(_normal((2, 95), 9), w)
    with pytest.raises(ValueError):
        ext.linear(_normal((2, 96), 9).astype(mx.float16), w)
    wq, s, b = mx.quantize(w, group_size=32, bits=2)
    with pytest.raises(ValueError):
        ext.qlinear(_normal((2, 96), 9), wq, s, b, 32, 2)


def _model(**over):
    return llama_like(
        seed=5, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=96, **over
    )


CHUNKS = [[3, 9, 27, 17, 51, 25, 11] * 3, [5], [40, 2, 33, 8], [13]]


def test_switched_model_uses_native_products_and_gives_mlx_logits(monkeypatch):
    monkeypatch.setattr(STATE, "native_blocks", False)  # the layers op by op: each product a call
    model = _model()
    stock = chunk_logits(model, CHUNKS)
    kernels.accelerate(model)
    assert STATE.is_switched(model.model.layers[0].self_attn.q_proj)
    assert STATE.is_switched(model.model.embed_tokens)
    calls = []
    real = ext.linear
    monkeypatch.setattr(ext, "linear", lambda x, w: calls.append(x.shape) or real(x, w))
    fast = chunk_logits(model, CHUNKS)
    # the 21-token prompt and the 1- and 4-token steps all go to the extension (no BLAS: a row
    # gets the same bits in any pass): 7 products a layer and the head
    assert sorted({shape[1] for shape in calls}) == [1, 4, 21]
    assert len(calls) == 4 * (2 * 7 + 1)
    for a, b in zip(stock, fast, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=3e-5)
    with kernels.stock(model):
        assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
        assert type(model.model.embed_tokens) is nn.Embedding
    products.set_enabled(False)
    try:
        calls.clear()
        off = chunk_logits(model, CHUNKS)
        assert not calls
    finally:
        products.set_enabled(True)
    for a, b in zip(stock, off, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=3e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("int8", [False, True])
def test_quantized_model_gives_mlx_logits(monkeypatch, bits, int8):
    monkeypatch.setattr(STATE, "int8_activations", int8)
    model = _model()
    nn.quantize(model, group_size=32, bits=bits)
    stock = chunk_logits(model, CHUNKS)
    kernels.accelerate(model)
    assert STATE.is_switched(model.model.layers[1].mlp.down_proj)
    fast = chunk_logits(model, CHUNKS)
    for a, b in zip(stock, fast, strict=True):
        # float activations: the summation order alone; int8 ones: x rounded as well
        # (test_products_int8.py pins down how)
        atol = 0.02 * np.abs(a).max() if int8 and ext.int8_isa() else 1e-4
        np.testing.assert_allclose(b, a, rtol=0, atol=atol)


def test_half_quantized_model_computes_in_float32(monkeypatch):
    # float activations: the test is about the half types; int8 ones can flip this random
    # model's near ties (test_products_int8.py covers them)
    monkeypatch.setattr(STATE, "int8_activations", False)
    model = _model()
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=32, bits=8)
    stock = chunk_logits(model, CHUNKS)
    kernels.accelerate(model)
    layer = model.model.layers[0]
    assert layer.input_layernorm.weight.dtype == mx.float32
    assert model.model.embed_tokens.scales.dtype == mx.float32  # lookups give float32
    assert layer.mlp.up_proj.scales.dtype == mx.float16  # read as they are by the extension
    cache = make_prompt_cache(model)
    assert model(mx.array([[1, 2]]), cache=cache).dtype == mx.float32
    assert cache[0].keys.dtype == mx.float32
    fast = chunk_logits(model, CHUNKS)
    for a, b in zip(stock, fast, strict=True):  # float16's rounding, and the same choices
        np.testing.assert_allclose(b, a, rtol=0, atol=0.05 * np.abs(a).max())
        assert (a.argmax(-1) == b.argmax(-1)).all()


def _on_another_thread(fn):
    """fn() run as `macspec serve` and the chat run their MLX work: on a thread of its own,
    with its own stream (MLX streams are per thread)."""
    worker = MlxThread()

    async def run():
        return await worker.run(fn)

    try:
        return asyncio.run(run())
    finally:
        worker.close()


@pytest.mark.parametrize("int8", [False, True])
def test_quantized_products_run_on_another_thread(int8):
    x, w = _normal((5, 256), 7), _normal((96, 256), 8)
    wq, s, b = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
    mx.eval(x, wq, s, b)
    here = np.array(ext.qlinear(x, wq, s, b, 64, 4, int8=int8))
    there = _on_another_thread(lambda: np.array(ext.qlinear(x, wq, s, b, 64, 4, int8=int8)))
    assert np.array_equal(there, here)


def test_half_quantized_model_accelerated_here_runs_on_another_thread():
    # Its float32 conversions are made on this thread: lazy, they would run on this thread's
    # stream, which the other thread has not ("There is no Stream(cpu, 0) in current thread").
    model = _model()
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())  # as mlx-lm's load leaves it
    kernels.accelerate(model)
    ids = mx.array([CHUNKS[0]])
    there = _on_another_thread(lambda: np.array(model(ids)))
    assert np.array_equal(there, np.array(model(ids)))


def test_unquantized_half_model_is_left_alone():
    model = _model()
    model.set_dtype(mx.bfloat16)
    assert not products.float32_activations(model)
    assert model.model.layers[0].input_layernorm.weight.dtype == mx.bfloat16


def test_off_switch(monkeypatch, tmp_path):
    monkeypatch.setattr(STATE, "ext_tried", False)
    monkeypatch.setattr(STATE, "ext", None)
    monkeypatch.setattr(STATE, "ext_reason", None)
    monkeypatch.setenv("MACSPEC_NATIVE", "0")
    assert native.load() is None
    assert STATE.ext_reason == "switched off (MACSPEC_NATIVE is off)"


@pytest.mark.subprocess
def test_thread_pool_restarts_and_runs_without_hanging():
    # Workers started and stopped in quick succession, between products (a stop that came
    # before a new worker first ran once left it asleep forever), and thousands of products
    # back to back on more threads than cores (a worker late from one product once took a
    # chunk of the next without running it).
    code = (
        "import macspec, mlx.core as mx\n"
        "from macspec.cpu import native\n"
        "ext = native.load()\n"
        "x, w = mx.ones((3, 64)), mx.ones((256, 64))\n"
        "for i in range(300):\n"
        "    ext.set_threads(1 + i % 3)\n"
        "    assert ext.linear(x, w)[2, 255].item() == 64.0\n"
        "    ext.set_threads(1 + i % 2)\n"
        "xs = [x * j for j in range(500)]\n"
        "for i in range(40):\n"
        "    ext.set_threads(2 + i % 2)\n"
        "    outs = [ext.linear(xj, w[: 32 + 16 * (i % 3)]) for xj in xs]\n"
        "    mx.eval(outs)\n"
        "    assert outs[499][0, 0].item() == 499 * 64.0\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-800:]


def test_eagle_head_rows_use_native_products_only_with_the_kernels(monkeypatch):
    """The EAGLE draft's head (the target's rows for its vocabulary) goes through the extension
    when the pair runs the CPU kernels, through mlx's product otherwise, with the same logits."""
    from macspec.core.drafters.eagle import TargetParts

    model = _model()
    ids = mx.array([3, 7, 9, 40, 2], dtype=mx.int32)
    x = mx.random.normal((3, model.args.hidden_size), key=mx.random.key(2))
    calls = []
    real = ext.linear
    monkeypatch.setattr(ext, "linear", lambda x, w: calls.append(x.shape) or real(x, w))
    want = mx.take(x @ model.model.embed_tokens.weight.T, ids, axis=1)
    for on in (True, False):
        calls.clear()
        got = TargetParts(model, ids, native=on).logits(x)
        assert calls == ([(3, model.args.hidden_size)] if on else [])
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=3e-5)
