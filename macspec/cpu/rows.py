"""A shared pass's decoder layer as two native primitives (hooks.rows_layer, core/batch.py).

Run through the layer's own modules, each row of a shared pass costs a dozen MLX ops a layer (its
slices of the block's q/k/v, RoPE, the cache's update, attention, a second call for its padding)
besides the layer's own ten, and on a CPU of few cores each op's hand-off to MLX's stream is a large
part of a narrow pass. Here a llama/qwen2 layer (blocks.py's case) runs as (norm, q/k/v, RoPE)
over the whole block, each id at its row's own position as a token tree's pass places its ids,
then each row's cache update, then (each row's attention over its own cache, the output product,
norm, MLP) over the block: csrc/cpu_attn_mlp.cpp's RowsAttnMlp. The causal attention computes every
query row alone (cpu_attention.cpp), so a row's real ids get the bits they get alone, its
padding after them; the products compute every row alone too.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from . import blocks, kernels, products
from .state import STATE


def _case(layer: nn.Module, x: mx.array, caches: list) -> tuple | None:
    """(ext, table, weights) where this layer's shared pass can run here: a fused llama/qwen2
    layer (blocks.py) with a table RoPE, a float32 block, unquantized KV caches at integer
    offsets; else None."""
    ext, kept = kernels.native_layers(), STATE.kept(layer)
    if (
        ext is None
        or not hasattr(ext, "rows_attn_mlp")
        or not blocks.enabled()
        or not products.active()
        or kept is None
        or not kept.fusable
        or x.dtype != mx.float32
        or x.ndim != 3
        or not all(type(c) is KVCache and isinstance(c.offset, int) for c in caches)
    ):
        return None
    attn = layer["self_attn"]
    table = STATE.rope(attn)
    if not isinstance(table, kernels.TableRoPE) or STATE.tree(attn) is not None:
        return None
    weights = blocks.layer_weights(layer)
    return None if weights is None else (ext, table, weights)


def _block_positions(offsets: tuple[int, ...], width: int) -> mx.array:
    """Row r's ids at offsets[r], offsets[r] + 1, ..., as one (B * width,) int32 array; every
    layer of a pass asks for the same one."""
    key, positions = (offsets, width), STATE.positions
    if key not in positions:
        positions.clear()
        positions[key] = mx.array([o + j for o in offsets for j in range(width)], mx.int32)
    return positions[key]


def rows_layer(layer: nn.Module, x: mx.array, caches: list) -> Any:
    """hooks.rows_layer: the decoder layer's output for the block `x` (B, W, hidden), row r fed
    after its own cache `caches[r]` (all W ids, its padding included); None where the native
    primitives cannot take it (the core then runs each row's attention through the module)."""
    case = _case(layer, x, caches)
    if case is None:
        return None
    ext, table, weights = case
    b, width, dim = x.shape
    offsets = tuple(c.offset for c in caches)
    h = x.reshape(1, b * width, dim)
    tree = (table, _block_positions(offsets, width), max(offsets) + width)
    q, k, v = blocks.qkv_rope(layer, ext, table, 0, tree, h, weights)
    for r, cache in enumerate(caches):
        part = slice(r * width, (r + 1) * width)
        # The views it returns are never evaluated: the primitive reads the buffers in place.
        cache.update_and_fetch(k[:, :, part], v[:, :, part])
    keys, values = [c.keys for c in caches], [c.values for c in caches]
    lengths = [c.offset for c in caches]
    wo, norm, wg, wu, wd, (bits, group) = weights[5:]
    out = ext.rows_attn_mlp(
        h, q, keys, values, lengths, wo, norm, layer["post_attention_layernorm"].eps, wg, wu,
        wd, layer["self_attn"].scale, bits, group, STATE.int8_activations,
    )  # fmt: skip
    return kernels.overlapped(layer, out.reshape(b, width, dim))
