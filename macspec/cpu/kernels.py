"""Faster CPU paths for the parts of a decoder layer that MLX's CPU backend runs slowly.

On Metal and CUDA, mx.fast.rope and mx.fast.scaled_dot_product_attention are real kernels. On the
CPU backend they are generic fallback graphs, and exp/sigmoid run their polynomial one element at
a time. A speculative verification pays these for every row, so they widen the gap between
checking K drafts and one plain step (README, "speed on Linux CPUs", has the measurements).

`accelerate` switches the attention and MLP of mlx-lm's llama and qwen2 layers (and the drafts
built from them), every RMS norm, and the weight products of any model (products.py), to the
methods below by changing their class. Where the native extension is built (native.py), the
norms, SwiGLU, RoPE and attention of any number of rows are one native primitive
each (csrc/cpu_layer.cpp, cpu_attention.cpp), and a whole llama/qwen2 layer two (blocks.py);
otherwise the whole-array forms below run.
Either way the change is in the class: weights, parameter names and saved files stay exactly
mlx-lm's. Plain and speculative decoding run the same switched model, so exactness is
untouched; the logits agree with mlx-lm's to float32 rounding (tests).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import blocks, native, products
from .products import on_cpu
from .state import STATE, kv_rows

log = logging.getLogger("macspec.cpu")


def native_layers() -> Any:
    """The native layer primitives (csrc/cpu_layer.cpp, cpu_attention.cpp), or None (mlx's ops)."""
    return native.load() if STATE.native_layers else None


def set_native_layers(on: bool) -> None:
    """Switch the native layer primitives on or off (tests, A/B timing)."""
    STATE.native_layers = on


_LOG2E = 1.4426950408889634
# 2^f on [-0.5, 0.5] (Cephes exp2f): MLX's own exp uses the same polynomial, element by element.
_EXP2 = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
)


def _exp(x: mx.array) -> mx.array:
    """exp(x) for float32 as whole-array ops: 2^n * 2^f with n = round(x log2 e)."""
    # exp(-inf) clips to 2^-127, flushed to 0 below.
    t = mx.clip(x.astype(mx.float32) * _LOG2E, -127.0, 127.0)
    n = mx.round(t)
    f = t - n
    p = _EXP2[0] * f + _EXP2[1]
    for c in _EXP2[2:]:
        p = p * f + c
    scale = ((n.astype(mx.int32) + 127) << 23).view(mx.float32)  # 2^n from its exponent bits
    return mx.where(t > -127.0, p * scale, 0.0)


def _shifted_exp(x: mx.array, top: mx.array) -> mx.array:
    return _exp(x - top)


def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return (gate * up / (1.0 + _exp(-gate))).astype(gate.dtype)


def _compiled(fn):
    """mx.compile fuses the exp polynomial into one CPU kernel (several times faster than the ops
    one by one: docs/cpu.md, "figures behind the code"); it needs a C++ compiler at run time, so
    without one the same ops run uncompiled."""
    if STATE.compiler_works is None:
        try:
            probe = mx.array([[0.5, -2.0]])
            mx.eval(mx.compile(_swiglu)(probe, probe))
            STATE.compiler_works = True
        except Exception as e:  # no compiler on this machine: the uncompiled graph is still exact
            log.info("mx.compile cannot compile here (%s): the exp runs uncompiled", e)
            STATE.compiler_works = False
    return mx.compile(fn) if STATE.compiler_works else fn


class _BoundedCompile:
    """`fn` compiled, recompiled from scratch after `limit` distinct input shapes.

    mx.compile keeps one traced graph per input shape. Attention's scores change shape with
    every token of context (a long generation grows the process steadily), and every new prompt
    length adds a shape to RoPE and SwiGLU. Dropping the compiled function frees its entries.
    `shapeless=True` would avoid this, but the exp's bit view cannot be traced shapeless, and
    the view-free forms of 2^n are slower (docs/cpu.md, "figures behind the code")."""

    def __init__(self, fn: Any, limit: int = 128) -> None:
        self.fn, self.limit = fn, limit
        self.shapes: set[tuple] = set()
        self.compiled: Any = None  # compiled on first use: the probe runs no earlier

    def __call__(self, *args: mx.array) -> Any:
        key = tuple(a.shape for a in args)
        if key not in self.shapes:
            if self.compiled is None or len(self.shapes) >= self.limit:
                self.shapes.clear()
                self.compiled = _compiled(self.fn)
            self.shapes.add(key)
        return self.compiled(*args)


_softmax_exp = _BoundedCompile(_shifted_exp)
_swiglu_fast = _BoundedCompile(_swiglu)


def softmax(x: mx.array, temperature: float = 1.0) -> mx.array:
    """softmax(x / temperature) over the last axis (float32); on the CPU backend with the fast
    exp, and with the native primitive on every core where it is built (a whole vocabulary a row
    is dear on one core: docs/cpu.md)."""
    if not on_cpu():
        return mx.softmax(x / temperature if temperature != 1.0 else x, axis=-1)
    x = x.astype(mx.float32)
    ext = native_layers()
    if ext is not None and x.ndim >= 1:
        return ext.softmax(x, 1.0 / temperature)
    if temperature != 1.0:
        x = x / temperature
    e = _softmax_exp(x, mx.max(x, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


class TableRoPE:
    """nn.RoPE from a table of cos/sin by position (grown on demand), instead of recomputing
    the angles with a dozen ops a call; same rotation, same float32 angles."""

    def __init__(self, rope: nn.RoPE, size: int = 1024) -> None:
        self.dims, self.traditional = rope.dims, rope.traditional
        self.base, self.scale = rope.base, rope.scale
        dims, traditional = self.dims, self.traditional
        self._pair = _BoundedCompile(
            lambda q, k, c, s: (
                _rotate(q, c, s, dims, traditional),
                _rotate(k, c, s, dims, traditional),
            )
        )
        self.size = 0
        self._grow(size)

    def _grow(self, size: int) -> None:
        inv = (self.base ** (-np.arange(0, self.dims, 2, dtype=np.float32) / self.dims)).astype(
            np.float32
        )
        theta = (np.arange(size, dtype=np.float32) * np.float32(self.scale))[:, None] * inv[None]
        self.cos, self.sin = mx.array(np.cos(theta)), mx.array(np.sin(theta))
        self.size = size

    def tables(self, end: int) -> tuple[mx.array, mx.array]:
        """cos and sin, (positions, dims / 2), for every position below `end` at least."""
        if end > self.size:
            self._grow(max(2 * self.size, end))
        return self.cos, self.sin

    def pair(self, q: mx.array, k: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Rotate queries and keys at once: one compiled graph instead of two dozen ops."""
        length = q.shape[-2]
        cos, sin = self.tables(offset + length)
        return self._pair(q, k, cos[offset : offset + length], sin[offset : offset + length])


def _rotate(x: mx.array, cos: mx.array, sin: mx.array, dims: int, traditional: bool) -> mx.array:
    half = dims // 2
    if traditional:  # pairs (0, 1), (2, 3), ...
        pairs = x[..., :dims].reshape(*x.shape[:-1], half, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        out = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
        rotated = [out.reshape(*x.shape[:-1], dims)]
    else:  # halves (0, d/2), (1, d/2 + 1), ...
        x1, x2 = x[..., :half], x[..., half:dims]
        rotated = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
    if dims < x.shape[-1]:
        rotated.append(x[..., dims:])
    return mx.concatenate(rotated, axis=-1).astype(x.dtype)


def _causal(length: int, total: int) -> mx.array:
    """Additive mask for `length` new queries at the end of `total` keys (cached per shape)."""
    masks = STATE.masks
    mask = masks.get((length, total))
    if mask is None:
        queries = mx.arange(total - length, total)[:, None]
        mask = mx.where(mx.arange(total)[None] <= queries, 0.0, -mx.inf)
        if len(masks) > 256:
            masks.clear()
        masks[(length, total)] = mask
    return mask


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: str | None) -> mx.array:
    """softmax(q k^T * scale + causal) v with grouped kv heads, without repeating k and v:
    the query heads of one kv head are stacked as rows of one product."""
    b, heads, length, dim = q.shape
    kv_heads, total = k.shape[1], k.shape[2]
    rep = heads // kv_heads
    q = (q * scale).reshape(b, kv_heads, rep * length, dim)
    scores = q @ k.swapaxes(-1, -2)
    if length > 1 and mask == "causal":
        scores = scores.reshape(b, kv_heads, rep, length, total) + _causal(length, total)
        scores = scores.reshape(b, kv_heads, rep * length, total)
    out = softmax(scores).astype(v.dtype) @ v
    return out.reshape(b, heads, length, dim)


def _native_attention(
    self, ext: Any, rope: TableRoPE, x: mx.array, offset: int, mask: Any, cache: Any, tree: Any
) -> mx.array:
    """The attention block as two native primitives around the cache update: RoPE with the
    split into heads, then attention over the cache, as (1, L, H*D). In a token tree's pass
    (tree.tree_pass) rows sit at their depths' positions and attend as its boolean mask says."""
    positions, end = tree[1:] if tree is not None else (None, offset + x.shape[1])
    cos, sin = rope.tables(end)
    q, k, v = ext.rope_heads(
        self.q_proj(x),
        self.k_proj(x),
        self.v_proj(x),
        cos,
        sin,
        self.n_heads,
        self.n_kv_heads,
        offset,
        rope.traditional,
        positions,
        STATE.kv_dtype == mx.float16,  # k and v as the caches keep them (state.kv_rows)
    )
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    if tree is not None:
        return self.o_proj(ext.attend(q, k, v, self.scale, False, mask))
    return self.o_proj(ext.attend(q, k, v, self.scale, mask is not None))


def native_case(attn: nn.Module, x: mx.array, mask: Any, cache: Any) -> tuple | None:
    """(ext, table, offset, tree) where `attn`'s pass can run on the native primitives (the
    attention here, the whole layer in blocks.py): one sequence of float32 rows (any number:
    each row's bits are those it gets alone), a table RoPE, an integer offset, a causal mask or
    a token tree's boolean one (tree.tree_pass: its table, positions and their end), an
    unquantized cache; else None."""
    ext = native_layers()
    tree = STATE.tree(attn)
    table = tree[0] if tree is not None else STATE.rope(attn)
    offset = 0 if cache is None else cache.offset
    b, length, _ = x.shape
    if (
        ext is not None
        and b == 1
        and x.dtype == mx.float32
        and isinstance(table, TableRoPE)
        and isinstance(offset, int)
        and (
            (tree is None and (mask is None or isinstance(mask, str)))
            or (tree is not None and isinstance(mask, mx.array) and mask.dtype == mx.bool_)
        )
        and not hasattr(cache, "bits")
    ):
        return ext, table, offset, tree
    return None


def _fast_attention_call(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    """mlx-lm's llama/qwen2 Attention.__call__ with the table RoPE and `attention` above; masks
    it does not know (arrays, windows) and quantized caches take mlx-lm's own path."""
    case = native_case(self, x, mask, cache)
    if case is not None:
        ext, table, offset, tree = case
        return _native_attention(self, ext, table, x, offset, mask, cache, tree)
    b, length, _ = x.shape
    offset = 0 if cache is None else cache.offset
    q = self.q_proj(x).reshape(b, length, self.n_heads, -1).transpose(0, 2, 1, 3)
    k = self.k_proj(x).reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = self.v_proj(x).reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    table = STATE.rope(self)
    if isinstance(offset, int) and isinstance(table, TableRoPE):
        q, k = table.pair(q, k, offset)
    else:  # a scaled RoPE variant, or per-sequence offsets: mlx-lm's own module
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
    quantized = hasattr(cache, "bits")  # mlx-lm's quantized cache: its own values and attention
    if not quantized:  # the values every pass of this model stores and reads
        k, v = kv_rows(k, v)
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    if not quantized:  # read as the queries' floats
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    if (mask is None or isinstance(mask, str)) and not quantized:
        out = attention(q, k, v, self.scale, "causal" if mask is not None else None)
    else:
        from mlx_lm.models.base import scaled_dot_product_attention

        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


def _fast_mlp_call(self, x: mx.array) -> mx.array:
    gate, up = self.gate_proj(x), self.up_proj(x)
    ext = native_layers()
    if ext is not None and gate.dtype == up.dtype == mx.float32:
        return self.down_proj(ext.swiglu(gate, up))
    return self.down_proj(_swiglu_fast(gate, up))


def _fast_norm_call(self, x: mx.array) -> mx.array:
    ext = native_layers()
    if ext is not None and x.dtype == self.weight.dtype == mx.float32:
        return ext.rms_norm(x, self.weight, self.eps)
    return STATE.stock[type(self)].__call__(self, x)


def switch_norms(module: nn.Module) -> int:
    """Switch every plain RMS norm of `module` to the native one; returns how many."""
    changed = 0
    for _, m in module.named_modules():
        if type(m) is nn.RMSNorm:
            m.__class__ = STATE.subclass(nn.RMSNorm, {"__call__": _fast_norm_call})
            changed += 1
    return changed


def switch_products(module: nn.Module) -> int:
    """Switch the weight products (linear layers, tied heads) of `module` and its children to
    the native few-row products (products.py); returns how many. Nothing off the CPU backend."""
    if not on_cpu():
        return 0
    changed = 0
    for _, m in module.named_modules():
        methods = products.METHODS.get(type(m))
        if methods is not None:
            m.__class__ = STATE.subclass(type(m), methods)
            changed += 1
    return changed


def _supported() -> tuple[tuple[type, ...], tuple[type, ...]]:
    from mlx_lm.models import llama, qwen2

    return (llama.Attention, qwen2.Attention), (llama.MLP, qwen2.MLP)


def accelerate_layers(layers: list) -> int:
    """Switch the supported attention/MLP modules of these decoder layers; returns how many
    layers changed. Does nothing off the CPU backend, where mx.fast is already fast."""
    if not on_cpu():
        return 0
    attentions, mlps = _supported()
    tables: dict[tuple, TableRoPE] = {}  # one table for all layers with the same RoPE
    changed = 0
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        hit = False
        if type(attn) in attentions and hasattr(attn, "rope"):
            rope = attn.rope
            # Only the plain nn.RoPE is tabulated; scaled variants keep their own module.
            if type(rope) is nn.RoPE:
                key = (rope.dims, rope.traditional, rope.base, rope.scale)
                if key not in tables:
                    tables[key] = TableRoPE(rope)
                STATE.keep(attn).rope = tables[key]
            else:
                STATE.keep(attn).rope = None
            attn.__class__ = STATE.subclass(type(attn), {"__call__": _fast_attention_call})
            hit = True
        if type(mlp) in mlps:
            mlp.__class__ = STATE.subclass(type(mlp), {"__call__": _fast_mlp_call})
            hit = True
        if isinstance(layer, nn.Module) and switch_products(layer) + switch_norms(layer):
            hit = True
        if isinstance(layer, nn.Module) and fusable(layer):  # two primitives (blocks.py)
            _switch_block(layer, fusable=True)
        changed += hit
    return changed


def _switch_block(layer: nn.Module, fusable: bool) -> None:
    if not STATE.is_switched(layer):
        layer.__class__ = STATE.subclass(type(layer), {"__call__": _overlapped_call})
    kept = STATE.keep(layer)
    kept.overlap, kept.fusable = False, fusable


def fusable(layer: nn.Module) -> bool:
    """A llama/qwen2 decoder layer whose attention and MLP were switched (blocks.py)."""
    from mlx_lm.models import llama, qwen2

    attentions, mlps = _supported()
    return (
        STATE.stock_class(layer) in (llama.TransformerBlock, qwen2.TransformerBlock)
        and STATE.stock.get(type(layer.self_attn)) in attentions
        and STATE.stock.get(type(layer.mlp)) in mlps
    )


def accelerate(model: nn.Module) -> int:
    """`accelerate_layers` over an mlx-lm model's trunk (`model.model.layers`), and the native
    products for every other weight product (the output head); a quantized half-precision
    model computes in float32 (products.float32_activations). Returns how many layers changed."""
    if not on_cpu():
        return 0
    if native.load() is not None:
        products.float32_activations(model)
    trunk = getattr(model, "model", None)
    layers = list(getattr(trunk, "layers", []) or [])
    changed = accelerate_layers(layers)
    switch_products(model)
    widened = products.widen_all(model)
    if widened:
        log.info("%d 5/6-bit products run as 8-bit integers (the same values)", widened)
    products.repack(model)
    switch_norms(model)  # the final norm
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Module):
            _switch_block(layer, fusable(layer))
            STATE.keep(layer).overlap = i % OVERLAP_EVERY == OVERLAP_EVERY - 1
    return changed


# Every third decoder layer starts evaluating the graph built so far, so that the stream computes
# while Python builds the rest of the pass. Only with the native products: OpenBLAS's threads
# wait for each other spinning, and a Python thread building beside them on a CPU of few cores
# slowed its products (docs/cpu.md, "figures behind the code").
OVERLAP_EVERY = 3


@contextmanager
def serial():
    """Build each pass whole before evaluating it (doctor times graph building alone)."""
    was, STATE.overlap = STATE.overlap, False
    try:
        yield
    finally:
        STATE.overlap = was


def _fused_call(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array | None:
    """The layer as two native primitives (blocks.py), or None where it cannot be."""
    case = native_case(self["self_attn"], x, mask, cache)
    return None if case is None else blocks.block_pass(self, *case, x, mask, cache)


def _overlapped_call(self, *args: Any, **kwargs: Any) -> Any:
    kept = STATE.kept(self)
    out = _fused_call(self, *args, **kwargs) if kept is not None and kept.fusable else None
    if out is None:
        out = STATE.stock[type(self)].__call__(self, *args, **kwargs)
    return overlapped(self, out)


def overlapped(layer: nn.Module, out: Any) -> Any:
    """`out`, the layer's output, its evaluation started where this layer starts one."""
    if STATE.overlap and isinstance(out, mx.array) and products.active():
        kept = STATE.kept(layer)
        if kept is not None and kept.overlap:
            mx.async_eval(out)
    return out


@contextmanager
def stock(*models: nn.Module | None) -> Iterator[None]:
    """The models (None skipped) exactly as mlx-lm runs them, for the duration (the
    benchmark's mlx-lm rows)."""
    switched = [
        m
        for model in models
        if model is not None
        for _, m in model.named_modules()
        if STATE.is_switched(m)
    ]
    repacked = [m for m in switched if products.repacked(m)]
    for m in switched:
        m.__class__ = STATE.stock[type(m)]
    for m in repacked:
        products.unpack(m)
    try:
        yield
    finally:
        for m in switched:
            m.__class__ = STATE.switched[type(m)]
        for m in repacked:
            products.pack(m)
