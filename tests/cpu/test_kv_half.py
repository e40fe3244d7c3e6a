"""KV caches kept in float16 (switches.KV_CACHE, the default): the attention primitive widens
each piece of keys and values to float32 exactly, so it computes what it computes over the
float32 values of those halves, every row as it would alone; the accelerated layers store every
pass's keys and values that way, plain or verifying."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import make_prompt_cache
from support.tinymodels import chunk_logits, llama_like

from macspec.cpu import kernels, native
from macspec.cpu.state import STATE

ext = native.load()
pytestmark = pytest.mark.skipif(
    ext is None, reason=f"native kernels unavailable: {STATE.ext_reason}"
)


def _case(rows, context, heads=6, kv_heads=2, d=16, seed=0):
    """Queries, and half keys and values as a cache's view of its buffer (capacity beyond)."""
    key = iter(mx.random.split(mx.random.key(seed), 3))
    total = context + rows
    q = mx.random.normal((1, heads, rows, d), key=next(key))
    k = mx.random.normal((1, kv_heads, total + 9, d), key=next(key)).astype(mx.float16)
    v = mx.random.normal((1, kv_heads, total + 9, d), key=next(key)).astype(mx.float16)
    return q, k[:, :, :total], v[:, :, :total]


def _wide(x):
    return x.astype(mx.float32)


@pytest.mark.parametrize(
    "rows,context,heads,kv_heads,d",
    # one piece, pieces on threads, heads of 128 weighed in registers, lanes left over (d=20)
    [(1, 40, 6, 2, 16), (1, 3000, 12, 2, 128), (5, 700, 14, 2, 64), (7, 300, 5, 1, 20)],
)
def test_half_keys_and_values_give_the_bits_of_their_float32_values(
    rows, context, heads, kv_heads, d
):
    q, k, v = _case(rows, context, heads, kv_heads, d)
    scale = d**-0.5
    half = np.array(ext.attend(q, k, v, scale, True))
    assert np.array_equal(half, np.array(ext.attend(q, _wide(k), _wide(v), scale, True)))
    # and every row as it is alone: a verification row and its plain step agree bit for bit
    for i in range(rows):
        seen = context + i + 1
        alone = ext.attend(q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], scale, True)
        assert np.array_equal(np.array(alone)[0, 0], half[0, i])


def test_half_keys_with_a_tree_mask_and_a_copied_layout():
    q, k, v = _case(3, 700)
    mask = np.tril(np.ones((3, 703), dtype=bool), k=700)
    mask[1, 256:512] = False
    mask = mx.array(mask)
    want = np.array(ext.attend(q, _wide(k), _wide(v), 0.25, False, mask))
    assert np.array_equal(np.array(ext.attend(q, k, v, 0.25, False, mask)), want)
    # rows of D not contiguous (a transposed buffer): copied first, the same values
    kt = mx.contiguous(k.swapaxes(2, 3)).swapaxes(2, 3)
    assert kt.dtype == mx.float16
    assert np.array_equal(np.array(ext.attend(q, kt, v, 0.25, False, mask)), want)


def _bits(x):
    return np.array(x.view(mx.uint16)) if x.dtype == mx.float16 else np.array(x)


@pytest.mark.parametrize("rows", [1, 5, 3])  # 3 rows x 2 heads x 12: halves left past 8 lanes
def test_rope_heads_give_halves_rounded_as_astype_rounds(rows):
    heads, kv_heads, d = 6, 2, 12 if rows == 3 else 16
    table = kernels.TableRoPE(nn.RoPE(d, base=10000.0), size=32)
    key = iter(mx.random.split(mx.random.key(rows), 3))
    q, k, v = (mx.random.normal((1, rows, n * d), key=next(key)) for n in (heads, kv_heads, 2))
    full = ext.rope_heads(q, k, v, table.cos, table.sin, heads, kv_heads, 4, False)
    half = ext.rope_heads(q, k, v, table.cos, table.sin, heads, kv_heads, 4, False, None, True)
    assert [a.dtype for a in half] == [mx.float32, mx.float16, mx.float16]
    assert np.array_equal(np.array(half[0]), np.array(full[0]))
    for a, b in zip(half[1:], full[1:], strict=True):
        assert np.array_equal(_bits(a), _bits(b.astype(mx.float16)))


def test_other_key_types_are_refused_with_a_message():
    q, k, v = _case(2, 3)
    with pytest.raises(ValueError, match="float32 or float16 k"):
        ext.attend(q, k.astype(mx.bfloat16), v, 0.25, True)
    with pytest.raises(ValueError, match="float32 q"):
        ext.attend(q.astype(mx.float16), k, v, 0.25, True)


@pytest.mark.parametrize("module", [llama, qwen2])
@pytest.mark.parametrize("blocks", [False, True])
def test_switched_layers_keep_half_caches_and_stay_near_float32(module, blocks, monkeypatch):
    # Through the one-op-at-a-time layers and the fused blocks, a prompt chunk and steps past
    # 256 cached keys: the cache holds halves, and the logits are those of float32 caches up to
    # the halves' rounding.
    monkeypatch.setattr(STATE, "native_blocks", blocks)
    model = llama_like(module, model_type=module.__name__.rsplit(".", 1)[-1])
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, 64, 300)]
    chunks = [prompt, [5], [40, 2, 33], [11]]
    kernels.accelerate(model)
    monkeypatch.setattr(STATE, "kv_dtype", mx.float32)
    full = chunk_logits(model, chunks)
    monkeypatch.setattr(STATE, "kv_dtype", mx.float16)
    cache = make_prompt_cache(model)
    half = [np.array(model(mx.array([c]), cache=cache)[0]) for c in chunks]
    assert {c.keys.dtype for c in cache} == {c.values.dtype for c in cache} == {mx.float16}
    for a, b in zip(full, half, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-2)
        assert not np.array_equal(a, b)  # the halves are what was read


def test_a_verification_pass_over_half_caches_gives_each_plain_steps_logits():
    # The cache as plain decoding fills it, step by step, and as one pass over the same ids
    # fills it: the same halves, the same logits bit for bit.
    model = llama_like(llama)
    kernels.accelerate(model)
    prompt, ids = [3, 9, 27, 17, 8] * 60, [40, 2, 33, 7]
    steps = chunk_logits(model, [prompt, *([i] for i in ids)])
    together = chunk_logits(model, [prompt, ids])
    for i in range(len(ids)):
        assert np.array_equal(together[1][i], steps[i + 1][0])


@pytest.mark.parametrize("module", [llama, qwen2])
def test_fused_layers_equal_the_ops_bit_for_bit_over_half_caches(module, monkeypatch, native_calls):
    model = llama_like(module, model_type=module.__name__.rsplit(".", 1)[-1])
    kernels.accelerate(model)
    chunks = [[3, 9, 27, 17] * 70, [5], [40, 2, 33], [11]]
    monkeypatch.setattr(STATE, "native_blocks", False)
    ops = chunk_logits(model, chunks)
    monkeypatch.setattr(STATE, "native_blocks", True)
    native_calls.clear()
    fused = chunk_logits(model, chunks)
    assert native_calls["qkv_rope"] == native_calls["attn_mlp"] == len(chunks) * 2
    for a, b in zip(ops, fused, strict=True):
        assert np.array_equal(a, b)
