"""A llama/qwen2 decoder layer as two native primitives around the KV cache update.

With the native layer ops (kernels.py) a one-token SmolLM2 layer is still 17 MLX operations:
norm, three products, RoPE, the cache's update, attention, a product, an add, norm, two
products, SwiGLU, a product, an add. Each one costs the Python thread an allocation and a
hand-off to MLX's stream, and on a CPU of few cores that thread takes its core from the products'
threads (README, "speed on Linux CPUs"). `csrc/cpu_block.cpp` and `cpu_attn_mlp.cpp` run the same
kernels in the same order as two primitives, (norm, q/k/v, RoPE) and (attention, ..., the last
add), with the cache's update between them left to mlx-lm: the outputs are bit-identical to the
single ops'.

The weights are float32, or MLX's affine 4/8-bit layout as the native products take it, every
product of the layer alike; each primitive's products of the same input (q/k/v, gate/up) are one
job of the thread pool. Where anything is not the plain case (biased products besides q/k/v,
another norm, mixed or other quantizations, a quantized cache, a mask that is neither causal nor
a token tree's), `block_pass` returns None, the layer runs op by op, and why is logged once.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import products
from .state import STATE

log = logging.getLogger("macspec.cpu")


def enabled() -> bool:
    return STATE.native_blocks


def set_enabled(on: bool) -> None:
    """Fuse the layers or run them op by op (tests, A/B timing)."""
    STATE.native_blocks = on


def _is(module: Any, cls: type) -> bool:
    """`module` is a `cls` as mlx defines it, or the same switched to macspec's kernels."""
    return STATE.stock_class(module) is cls


def _layout(linears: tuple) -> tuple[int, int] | str:
    """(bits, group size) of the layer's products, all float32 (32, 0) or all quantized as the
    native products take them, in one group size (the kernels read each matrix's bits off its
    shapes: a GGUF's Q4_K_M mixes 4 and 8); else why not."""
    if all(_is(m, nn.Linear) and m.weight.dtype == mx.float32 for m in linears):
        return 32, 0
    if not all(_is(m, nn.QuantizedLinear) and products.quantized_ok(m) for m in linears):
        return "its products are neither all float32 nor all affine 4/8-bit quantized"
    if len({m.group_size for m in linears}) > 1:
        return "its products are quantized in different group sizes"
    if not STATE.int8_activations and any(products.repacked(m) for m in linears):
        return "its weights are repacked for int8 activations, which are switched off"
    return linears[0].bits, linears[0].group_size


def _arrays(m: Any, bits: int) -> tuple:
    return (m.weight,) if bits == 32 else (m.weight, m.scales, m.biases)


class _Checked:
    """A layer's weights as last checked, by the identity of its arrays (held here, so no other
    array can take their ids)."""

    __slots__ = ("arrays", "weights")

    def __init__(self, arrays: tuple, weights: tuple | None) -> None:
        self.arrays, self.weights = arrays, weights


def layer_weights(layer: nn.Module) -> tuple | None:
    """The layer's weights in the primitives' order and their layout, or None where they are not
    the plain case. Checked again only when one of its arrays was replaced (read as dict items:
    cheaper than nn.Module attributes, which count here)."""
    attn, mlp = layer["self_attn"], layer["mlp"]
    modules = (
        layer["input_layernorm"],
        attn["q_proj"],
        attn["k_proj"],
        attn["v_proj"],
        attn["o_proj"],
        layer["post_attention_layernorm"],
        mlp["gate_proj"],
        mlp["up_proj"],
        mlp["down_proj"],
    )
    arrays = [m.get(name) for m in modules for name in ("weight", "bias", "scales", "biases")]
    kept = STATE.keep(layer)
    checked = kept.checked
    if checked is None or not all(map(operator.is_, checked.arrays, arrays)):
        weights = _check(*modules)
        if isinstance(weights, str):
            if weights not in STATE.told:
                STATE.told.add(weights)
                log.info("a decoder layer runs op by op, not fused: %s", weights)
            weights = None
        checked = kept.checked = _Checked(arrays, weights)
    return checked.weights


def _check(*modules: Any) -> tuple | str:
    """The weights as block_pass passes them, or why the layer is not the plain case."""
    n1, q, k, v, o, n2, g, u, d = modules
    if not all(_is(n, nn.RMSNorm) and n.weight.dtype == mx.float32 for n in (n1, n2)):
        return "its norms are not float32 RMS norms"
    if any("bias" in m for m in (o, g, u, d)):
        return "its output or MLP products have biases"
    layout = _layout((q, k, v, o, g, u, d))
    if isinstance(layout, str):
        return layout
    with_bias = ["bias" in m for m in (q, k, v)]
    if any(with_bias) and not all(with_bias):
        return "some of its q/k/v products have biases, not all"
    biases = [q.bias, k.bias, v.bias] if all(with_bias) else None
    if biases is not None and any(b.dtype != mx.float32 for b in biases):
        return "its q/k/v biases are not float32"
    bits = layout[0]
    return (
        n1.weight,
        *(_arrays(m, bits) for m in (q, k, v)),
        biases,
        _arrays(o, bits),
        n2.weight,
        *(_arrays(m, bits) for m in (g, u, d)),
        layout,
    )


def block_pass(
    layer: nn.Module,
    ext: Any,
    table: Any,
    offset: int,
    tree: Any,
    x: mx.array,
    mask: Any,
    cache: Any,
) -> mx.array | None:
    """The layer's output for `x` through the two fused primitives, or None (run it op by op).
    `ext, table, offset, tree`: where the native attention may run (kernels.native_case, which
    checked the rows, mask and cache); this adds the weights' own conditions."""
    if not STATE.native_blocks or not products.active():
        return None
    weights = layer_weights(layer)
    if weights is None:
        return None
    q, k, v = qkv_rope(layer, ext, table, offset, tree, x, weights)
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    w2, wg, wu, wd, (bits, group) = weights[6:]
    causal = tree is None and mask is not None
    tree_mask = mask if tree is not None else None
    return ext.attn_mlp(
        x, q, k, v, weights[5], w2, layer["post_attention_layernorm"].eps, wg, wu, wd,
        layer["self_attn"].scale, causal, tree_mask, bits, group, STATE.int8_activations,
    )  # fmt: skip


def qkv_rope(
    layer: nn.Module, ext: Any, table: Any, offset: int, tree: Any, x: mx.array, weights: tuple
) -> tuple[mx.array, mx.array, mx.array]:
    """The first primitive: norm, q/k/v products and RoPE of the rows of `x`."""
    w1, wq, wk, wv, biases = weights[:5]
    bits, group = weights[-1]
    attn = layer["self_attn"]
    positions, end = tree[1:] if tree is not None else (None, offset + x.shape[1])
    cos, sin = table.tables(end)
    return ext.qkv_rope(
        x, w1, layer["input_layernorm"].eps, wq, wk, wv, cos, sin, attn.n_heads,
        attn.n_kv_heads, offset, table.traditional, biases, positions, bits, group,
        STATE.int8_activations, STATE.kv_dtype == mx.float16,
    )  # fmt: skip
