"""The fused decoder layer (blocks.py, csrc/cpu_block.cpp and cpu_attn_mlp.cpp): the same numbers
as the layer run one native op at a time, bit for bit, and mlx-lm's to float rounding; the plain
case only."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama, qwen2
from support.tinymodels import chunk_logits, llama_like

from macspec.core import caches, tree
from macspec.cpu import blocks, kernels, native
from macspec.cpu.state import STATE

ext = native.load()
pytestmark = [
    pytest.mark.skipif(ext is None, reason=f"native kernels unavailable: {STATE.ext_reason}"),
    pytest.mark.usefixtures("float32_kv"),  # held to mlx-lm's float32 caches
]

CHUNKS = [[3, 9, 27, 17], [5], [40, 2, 33], [60, 1] * 12, [7], [8, 9]]  # [60, 1] * 12: 24 rows


@pytest.fixture
def spy(native_calls):
    return native_calls


def _one_op_at_a_time(model, chunks):
    blocks.set_enabled(False)
    try:
        return chunk_logits(model, chunks)
    finally:
        blocks.set_enabled(True)


@pytest.mark.parametrize("module", [llama, qwen2])  # qwen2: biased q/k/v products
def test_fused_layers_equal_the_ops_bit_for_bit(module, spy):
    model = llama_like(module, model_type=module.__name__.rsplit(".", 1)[-1])
    stock = chunk_logits(model, CHUNKS)
    kernels.accelerate(model)
    ops = _one_op_at_a_time(model, CHUNKS)
    spy.clear()
    fused = chunk_logits(model, CHUNKS)
    # two primitives a layer for every pass, the 24-row chunk too
    assert spy["qkv_rope"] == spy["attn_mlp"] == len(CHUNKS) * 2
    assert spy["rope_heads"] == spy["attend"] == 0
    for a, b, c in zip(stock, ops, fused, strict=True):
        np.testing.assert_array_equal(c, b)
        np.testing.assert_allclose(c, a, rtol=0, atol=2e-5)


def test_fused_layers_over_a_long_context(spy):
    model = llama_like(llama, max_position_embeddings=2048)
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, 64, 700)]
    chunks = [prompt, [5], [40, 2, 33, 7, 9], [11]]
    stock = chunk_logits(model, chunks)
    kernels.accelerate(model)
    ops = _one_op_at_a_time(model, chunks)
    fused = chunk_logits(model, chunks)
    assert spy["attn_mlp"] == 4 * 2  # the 700-id prompt too
    for a, b, c in zip(stock, ops, fused, strict=True):
        np.testing.assert_array_equal(c, b)
        np.testing.assert_allclose(c, a, rtol=0, atol=2e-5)


def _tree_logits(model, fused, spy):
    shape = tree.Tree(tokens=[20, 21, 22, 23], parents=[-1, -1, 0, 1])
    prompt = [5, 17, 30, 8]
    cache = caches.make_cache(model, 8)
    with caches.forward(cache, 3):
        model(mx.array([prompt[:-1]]), cache=cache)
    rows = [-1, *range(len(shape))]
    mask = tree.attend(shape, 3, rows, rows)
    blocks.set_enabled(fused)
    spy.clear()
    try:
        with tree.tree_pass(model, cache, mask, [0, *shape.depths], 3):
            with caches.forward(cache, len(rows), rewindable=True):
                return np.array(model(mx.array([[prompt[-1], *shape.tokens]]), cache=cache)[0])
    finally:
        blocks.set_enabled(True)


def test_a_fused_tree_pass_reads_positions_and_mask(spy):
    model = llama_like(llama)
    kernels.accelerate(model)
    ops = _tree_logits(model, False, spy)
    assert spy["qkv_rope"] == 0 and spy["rope_heads"] == spy["attend"] == 2
    fused = _tree_logits(model, True, spy)
    assert spy["qkv_rope"] == spy["attn_mlp"] == 2
    np.testing.assert_array_equal(fused, ops)


def test_replaced_weights_are_read_again(spy):
    model = llama_like(llama)
    kernels.accelerate(model)
    chunk_logits(model, [[1, 2], [3]])  # the layers' weights are checked and kept
    fresh = llama_like(llama, seed=11)
    model.update(fresh.parameters())
    want = chunk_logits(fresh, [[1, 2], [3]])
    spy.clear()
    got = chunk_logits(model, [[1, 2], [3]])
    assert spy["attn_mlp"] == 2 * 2
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    "case",
    ["mlp bias", "partly quantized", "switched off"],
)
def test_other_layers_run_op_by_op_with_mlx_lm_logits(case, spy, monkeypatch):
    # float activations in quantized products: mlx-lm's logits up to the summation order
    monkeypatch.setattr(STATE, "int8_activations", False)
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    shape = shape if case == "partly quantized" else {}
    model = llama_like(llama, mlp_bias=case == "mlp bias", **shape)
    if case == "partly quantized":  # the MLP alone: a layer's products must be alike to fuse
        nn.quantize(model, group_size=32, bits=8, class_predicate=lambda p, m: ".mlp." in p)
        mx.eval(model.parameters())
    stock = chunk_logits(model, CHUNKS[:3])
    kernels.accelerate(model)
    fused = _one_op_at_a_time(model, CHUNKS[:3]) if case == "switched off" else None
    got = fused if fused is not None else chunk_logits(model, CHUNKS[:3])
    assert spy["qkv_rope"] == spy["attn_mlp"] == 0
    for a, b in zip(stock, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-4 if case == "partly quantized" else 2e-5)


def test_bad_shapes_are_refused_with_a_message():
    h, w = mx.ones((1, 2, 8)), mx.ones((8,))
    table = kernels.TableRoPE(nn.RoPE(4), size=8)
    with pytest.raises(ValueError, match="Wk of the wrong shape"):
        ext.qkv_rope(
            h,
            w,
            1e-5,
            [mx.ones((8, 8))],
            [mx.ones((3, 8))],
            [mx.ones((4, 8))],
            table.cos,
            table.sin,
            2,
            1,
            0,
            False,
        )
    q, kv = mx.ones((1, 2, 2, 4)), mx.ones((1, 1, 5, 4))

    def attn_mlp(wd, causal, *mask):
        ones = [mx.ones((16, 8))]
        return ext.attn_mlp(
            h, q, kv, kv, [mx.ones((8, 8))], w, 1e-5, ones, ones, [wd], 0.5, causal, *mask
        )

    with pytest.raises(ValueError, match="Wd of the wrong shape"):
        attn_mlp(mx.ones((8, 15)), True)
    with pytest.raises(ValueError, match="boolean mask"):
        attn_mlp(mx.ones((8, 16)), False, mx.ones((2, 5)))
