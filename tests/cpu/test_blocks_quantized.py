"""The fused decoder layer on MLX's affine 4/8-bit weights (blocks.py, csrc/cpu_block.cpp): the
same logits as the layer run one native op at a time, bit for bit, for every row count, and a
plain step's logits equal to every verification row's; layers quantized unalike run op by op."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama, qwen2
from support.tinymodels import chunk_logits, llama_like
from test_blocks import _one_op_at_a_time
from test_products_int8 import q4_pair_in

import macspec
from macspec.cpu import kernels, native, products
from macspec.cpu.state import STATE

ext = native.load()
pytestmark = [
    pytest.mark.skipif(ext is None, reason=f"native kernels unavailable: {STATE.ext_reason}"),
    pytest.mark.usefixtures("float32_kv"),  # held to mlx-lm's float32 caches
]

SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4}
PROMPT = [3, 9, 27, 17, 5, 40, 2]
# passes of 1, 2, 5 and 16 rows after the prompt
CHUNKS = [PROMPT, [11], [40, 2], [7, 8, 9, 10, 12], [int(i) for i in range(20, 36)], [6]]


def _quantized(module, bits: int, group: int, half: bool, predicate=None):
    model = llama_like(module, model_type=module.__name__.rsplit(".", 1)[-1], **SHAPE)
    if half:  # scales and biases in float16, as converted models hold them
        model.set_dtype(mx.float16)
    nn.quantize(model, group_size=group, bits=bits, class_predicate=predicate)
    mx.eval(model.parameters())
    kernels.accelerate(model)
    return model


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize(("bits", "group", "half"), [(4, 64, True), (4, 32, False), (8, 128, True)])
@pytest.mark.parametrize("module", [llama, qwen2])  # qwen2: biased q/k/v products
def test_fused_quantized_layers_equal_the_ops_bit_for_bit(
    module, bits, group, half, int8, native_calls, monkeypatch
):
    monkeypatch.setattr(STATE, "int8_activations", int8)
    model = _quantized(module, bits, group, half)
    ops = _one_op_at_a_time(model, CHUNKS)
    assert native_calls["qkv_rope"] == 0
    fused = chunk_logits(model, CHUNKS)
    assert native_calls["qkv_rope"] == native_calls["attn_mlp"] == len(CHUNKS) * 2
    for a, b in zip(ops, fused, strict=True):
        np.testing.assert_array_equal(b, a)
    if not int8:  # float activations: mlx-lm's own quantized logits up to summation order
        with kernels.stock(model):
            stock = chunk_logits(model, CHUNKS)
        for a, b in zip(stock, fused, strict=True):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-3)


@pytest.mark.parametrize("module", [llama, qwen2])
def test_a_step_and_every_verification_row_agree_bit_for_bit(module, native_calls):
    model = _quantized(module, 4, 64, True)
    rows = list(range(20, 36))
    steps = chunk_logits(model, [PROMPT, *([r] for r in rows)])[1:]
    for n in (2, 5, 16):
        verified = chunk_logits(model, [PROMPT, rows[:n]])[1]
        for i in range(n):
            np.testing.assert_array_equal(verified[i], steps[i][0])
    assert native_calls["attn_mlp"] == (1 + 16 + 3 * 2) * 2


def test_layers_quantized_in_other_group_sizes_run_op_by_op_and_say_why_once(
    native_calls, caplog, monkeypatch
):
    monkeypatch.setattr(STATE, "told", set())

    def q_in_groups_of_32(path, m):
        if not hasattr(m, "to_quantized"):
            return False
        return {"group_size": 32, "bits": 4} if path.endswith("q_proj") else True

    model = _quantized(llama, 4, 64, False, q_in_groups_of_32)
    with caplog.at_level(logging.INFO, logger="macspec.cpu"):
        got = chunk_logits(model, CHUNKS[:3])
    assert native_calls["qkv_rope"] == native_calls["attn_mlp"] == 0
    said = [r.getMessage() for r in caplog.records if "op by op" in r.getMessage()]
    assert len(said) == 1 and "different group sizes" in said[0]  # two layers, three passes
    for a, b in zip(_one_op_at_a_time(model, CHUNKS[:3]), got, strict=True):
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("repack", [True, False])
@pytest.mark.parametrize("group", [32, 64])
def test_layers_mixing_4_and_8_bits_fuse_and_equal_the_ops_bit_for_bit(
    group, repack, native_calls, monkeypatch
):
    """As a GGUF's Q4_K_M: v and down products at 8 bits beside 4-bit ones, one group size
    (repacked where this build repacks each), the fused layers the ops' bits at every row count,
    and every verification row a plain step's."""
    monkeypatch.setattr(STATE, "repack_weights", repack)

    def v_and_down_at_8(path, m):
        if not hasattr(m, "to_quantized"):
            return False
        eight = path.endswith(("v_proj", "down_proj"))
        return {"group_size": group, "bits": 8 if eight else 4}

    model = _quantized(qwen2, 4, group, False, v_and_down_at_8)
    if repack:
        products.repack(model)
    layer = model.model.layers[0]
    assert (layer.mlp.down_proj.bits, layer.mlp.gate_proj.bits) == (8, 4)
    want_packed = repack and ext.q4_packs()
    assert products.repacked(layer.mlp.gate_proj) == want_packed
    assert products.repacked(layer.mlp.down_proj) == (want_packed and ext.q8_packs())
    ops = _one_op_at_a_time(model, CHUNKS)
    fused = chunk_logits(model, CHUNKS)
    assert native_calls["qkv_rope"] == native_calls["attn_mlp"] == len(CHUNKS) * 2
    for a, b in zip(ops, fused, strict=True):
        np.testing.assert_array_equal(b, a)
    rows = list(range(20, 36))
    steps = chunk_logits(model, [PROMPT, *([r] for r in rows)])[1:]
    verified = chunk_logits(model, [PROMPT, rows])[1]
    for i in range(len(rows)):
        np.testing.assert_array_equal(verified[i], steps[i][0])


@pytest.fixture(scope="module")
def q4_fused_pair(tmp_path_factory):
    """A 4-bit g64 target and a noisy 4-bit copy of it as the draft, layers wide enough to fuse."""
    return q4_pair_in(tmp_path_factory.mktemp("q4fused"), hidden=128, group=64)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_on_fused_4bit_layers_equals_plain_decoding(
    q4_fused_pair, native_calls, monkeypatch, k
):
    monkeypatch.setattr(STATE, "int8_activations", True)
    for prompt in ("Once", "The cat"):
        plain = macspec.generate(
            q4_fused_pair, prompt, max_tokens=30, temperature=0, speculative=False
        )
        spec = macspec.generate(
            q4_fused_pair, prompt, max_tokens=30, temperature=0, num_draft=k, adaptive=False
        )
        assert spec.tokens == plain.tokens
        assert spec.stats.drafted > 0
    assert native_calls["qkv_rope"] > 0 and native_calls["rope_heads"] == 0
