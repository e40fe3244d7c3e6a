"""Repacked weights whose float32 scales and biases factor exactly, 8 groups at a time, into one
float times int8 (a GGUF's Q4_K and Q6_K blocks kept: products.factor, csrc/cpu_q4packed.cpp):
stored so, they give the same bits as MLX's layout at every number of rows, come back unchanged,
and are looked up as before; whatever does not factor keeps its float32 arrays."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from support.tinymodels import llama_like
from test_products_int8 import _q8, reference
from test_repack import Stack, _packs, runs_as_mlx_layout

from macspec.core import target
from macspec.cpu import kernels, native, products
from macspec.cpu.state import STATE

ext = native.load()
pytestmark = pytest.mark.skipif(
    ext is None or not ext.q4_packs(), reason="this build repacks nothing (no int8 products)"
)


def kquant_tables(n: int, k: int, bits: int, seed: int) -> tuple[mx.array, mx.array]:
    """Scales and biases (n, k / 32) as a GGUF's kept blocks give them, per 256 weights of a row:
    4 bits (Q4_K) d * sc and -dmin * m, d and dmin float16 and sc, m in 0..63 with a 63 among
    them; 8 bits (Q6_K) d * sc / 4 with sc int8, a -128 among them, and the bias -128 * scale."""
    rng = np.random.default_rng(seed)
    shape = (n, k // 256, 8)

    def half(lo: float, hi: float) -> np.ndarray:  # float16 values, as float32
        return rng.uniform(lo, hi, (n, k // 256, 1)).astype(np.float16).astype(np.float32)

    if bits == 4:
        sc, m = rng.integers(0, 64, shape), rng.integers(0, 64, shape)
        sc[..., 2], m[..., 5] = 63, 63
        scales = half(1e-4, 1e-2) * sc.astype(np.float32)
        biases = -half(1e-4, 1e-2) * m.astype(np.float32)
    else:
        sc = rng.integers(-128, 128, shape)
        sc[..., 6] = -128
        scales = half(1e-4, 1e-2) / np.float32(4) * sc.astype(np.float32)
        biases = np.float32(-128) * scales
    return (mx.array(a.astype(np.float32).reshape(n, k // 32)) for a in (scales, biases))


def kquant_layer(n: int, k: int, bits: int, seed: int) -> nn.QuantizedLinear:
    layer = nn.QuantizedLinear(k, n, bias=False, group_size=32, bits=bits)
    words = np.random.default_rng(seed).integers(0, 2**32, (n, k * bits // 32), dtype=np.uint32)
    layer.weight = mx.array(words)
    layer.scales, layer.biases = kquant_tables(n, k, bits, seed + 1)
    return layer


@pytest.mark.parametrize("bits", [4, 8])
def test_factored_tables_give_mlx_layouts_bits_at_every_number_of_rows(bits):
    if not _packs(bits):
        pytest.skip("this build repacks no 8-bit weights (AVX-512 builds do)")
    layer = kquant_layer(48, 512, bits, seed=bits)  # 3 blocks of 16 rows, 2 super-blocks a row
    flat = (layer.weight, layer.scales, layer.biases)
    x = mx.random.normal((300, 512), key=mx.random.key(3))
    want = _q8(x, flat, 32, bits)
    np.testing.assert_array_equal(want[:4], reference(x[:4], *flat, 32, bits))
    products.pack(layer)
    assert products.factored(layer)
    assert layer.scales.dtype == mx.int8 and layer.scales.shape == (3, 16 + 8, 16)
    assert layer.biases.shape == layer.scales.shape
    packed = (layer.weight, layer.scales, layer.biases)
    for rows in [*range(1, 17), 20, 130, 300]:  # (past 128: x's rows in tiles)
        np.testing.assert_array_equal(_q8(x[:rows], packed, 32, bits), want[:rows])
    products.unpack(layer)
    for before, after in zip(flat, (layer.weight, layer.scales, layer.biases), strict=True):
        assert after.shape == before.shape and after.dtype == before.dtype
        assert np.array_equal(np.array(after).view(np.uint8), np.array(before).view(np.uint8))


def test_a_value_off_by_one_bit_keeps_the_float32_tables(monkeypatch):
    layer = kquant_layer(32, 256, 4, seed=5)
    s = np.array(layer.scales)
    s[17, 3] = np.nextafter(s[17, 3], np.float32(1))  # no longer d * an integer
    layer.scales = mx.array(s)
    x = mx.random.normal((3, 256), key=mx.random.key(6))
    want = _q8(x, (layer.weight, layer.scales, layer.biases), 32, 4)
    products.pack(layer)
    assert products.repacked(layer) and not products.factored(layer)
    assert layer.scales.dtype == layer.biases.dtype == mx.float32
    np.testing.assert_array_equal(_q8(x, (layer.weight, layer.scales, layer.biases), 32, 4), want)
    other = kquant_layer(32, 256, 4, seed=5)
    monkeypatch.setattr(STATE, "factor_scales", False)  # MACSPEC_FACTOR_SCALES=0
    products.pack(other)
    assert products.repacked(other) and other.scales.dtype == mx.float32


def test_groups_that_make_no_whole_float_stay_float32():
    layer = kquant_layer(16, 256, 4, seed=7)
    layer.weight = layer.weight[:, :16]  # 4 groups of 32 a row: no 8 to share a float
    layer.scales, layer.biases = layer.scales[:, :4], layer.biases[:, :4]
    products.pack(layer)
    assert products.repacked(layer) and not products.factored(layer)


def _kquant_model(tie: bool, factor: bool, monkeypatch) -> nn.Module:
    """A llama whose products (head and embedding included) are 4-bit in groups of 32 with
    K-quant tables, the head 8-bit where untied (a Q4_K_M file's Q6_K output), switched and
    repacked as a loaded model is."""
    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256}
    model = llama_like(hidden_size=256, vocab_size=96, tie_word_embeddings=tie, **shape)
    nn.quantize(model, group_size=32, bits=4)
    if not tie:
        model.lm_head = nn.QuantizedLinear(256, 96, bias=False, group_size=32, bits=8)
    for seed, (_, m) in enumerate(model.named_modules()):
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            n, words = m.weight.shape
            m.scales, m.biases = kquant_tables(n, words * 32 // m.bits, m.bits, seed)
    monkeypatch.setattr(STATE, "factor_scales", factor)
    kernels.accelerate(model)
    return model


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_factored_model_runs_looks_up_and_prunes_as_the_float32_one(tie, monkeypatch):
    if not tie and not _packs(8):
        pytest.skip("this build repacks no 8-bit weights (AVX-512 builds do)")
    flat, packed = (_kquant_model(tie, factor, monkeypatch) for factor in (False, True))
    head, _ = target.head_module(packed)
    assert products.factored(head) and products.factored(packed.model.layers[0].mlp.down_proj)
    assert not products.factored(target.head_module(flat)[0])
    runs_as_mlx_layout(flat, packed)
    assert products.factored(head)


def test_a_factored_layer_unpacks_for_float_activations(monkeypatch):
    stack = Stack(kquant_layer(32, 256, 4, seed=9))
    kernels.switch_products(stack)
    layer = stack.layers[0]
    x = mx.random.normal((1, 2, 256), key=mx.random.key(10))
    flat = (layer.weight, layer.scales, layer.biases)
    assert products.repack(stack) == 1 and products.factored(layer)
    monkeypatch.setattr(STATE, "int8_activations", False)  # float products read MLX's layout
    floats = np.array(layer(x))
    assert not products.repacked(layer)
    np.testing.assert_array_equal(floats, np.array(ext.qlinear(x, *flat, 32, 4)))
