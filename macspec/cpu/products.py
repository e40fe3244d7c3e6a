"""Weight products of a few rows on the CPU backend: one pass over the weights for every row.

A decode step or a verification pass multiplies 1 to K+1 rows by every weight matrix. MLX's CPU
backend hands float32 products to BLAS, whose sgemm packs the weights before multiplying (a
copy as large as the weights, every call), and runs quantized ones in scalar code on x86 (no SIMD
there; with float16 activations each multiply-add is emulated). The native extension
(native.py) streams each weight matrix once for all rows, on every core, from float32 or MLX's
affine 4/8-bit layout; quantized products quantize the rows to int8 and take integer dot products
(AVX-512 VNNI, AVX-VNNI or AVX2), unless switches.INT8_ACTIVATIONS is off. Off the CPU backend,
or without the extension, mlx's own ops run.

Every row's result is computed in the same order whatever the number of rows (the kernels take
rows in blocks, each row summed alone), so a plain step, a verification pass of any width and a
prompt chunk agree bit for bit on their products.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..core import target
from . import native
from .state import STATE


def enabled() -> bool:
    return STATE.native_products


def active() -> bool:
    """The native products are switched on and built (loaded)."""
    return STATE.native_products and native.load() is not None


def set_enabled(on: bool) -> None:
    """Switch the native products on or off for every switched module (tests, A/B timing)."""
    STATE.native_products = on


def _ext(x: mx.array) -> Any:
    if not STATE.native_products or x.dtype != mx.float32 or x.ndim == 0:
        return None
    return native.load()


def _float32(x: mx.array, w: mx.array) -> Any:
    """The extension, for a float32 product of any number of rows; else None (mlx's own).

    Prompt chunks too: a BLAS would round a row differently beside others (so a verification
    row would not be a plain step's), and the reference BLAS of a fresh install is many times
    slower (docs/cpu.md, "any number of rows")."""
    ext = _ext(x)
    return ext if ext is not None and w.dtype == mx.float32 else None


def quantized_ok(m: nn.Module) -> bool:
    """`m`'s weights are in a layout the native products take."""
    return (
        getattr(m, "mode", "affine") == "affine"
        and m.bits in (4, 8)
        and m.group_size in (32, 64, 128)
        and m.weight.dtype == mx.uint32
        and m.get("biases") is not None
        and (m["scales"].dtype in (mx.float32, mx.float16, mx.bfloat16) or factored(m))
    )


def matmul_t(x: mx.array, w: mx.array) -> mx.array:
    """x @ w.T for a float32 weight matrix held outside a layer (the EAGLE draft's head rows)."""
    ext = _float32(x, w) if on_cpu() else None
    return ext.linear(x, w) if ext is not None else x @ w.T


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def linear_call(self: nn.Linear, x: mx.array) -> mx.array:
    ext = _float32(x, self.weight)
    if ext is not None:
        y = ext.linear(x, self.weight)
        return y + self["bias"] if "bias" in self else y
    return STATE.stock[type(self)].__call__(self, x)


def _qlinear(ext: Any, m: nn.Module, x: mx.array) -> mx.array:
    return ext.qlinear(
        x, m.weight, m.scales, m.biases, m.group_size, m.bits, int8=STATE.int8_activations
    )


def quantized_linear_call(self: nn.QuantizedLinear, x: mx.array) -> mx.array:
    ext = _ext(x)
    if repacked(self) and (ext is None or not STATE.int8_activations):
        unpack(self)  # mlx's own product, or float activations, read MLX's layout
    if ext is not None and quantized_ok(self):
        y = _qlinear(ext, self, x)
        return y + self["bias"] if "bias" in self else y
    return STATE.stock[type(self)].__call__(self, x)


# -------------------------------------------------------------------- weights repacked at load
#
# With AVX-512 or AVX2 the int8 products take 4-bit weights in groups of 64 or 32 (AVX-512: 8-bit
# too) repacked once: each 16-row block's words transposed (weights (N / 16, K / G, G bits / 2),
# scales and biases (N / 16, K / G, 16); csrc/cpu_q4packed.cpp), which the kernels otherwise do in
# every pass. The arrays replace the module's own (no second copy); the same bits come out.
# Anything that would read them as MLX's layout (mlx's own product, float activations,
# `kernels.stock`) unpacks them first; their new shapes make mlx refuse them rather than misread
# them.


def repacked(m: nn.Module) -> bool:
    return isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.weight.ndim == 3


def packable(m: nn.Module) -> bool:
    """`m` is a 4-bit (or, on AVX-512, 8-bit) product in groups of 64 or 32 that this build
    takes repacked."""
    ext = native.load()
    return (
        ext is not None
        and STATE.native_products
        and STATE.int8_activations
        and STATE.repack_weights
        and ext.q4_packs()
        and isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        and quantized_ok(m)
        and (m.bits == 4 or (m.bits == 8 and ext.q8_packs()))
        and m.group_size in (32, 64)
        and m.weight.ndim == 2
        and m.weight.shape[0] % 16 == 0
    )


def pack(m: nn.Module) -> None:
    """Repack `m`'s weights for the int8 products (a no-op where they are)."""
    if repacked(m):
        return
    w, s, b = m.weight, m.scales, m.biases
    n, words = w.shape
    per = m.group_size * m.bits // 32  # words a group
    blocks, groups = n // 16, words // per
    m.weight = mx.contiguous(w.reshape(blocks, 16, groups, per).transpose(0, 2, 3, 1)).reshape(
        blocks, groups, 16 * per
    )
    m.scales, m.biases = (
        mx.contiguous(a.reshape(blocks, 16, groups).transpose(0, 2, 1)) for a in (s, b)
    )
    if STATE.factor_scales and m.scales.dtype == mx.float32:
        tables = [factor(a, m.bits) for a in (m.scales, m.biases)]
        if all(t is not None for t in tables):
            m.scales, m.biases = tables
    mx.eval(m.weight, m.scales, m.biases)


def unpack(m: nn.Module) -> None:
    """`m`'s weights back in MLX's layout (a no-op where they are)."""
    if not repacked(m):
        return
    if factored(m):
        m.scales, m.biases = (unfactor(a) for a in (m.scales, m.biases))
    blocks, groups, lanes = m.weight.shape
    per = lanes // 16
    w = m.weight.reshape(blocks, groups, per, 16).transpose(0, 3, 1, 2)
    m.weight = mx.contiguous(w).reshape(blocks * 16, groups * per)
    m.scales, m.biases = (
        mx.contiguous(a.transpose(0, 2, 1)).reshape(blocks * 16, groups)
        for a in (m.scales, m.biases)
    )
    mx.eval(m.weight, m.scales, m.biases)


# A GGUF's K-quant blocks, kept (models/gguf_blocks.py), give float32 scales and biases that are,
# 8 groups of 32 at a time (a 256-weight super-block), one float times small integers: Q4_K's
# d * sc and -dmin * m (6-bit sc, m), Q6_K's d * sc / 4 (int8 sc). Stored so, a repacked group of
# 32 weights carries 24 bits of them instead of 64; decoding is bandwidth-bound, and on the 1.5B
# Q4_K_M target they were 386 MB of the 1.37 GB a token reads. Each factored value is checked to
# the bit (float32(int) * float32 rounds to it exactly), so the kernels compute the same numbers;
# where any value does not factor, the float32 arrays stay. Layout: csrc/cpu_q4packed.cpp.
SUPER = 8  # groups a float covers
# The integer the largest |value| of a super-block is given, likeliest first by bits: Q4_K's
# largest sc and m are 63 (llama.cpp scales them so), Q6_K's largest |sc| is -128 (its scale is
# -128 / max); 127 for other int8 scales.
LARGEST = {4: (63.0, -128.0, 127.0), 8: (-128.0, 127.0, 63.0)}


def factor(a: mx.array, bits: int) -> mx.array | None:
    """Repacked float32 scales or biases (blocks, groups, 16) of `bits`-bit weights as the
    factored int8 table (blocks, groups + groups / 2, 16), or None where they do not factor
    exactly. (About a second for the 1.5B target's 386 MB of tables.)"""
    blocks, groups, lanes = a.shape
    if groups % SUPER:
        return None
    t = a.reshape(blocks, groups // SUPER, SUPER, lanes)  # a float for each (block, super, lane)
    top = mx.take_along_axis(t, mx.argmax(mx.abs(t), axis=2, keepdims=True), axis=2)
    d = q = done = None
    for largest in LARGEST.get(bits, LARGEST[8]):
        f = top / largest
        # all zeros: 0 (0 * 0 gives +0, so a -0 there does not factor)
        i = mx.where(f == 0, 0, mx.clip(mx.round(t / f), -128, 127)).astype(mx.int8)
        back = (f * i.astype(mx.float32)).view(mx.uint32)
        exact = mx.all(back == t.view(mx.uint32), axis=2, keepdims=True)
        if done is None:
            d, q, done = f, i, exact
        else:
            new = exact & ~done
            d, q, done = mx.where(new, f, d), mx.where(new, i, q), done | exact
        if mx.all(done).item():
            floats = d.view(mx.int8).reshape(blocks, groups // 2, lanes)
            return mx.concatenate([q.reshape(blocks, groups, lanes), floats], axis=1)
    return None


def unfactor(a: mx.array) -> mx.array:
    """A factored table back as float32 (blocks, groups, 16), the same bits."""
    blocks, rows, lanes = a.shape
    groups = rows * 2 // 3
    q = a[:, :groups].astype(mx.float32)
    d = mx.contiguous(a[:, groups:]).view(mx.float32).reshape(blocks, groups // SUPER, 1, lanes)
    return (q.reshape(blocks, groups // SUPER, SUPER, lanes) * d).reshape(blocks, groups, lanes)


def factored(m: nn.Module) -> bool:
    return repacked(m) and m["scales"].dtype == mx.int8


# 5- and 6-bit weights (a GGUF's Q5_K kept, an MLX 5/6-bit model) have no kernel of their own:
# they run as 8-bit integers. q stays q (scale * q + bias unchanged), so the model is the same
# and a step's and a row's products agree as for any 8-bit one; it costs 8/bits of their bytes
# (1.6x for 5 bits) against MLX's scalar product. 2/3 bits stay there: widened they would grow
# 2.7-4x.
WIDENED_BITS = (5, 6)


def widenable(m: nn.Module) -> bool:
    return (
        active()
        and isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        and getattr(m, "mode", "affine") == "affine"
        and m.bits in WIDENED_BITS
        and m.weight.dtype == mx.uint32
        and m.weight.ndim == 2
        and (m.weight.shape[1] * 32 // m.bits) % 8 == 0
    )


def widen(m: nn.Module) -> None:
    """`m`'s b-bit weights as MLX's 8-bit layout: the same integers, a byte each."""
    bits, (n, words) = m.bits, m.weight.shape
    k = words * 32 // bits
    # MLX packs b-bit values as one little-endian bit stream a row: 8 values fill b bytes.
    chunks = np.array(m.weight).view(np.uint8).reshape(n, k // 8, bits).astype(np.uint64)
    stream = sum(chunks[..., i] << np.uint64(8 * i) for i in range(bits))
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    q = ((stream[..., None] >> shifts) & np.uint64((1 << bits) - 1)).astype(np.uint8)
    m.weight = mx.array(q.reshape(n, k).view(np.uint32))
    m.bits = 8
    mx.eval(m.weight)


def widen_all(model: nn.Module) -> int:
    """`widen` every 5/6-bit product of `model` (layers, head, embedding); returns how many."""
    todo = [m for _, m in model.named_modules() if widenable(m)]
    for m in todo:
        widen(m)
    return len(todo)


def repack(model: nn.Module) -> int:
    """Repack every 4-bit product of `model`'s layers, and its output head (tied or not), that
    this build takes so. Returns how many."""
    done = 0
    for name, m in model.named_modules():
        if ".layers." in f".{name}." and packable(m):
            pack(m)
            done += 1
    head = _head(model)
    if head is not None and packable(head):
        pack(head)
        done += 1
    return done


def _head(model: nn.Module) -> nn.Module | None:
    try:
        return target.head_module(model)[0]
    except AttributeError:  # not an mlx-lm language model (a drafter's own module)
        return None


def take_rows(m: nn.Module, name: str, ids: mx.array) -> mx.array:
    """hooks.take_rows: rows `ids` of `m`'s array `name` in MLX's layout, gathered from the
    repacked one where `m` is repacked (a pruned draft head's rows, an embedding's lookups)."""
    a = m[name]
    if not (repacked(m) and name in ("weight", "scales", "biases")):
        return mx.take(a, ids, axis=0)
    ids = ids.astype(mx.uint32)
    if name != "weight" and factored(m):
        return _factored_rows(a, ids)
    # Weights [b][g][c * 16 + r] = W[16b + r][words * g + c]; scales [b][g][r] = S[16b + r][g].
    _, groups, width = a.shape
    words = width // 16  # words a group of weights (8 or 4), 1 scale
    start = (ids // 16) * (groups * width) + ids % 16
    within = (mx.arange(groups)[:, None] * width + mx.arange(words)[None] * 16).reshape(-1)
    return mx.take(a.reshape(-1), start[..., None] + within.astype(mx.uint32))


def _factored_rows(a: mx.array, ids: mx.array) -> mx.array:
    """Rows `ids` (uint32) of a factored table, as float32 (..., groups) in MLX's layout."""
    _, rows, _ = a.shape
    groups = rows * 2 // 3
    flat = a.reshape(-1)
    block, lane = (ids // 16) * (rows * 16), ids % 16  # in bytes; a block's floats at groups * 16
    q = mx.take(flat, (block + lane)[..., None] + (mx.arange(groups) * 16).astype(mx.uint32))
    at = (block + groups * 16) // 4 + lane
    d = mx.take(
        flat.view(mx.float32), at[..., None] + (mx.arange(groups // SUPER) * 16).astype(mx.uint32)
    )
    q = q.astype(mx.float32).reshape(*ids.shape, groups // SUPER, SUPER)
    return (q * d[..., None]).reshape(*ids.shape, groups)


def quantized_embedding_call(self: nn.QuantizedEmbedding, x: mx.array) -> mx.array:
    """An embedding's lookup, as mlx's, from repacked weights as well (a tied head's)."""
    if not repacked(self):
        return STATE.stock[type(self)].__call__(self, x)
    w, s, b = (take_rows(self, name, x) for name in ("weight", "scales", "biases"))
    return mx.dequantize(
        w, scales=s, biases=b, group_size=self.group_size, bits=self.bits, mode=self.mode
    )


def embedding_as_linear(self: nn.Embedding, x: mx.array) -> mx.array:
    ext = _float32(x, self.weight)
    if ext is not None:
        return ext.linear(x, self.weight)
    return STATE.stock[type(self)].as_linear(self, x)


def quantized_embedding_as_linear(self: nn.QuantizedEmbedding, x: mx.array) -> mx.array:
    ext = _ext(x)
    if repacked(self) and (ext is None or not STATE.int8_activations):
        unpack(self)
    if ext is not None and quantized_ok(self):
        return _qlinear(ext, self, x)
    return STATE.stock[type(self)].as_linear(self, x)


# Module class -> the methods its switched class overrides.
METHODS: dict[type, dict[str, Any]] = {
    nn.Linear: {"__call__": linear_call},
    nn.QuantizedLinear: {"__call__": quantized_linear_call},
    nn.Embedding: {"as_linear": embedding_as_linear},
    nn.QuantizedEmbedding: {
        "as_linear": quantized_embedding_as_linear,
        "__call__": quantized_embedding_call,
    },
}


def float32_activations(model: nn.Module) -> bool:
    """A quantized model stored in float16/bfloat16 computes in float32 on the CPU backend.

    MLX's CPU backend has no half-precision arithmetic on x86: every elementwise op converts
    each element, and its quantized product with half activations takes seconds a token. The
    norms, the embedding's scales (its lookups then return float32) and any unquantized weights
    become float32; quantized matrices keep their half scales, which the extension reads.
    Returns whether anything changed. The logits are then the model's computed in float32,
    for plain and speculative decoding alike."""
    modules = list(model.named_modules())
    if not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in modules):
        return False
    converted = []
    for _, m in modules:
        keep = ("scales", "biases") if isinstance(m, nn.QuantizedLinear) else ()
        for name, value in m.items():
            if (
                isinstance(value, mx.array)
                and value.dtype in (mx.float16, mx.bfloat16)
                and name not in keep
            ):
                m[name] = value.astype(mx.float32)
                converted.append(m[name])
    # Converted now, not in the first pass: a lazy array runs on the stream of the thread that
    # built it, and MLX streams are per thread (a server generates on a thread of its own).
    mx.eval(converted)
    return bool(converted)
