"""4-bit weights repacked at load for the int8 products (products.repack, csrc/cpu_q4packed.cpp):
the same bits as MLX's layout at every number of rows, and MLX's layout back wherever anything
else reads the weights."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from support.tinymodels import llama_like
from test_products_int8 import _q8, _weights, reference

from macspec.core import hooks, target
from macspec.core.drafters import pruned
from macspec.cpu import kernels, native, products
from macspec.cpu.state import STATE

ext = native.load()
pytestmark = pytest.mark.skipif(
    ext is None or not ext.q4_packs(), reason="this build repacks nothing (no int8 products)"
)


class Stack(nn.Module):
    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        self.layers = list(layers)


def _layer(n: int, k: int, dtype, seed: int) -> nn.QuantizedLinear:
    layer = nn.QuantizedLinear(k, n, bias=False, group_size=64, bits=4)
    layer.weight, layer.scales, layer.biases = _weights(n, k, 64, 4, dtype, seed=seed)
    return layer


LAYOUTS = [(4, 64), (4, 32), (8, 32), (8, 64)]  # 4-bit g32 / 8-bit g32: a GGUF's Q4_K, Q6_K kept


def _packs(bits: int) -> bool:
    return ext.q4_packs() and (bits == 4 or ext.q8_packs())


@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_repacked_weights_give_mlx_layouts_bits_at_every_number_of_rows(dtype, bits, group):
    if not _packs(bits):
        pytest.skip("this build repacks no 8-bit weights (AVX-512 builds do)")
    k = 5 * group  # 5 groups
    layer = nn.QuantizedLinear(k, 48, bias=False, group_size=group, bits=bits)  # 3 blocks
    layer.weight, layer.scales, layer.biases = _weights(48, k, group, bits, dtype, seed=8)
    flat = (layer.weight, layer.scales, layer.biases)
    x = mx.random.normal((300, k), key=mx.random.key(9))
    want = _q8(x, flat, group, bits)
    np.testing.assert_array_equal(want[:5], reference(x[:5], *flat, group, bits))
    products.pack(layer)
    assert layer.weight.shape == (3, 5, group * bits // 2) and layer.scales.shape == (3, 5, 16)
    packed = (layer.weight, layer.scales, layer.biases)
    # past 8 rows the kernel takes x 8 rows at a time; past 128 a prompt chunk's x in tiles
    for rows in [*range(1, 17), 20, 130, 300]:
        np.testing.assert_array_equal(_q8(x[:rows], packed, group, bits), want[:rows])
    products.unpack(layer)
    for before, after in zip(flat, (layer.weight, layer.scales, layer.biases), strict=True):
        assert after.shape == before.shape and after.dtype == before.dtype
        assert mx.array_equal(after, before).item()


@pytest.mark.parametrize("bits", [5, 6])
@pytest.mark.parametrize("group", [32, 64])
def test_5_and_6_bit_weights_widen_to_the_same_integers_a_byte_each(bits, group):
    """products.widen: the same dequantized weights at 8 bits, which the int8 products take
    (repacked on AVX-512) with the same bits at every number of rows."""
    k = 5 * group
    layer = nn.QuantizedLinear(k, 48, bias=False, group_size=group, bits=bits)
    w = mx.random.normal((48, k), key=mx.random.key(bits))
    layer.weight, layer.scales, layer.biases = mx.quantize(w, group_size=group, bits=bits)
    before = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=group, bits=bits)
    stack = Stack(layer)
    kernels.switch_products(stack)
    assert products.widen_all(stack) == 1 and layer.bits == 8
    assert layer.weight.shape == (48, k // 4)
    after = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=group, bits=8)
    assert mx.array_equal(before, after).item()
    x = mx.random.normal((12, k), key=mx.random.key(3))
    flat = (layer.weight, layer.scales, layer.biases)
    want = _q8(x, flat, group, 8)
    if _packs(8):
        products.pack(layer)
    for rows in (1, 2, 5, 12):
        np.testing.assert_array_equal(np.array(layer(x[:rows])), want[:rows])
    assert products.widen_all(stack) == 0  # widened once


def test_a_repacked_layer_unpacks_for_mlx_and_for_float_activations(monkeypatch):
    stack = Stack(_layer(32, 128, mx.bfloat16, seed=10))
    kernels.switch_products(stack)
    layer = stack.layers[0]
    x = mx.random.normal((1, 2, 128), key=mx.random.key(11))
    stock = np.array(nn.QuantizedLinear.__call__(layer, x))
    native_int8 = np.array(layer(x))
    assert products.repack(stack) == 1 and products.repacked(layer)
    np.testing.assert_array_equal(np.array(layer(x)), native_int8)
    monkeypatch.setattr(STATE, "int8_activations", False)  # float products read MLX's layout
    floats = np.array(layer(x))
    assert not products.repacked(layer)
    np.testing.assert_array_equal(
        floats, np.array(ext.qlinear(x, layer.weight, layer.scales, layer.biases, 64, 4))
    )
    monkeypatch.setattr(STATE, "int8_activations", True)
    products.pack(layer)
    products.set_enabled(False)
    try:
        np.testing.assert_array_equal(np.array(layer(x)), stock)  # mlx's own product
    finally:
        products.set_enabled(True)
    assert not products.repacked(layer)


def test_the_stock_models_read_mlx_layout_and_get_theirs_back():
    stack = Stack(_layer(32, 128, mx.float16, seed=12))
    kernels.switch_products(stack)
    layer = stack.layers[0]
    x = mx.random.normal((1, 1, 128), key=mx.random.key(13))
    want = np.array(nn.QuantizedLinear.__call__(layer, x))
    products.repack(stack)
    with kernels.stock(stack):
        assert not products.repacked(layer)
        np.testing.assert_array_equal(np.array(layer(x)), want)
    assert products.repacked(layer)


def test_nothing_is_repacked_but_groups_of_32_or_64_in_blocks_of_16_rows():
    stack = Stack(
        _layer(40, 128, mx.float32, seed=14),  # 40 rows: not whole blocks
        nn.QuantizedLinear(128, 32, bias=False, group_size=32, bits=4),
        nn.QuantizedLinear(128, 32, bias=False, group_size=32, bits=8),
        nn.QuantizedLinear(256, 32, bias=False, group_size=128, bits=4),
        _layer(32, 128, mx.float32, seed=15),
    )
    kernels.switch_products(stack)
    eight = ext.q8_packs()
    assert products.repack(stack) == 2 + eight
    assert [products.repacked(m) for m in stack.layers] == [False, True, eight, False, True]


def _tiny_pair(tie: bool, repack: bool, monkeypatch) -> nn.Module:
    """A quantized llama whose every product, the output head included, is 4-bit in groups of 64,
    switched as a loaded model is, repacked or not."""
    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    model = llama_like(hidden_size=64, vocab_size=96, tie_word_embeddings=tie, **shape)
    nn.quantize(model, group_size=64, bits=4)
    monkeypatch.setattr(STATE, "repack_weights", repack)
    kernels.accelerate(model)
    return model


def runs_as_mlx_layout(flat: nn.Module, packed: nn.Module) -> None:
    """`packed` (a 96-id model with its products repacked) gives `flat`'s bits: whole passes,
    embedding lookups, its head's rows (MLX's layout) and a pruned head, and through the stock
    models, which read MLX's layout."""
    head, _ = target.head_module(packed)
    tokens = mx.array([[5, 9, 2, 40, 95, 0]])
    np.testing.assert_array_equal(np.array(packed(tokens)), np.array(flat(tokens)))
    embed = (flat.model.embed_tokens, packed.model.embed_tokens)
    np.testing.assert_array_equal(*(np.array(e(tokens)) for e in embed))
    ids = pruned.frequent_ids(20, 96, keep=[93, 95])
    for name in ("weight", "scales", "biases"):  # MLX's layout, whatever the head's own
        np.testing.assert_array_equal(
            *(
                np.array(hooks.take_rows(target.head_module(m)[0], name, ids))
                for m in (flat, packed)
            )
        )
    hidden = target.hidden_states(flat, tokens[0], None)
    np.testing.assert_array_equal(
        *(np.array(pruned.PrunedHead(m, ids, 96)(hidden)) for m in (flat, packed))
    )
    with kernels.stock(packed, flat):  # mlx's own products, reading MLX's layout
        assert not products.repacked(head)
        np.testing.assert_array_equal(np.array(packed(tokens)), np.array(flat(tokens)))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_the_output_head_is_repacked_and_its_rows_and_lookups_stay_mlxs(tie, monkeypatch):
    flat, packed = (_tiny_pair(tie, repack, monkeypatch) for repack in (False, True))
    head, _ = target.head_module(packed)
    assert products.repacked(head) and not products.repacked(target.head_module(flat)[0])
    runs_as_mlx_layout(flat, packed)
    assert products.repacked(head)


def test_a_repacked_head_unpacks_for_float_activations(monkeypatch):
    model = _tiny_pair(True, True, monkeypatch)
    head = model.model.embed_tokens
    tokens = mx.array([[1, 2, 3]])
    monkeypatch.setattr(STATE, "int8_activations", False)
    floats = np.array(model(tokens))
    assert not products.repacked(head)
    monkeypatch.setattr(STATE, "repack_weights", False)
    np.testing.assert_array_equal(np.array(_tiny_pair(True, False, monkeypatch)(tokens)), floats)
