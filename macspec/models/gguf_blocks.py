"""GGUF blocks as MLX affine groups of 32 (w = scale * q + bias), read straight from the file's
bytes: what `convert -q keep` (the default for a GGUF source) writes instead of decoding.

- Q8_0, Q4_0, Q4_1: one group a block; scale d, bias -128 d, -8 d or m. Exact.
- Q4_K, Q5_K: a 256-weight super-block of eight groups of 32 with 6-bit sub-scales and mins:
  scale = d * sc, bias = -dmin * m, q as stored (4 or 5 bits). Exact in float32: d * sc needs
  17 significant bits, (d * sc) * q at most 22, so one rounding in `scale * q + bias` is the
  same one as gguf's `d * q - dm`.
- Q6_K: 16-weight sub-blocks with int8 scales, which no MLX group holds (MLX's smallest group is
  32). Each group of 32 becomes 8 bits with scale = d * sc_big / 4 (sc_big: the sub-block scale
  of larger magnitude) and bias = -128 * scale: that sub-block is exact (n = 4 q), the other is
  rounded to the nearest of 4 * sc_other / sc_big * (q - 32), exact when that is an integer, else
  off by at most a quarter of the larger sub-block's step (an eighth but where the rounding meets
  the end of the 8-bit range) (docs/models.md, "GGUF blocks kept").

The scales and biases are float32 (exact) or float16 / bfloat16, which round them (relative error
at most 2^-11 / 2^-8 of a scale); `scales_report` says by how much, measured on the tensor.

Why by hand: `gguf.quants` only dequantizes to floats, and MLX quantizes floats in its own way,
so neither keeps a file's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..base.errors import ConvertError
from .gguf_read import TensorInfo, read_raw, row_chunks

GROUP = 32
QK_K = 256

# GGUF type -> (MLX bits, whether every weight is kept exactly)
KEPT = {
    "Q8_0": (8, True),
    "Q4_0": (4, True),
    "Q4_1": (4, True),
    "Q4_K": (4, True),
    "Q5_K": (5, True),
    "Q6_K": (8, False),
}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


@dataclass
class Kept:
    """Rows of one tensor in MLX's layout, and how far they are from the file's values."""

    weight: np.ndarray  # uint32 (rows, K * bits / 32)
    scales: np.ndarray  # float32 (rows, K / 32)
    biases: np.ndarray
    inexact: int = 0  # weights not equal to gguf's dequantization (Q6_K's rounded sub-blocks)
    worst: float = 0.0  # the largest |kept - file| in steps of the group's coarser sub-block


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Integers q (rows, K) of `bits` bits as MLX packs them: element i at bits [bits*i, ...) of
    each row's little-endian stream of uint32 words."""
    rows, k = q.shape
    if bits in (4, 8):
        per = 32 // bits
        shifted = q.reshape(rows, k // per, per).astype(np.uint32) << (
            np.arange(per, dtype=np.uint32) * bits
        )
        return np.bitwise_or.reduce(shifted, axis=-1)
    # 5 bits: 32 weights fill 5 words exactly; spread each value's bits, then gather them
    b = (q.astype(np.uint8)[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    stream = np.packbits(b.reshape(rows, -1), axis=-1, bitorder="little")
    return stream.view(np.uint32).reshape(rows, -1)


def _f16(a: np.ndarray) -> np.ndarray:
    return a.copy().view(np.float16)[..., 0].astype(np.float32)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's twelve bytes -> eight 6-bit sub-scales and eight mins (llama.cpp's
    get_scale_min_k4), for (..., 12) uint8."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _simple(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[..., :2])
    if kind == "Q8_0":
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d, d * -128
    head = 4 if kind == "Q4_1" else 2
    packed = blocks[..., head:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # low nibbles first
    bias = _f16(blocks[..., 2:4]) if kind == "Q4_1" else d * -8
    return q, d, bias


def _k4(blocks: np.ndarray, five: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = blocks.shape[:-1]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mn = _scale_min_k4(blocks[..., 4:16])
    scale = d[..., None] * sc.astype(np.float32)  # exact: 11 x 6 significant bits
    bias = -(dmin[..., None] * mn.astype(np.float32))
    if five:
        qh, qs = blocks[..., 16:48], blocks[..., 48:176]
    else:
        qh, qs = None, blocks[..., 16:144]
    # 32 bytes give groups 2j (low nibbles) and 2j + 1 (high nibbles)
    ql = qs.reshape(*n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    q = (ql & 0x0F).reshape(*n, 8, 32)
    if qh is not None:  # bit j of byte l is the fifth bit of group j's weight l
        high = (qh.reshape(*n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        q = q | (high << 4)
    return q.reshape(*n, 8 * 32), scale, bias


def _q6(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(t = q - 32 (..., 256), int8 scales (..., 16), d) of Q6_K blocks, as gguf reads them."""
    n = blocks.shape[:-1]
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc = blocks[..., 192:208].view(np.int8).astype(np.int32)
    d = _f16(blocks[..., 208:210])
    lo = (ql.reshape(*n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
    hi = (qh.reshape(*n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03
    q = lo.reshape(*n, 2, 4, 32) | (hi.reshape(*n, 2, 4, 32) << 4)
    return q.reshape(*n, QK_K).astype(np.int32) - 32, sc, d


def _q6_as_8bit(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    t, sc, d = _q6(blocks)
    n = blocks.shape[:-1]
    t = t.reshape(*n, 8, 2, 16)
    sc = sc.reshape(*n, 8, 2)
    big = np.where(np.abs(sc[..., 0]) >= np.abs(sc[..., 1]), 0, 1)  # (..., 8)
    sc_big = np.take_along_axis(sc, big[..., None], -1)[..., 0]
    den = np.where(sc_big == 0, 1, sc_big)[..., None, None]  # sc_big == 0: both sub-blocks are 0
    num = 4 * sc[..., None] * t  # (..., 8, 2, 16): the file's value / scale = num / den, exactly
    q = np.clip(np.rint(num / den), -128, 127)
    rest = num - q * den  # integers: zero where the weight is kept exactly
    inexact = int(np.count_nonzero(rest))
    worst = float(np.abs(rest / den).max(initial=0.0)) / 4  # in steps of the coarser sub-block
    scale = d[..., None] * (sc_big.astype(np.float32) / 4)  # exact: 11 x 7 bits, / 4
    q = (q + 128).astype(np.uint8).reshape(*n, QK_K)
    return q, scale, -128 * scale, inexact, worst


def keep_rows(raw: np.ndarray, kind: str) -> Kept:
    """Rows of raw blocks (2-D uint8) of type `kind` in MLX's affine layout, float32 scales."""
    rows = len(raw)
    per = BLOCK_BYTES[kind]
    blocks = raw.reshape(rows, -1, per)
    inexact, worst = 0, 0.0
    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        q, scale, bias = _simple(blocks, kind)
    elif kind in ("Q4_K", "Q5_K"):
        q, scale, bias = _k4(blocks, kind == "Q5_K")
    else:
        q, scale, bias, inexact, worst = _q6_as_8bit(blocks)
    bits = KEPT[kind][0]
    weight = pack(q.reshape(rows, -1), bits)
    return Kept(
        weight,
        np.ascontiguousarray(scale.reshape(rows, -1), np.float32),
        np.ascontiguousarray(bias.reshape(rows, -1), np.float32),
        inexact,
        worst,
    )


def dequantize(kept: Kept, bits: int) -> np.ndarray:
    """float32 weights of `kept` (numpy, for tests and the convert report): scale * q + bias."""
    rows = kept.weight.shape[0]
    if bits in (4, 8):
        per = 32 // bits
        q = (kept.weight[..., None] >> (np.arange(per, dtype=np.uint32) * bits)) & (2**bits - 1)
    else:
        stream = np.unpackbits(kept.weight.view(np.uint8), axis=-1, bitorder="little")
        q = (stream.reshape(rows, -1, bits) << np.arange(bits, dtype=np.uint8)).sum(-1)
    q = q.reshape(rows, -1, GROUP).astype(np.float32)
    return (q * kept.scales[..., None] + kept.biases[..., None]).reshape(rows, -1)


def keep_tensor(path: Path, info: TensorInfo) -> Kept:
    """The whole tensor kept, in row chunks (shape[:-1] + (words,) and (groups,)); a ConvertError
    naming it where a scale is not finite (damaged blocks: llama.cpp would compute NaN)."""
    raw = read_raw(path, info)
    raw = raw.reshape(-1, raw.shape[-1])
    step = row_chunks(info)
    parts = []
    with np.errstate(all="ignore"):
        for i in range(0, len(raw), step):
            part = keep_rows(raw[i : i + step], info.type_name)
            if not (np.isfinite(part.scales).all() and np.isfinite(part.biases).all()):
                raise ConvertError(
                    f"{path}: tensor '{info.name}' ({info.type_name}) has scales that are not "
                    "finite numbers (damaged blocks)"
                )
            parts.append(part)
    shape = info.shape[:-1]
    return Kept(
        *(
            np.concatenate(a).reshape(*shape, -1)
            for a in zip(*[(p.weight, p.scales, p.biases) for p in parts], strict=True)
        ),
        inexact=sum(p.inexact for p in parts),
        worst=max(p.worst for p in parts),
    )
