"""A bounded GGUF reader: the header is parsed and checked here, tensor data is dequantized by the
`gguf` package (llama.cpp's own numpy code for every block type).

Why not `gguf.GGUFReader` for the header: it trusts the counts it reads (a count of 2^40 becomes a
huge allocation, an offset past the end a raw ValueError/OSError) and builds one numpy view per
string, 8 s for Gemma 3's 262k-token vocabulary on the development machine; this parser checks
every count, length and offset against the file size first and reads the same header in ~0.4 s.

Dequantization speed of `gguf.quants.dequantize` on this machine (x86_64, 2 cores, numpy 2.4,
gguf 0.19, real tensors of the Gemma 3 270M Q4_K_M file, float32 out): Q8_0 105 M weights/s
(the 168M-weight embedding, 1.6 s), Q5_0 235 M/s, Q4_K 307 M/s, Q6_K 469 M/s; a 7B Q4_K_M file
dequantizes in well under a minute, so one maintained implementation beats per-type code of ours.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..base.errors import ConvertError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 (2023) used 32-bit counts; llama.cpp itself no longer reads it
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40  # no real tensor comes near; a larger product is corruption
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 2

# Value types (GGUFValueType): struct format of the fixed-size ones; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1"}
_NUMPY.update({10: "<u8", 11: "<i8", 12: "<f8"})
STRING, ARRAY = 8, 9


def _gguf():
    """The `gguf` package, or a ConvertError saying how to get it."""
    try:
        import gguf
    except ImportError as e:  # a declared dependency; only a broken install lacks it
        raise ConvertError(f"reading GGUF files needs the 'gguf' package ({e})") from e
    return gguf


def type_name(type_id: int) -> str:
    try:
        return _gguf().GGMLQuantizationType(type_id).name
    except ValueError:
        return f"unknown type {type_id}"


# Types llama.cpp writes for weights and `gguf.quants.dequantize` reads (Q8_1/Q8_K are only
# in-memory dot-product formats; I8..F64 are not weight types).
_READABLE = (
    "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ1_S IQ1_M IQ2_XXS IQ2_XS "
    "IQ2_S IQ3_XXS IQ3_S IQ4_NL IQ4_XS TQ1_0 TQ2_0 MXFP4"
).split()


def readable_types() -> list[str]:
    gguf = _gguf()
    return [n for n in _READABLE if hasattr(gguf.GGMLQuantizationType, n)]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists dimensions innermost first)
    type_id: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)


@dataclass
class GGUFFile:
    path: Path
    version: int
    size: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


class _Cursor:
    """Reads little-endian values from the header, never past the end of the file."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.pos, self.path, self.end = buf, 0, path, len(buf)

    def fail(self, what: str) -> ConvertError:
        return ConvertError(f"{self.path}: corrupt or truncated GGUF file ({what})")

    def take(self, n: int, what: str) -> int:
        if n < 0 or n > self.end - self.pos:
            raise self.fail(f"{what} runs past the end of the file at byte {self.pos}")
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        start = self.take(struct.calcsize("<" + fmt), what)
        value = struct.unpack_from("<" + fmt, self.buf, start)
        return value[0] if len(value) == 1 else value

    def string(self, what: str) -> str:
        n = self.unpack("Q", what)
        start = self.take(n, what)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8") from e

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind in _SCALARS:
            v = self.unpack(_SCALARS[kind], what)
            return bool(v) if kind == 7 else v
        if kind == STRING:
            return self.string(what)
        if kind != ARRAY:
            raise self.fail(f"{what} has unknown value type {kind}")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays too deeply")
        inner, count = self.unpack("IQ", what)
        if inner in _NUMPY:
            size = np.dtype(_NUMPY[inner]).itemsize
            if count > (self.end - self.pos) // size:
                raise self.fail(f"{what} claims {count} items, more than the file holds")
            start = self.take(count * size, what)
            items = np.frombuffer(self.buf, _NUMPY[inner], count, start)
            return [bool(x) for x in items] if inner == 7 else items.tolist()
        # a string takes at least its 8-byte length; a nested array at least 12 bytes
        least = 8 if inner == STRING else 12
        if count > (self.end - self.pos) // least:
            raise self.fail(f"{what} claims {count} items, more than the file holds")
        return [self.value(inner, what, depth + 1) for _ in range(count)]


def _check_version(version: int, path: Path) -> None:
    if version in VERSIONS:
        return
    if version == 1:
        raise ConvertError(f"{path}: GGUF version 1 (2023) is not supported; get a newer file")
    if (version & 0xFFFF) == 0 and struct.unpack("<I", struct.pack(">I", version))[0] in VERSIONS:
        raise ConvertError(f"{path}: big-endian GGUF files are not supported")
    raise ConvertError(
        f"{path}: unknown GGUF version {version} (this converter reads versions 2 and 3)"
    )


def read_header(path: Path) -> GGUFFile:
    """Metadata and tensor table of a GGUF file, every count and offset checked against its size;
    any damage is a ConvertError naming the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size < 24:
            raise ConvertError(f"{path}: too short for a GGUF file ({size} bytes)")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path, size)
    except (OSError, ValueError) as e:  # unreadable, or mmap refused
        raise ConvertError(f"{path}: cannot read the GGUF file ({e})") from e


def _parse(buf: mmap.mmap, path: Path, size: int) -> GGUFFile:
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != MAGIC:
        raise ConvertError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    cur.pos = 4
    version = cur.unpack("I", "version")
    _check_version(version, path)
    n_tensors, n_kv = cur.unpack("QQ", "counts")
    # a key-value pair takes at least 8 + 1 + 4 + 1 bytes, a tensor entry at least 8 + 4 + 8 + 4 + 8
    if n_kv > size // 14 or n_tensors > size // 32:
        raise cur.fail(f"header claims {n_tensors} tensors and {n_kv} metadata keys")
    out = GGUFFile(path, version, size)
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in out.metadata:
            raise cur.fail(f"metadata key '{key}' appears twice")
        out.metadata[key] = cur.value(cur.unpack("I", f"type of '{key}'"), f"metadata '{key}'")
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}")
        n_dims = cur.unpack("I", f"tensor '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor '{name}' has {n_dims} dimensions")
        dims = cur.unpack("Q" * n_dims, f"tensor '{name}'")
        dims = (dims,) if n_dims == 1 else tuple(dims)
        type_id, offset = cur.unpack("IQ", f"tensor '{name}'")
        infos.append((name, dims, type_id, offset))
    alignment = out.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment is {alignment!r}, not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    for name, dims, type_id, offset in infos:
        if name in out.tensors:
            raise cur.fail(f"tensor '{name}' appears twice")
        where = (offset, data_start, alignment, size)
        out.tensors[name] = _tensor_info(path, name, dims, type_id, where)
    return out


def _tensor_info(path: Path, name: str, dims: tuple, type_id: int, where: tuple) -> TensorInfo:
    gguf = _gguf()
    bad = f"{path}: corrupt GGUF file: tensor '{name}'"
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ConvertError(f"{bad} has unknown type id {type_id}") from None
    count = 1
    for d in dims:
        count *= d
    if min(dims) < 1 or count > MAX_ELEMENTS:
        raise ConvertError(f"{bad} has an absurd shape {list(dims)}")
    if dims[0] % block:
        raise ConvertError(f"{bad}: {dims[0]} columns is not a multiple of {qtype.name} blocks")
    offset, data_start, alignment, size = where
    nbytes = count // block * block_bytes
    start = data_start + offset
    if offset % alignment or start + nbytes > size:
        raise ConvertError(
            f"{bad} lies at bytes {start}..{start + nbytes}, past the end of the file ({size} "
            "bytes): the file is truncated or damaged"
        )
    return TensorInfo(name, tuple(reversed(dims)), type_id, start, nbytes)


def read_raw(path: Path, info: TensorInfo) -> np.ndarray:
    """The tensor's bytes as uint8 rows (shape[:-1] + (bytes per row,)), read into memory (not
    memory-mapped, so the pages of a tensor are freed with it)."""
    raw = np.empty(info.nbytes, np.uint8)
    try:
        with open(path, "rb") as f:
            f.seek(info.offset)
            got = f.readinto(memoryview(raw))
    except OSError as e:
        raise ConvertError(f"{path}: cannot read tensor '{info.name}' ({e})") from e
    if got != info.nbytes:
        raise ConvertError(f"{path}: tensor '{info.name}' is cut short (the file changed?)")
    return raw.reshape(*info.shape[:-1], -1)


CHUNK = 1 << 22  # weights decoded at once: bounds the decoder's float32 temporaries (~100 MB)


def row_chunks(info: TensorInfo) -> int:
    """Rows per chunk when a tensor is decoded piecewise (blocks never cross rows)."""
    return max(1, CHUNK // info.shape[-1])


def _readable(path: Path, info: TensorInfo):
    gguf = _gguf()
    if info.type_name not in readable_types():
        raise ConvertError(
            f"{path}: tensor '{info.name}' is stored as {info.type_name}, which no GGUF reader "
            f"decodes; readable types: {', '.join(readable_types())}"
        )
    return gguf.GGMLQuantizationType(info.type_id)


def decode(path: Path, info: TensorInfo, raw: np.ndarray) -> np.ndarray:
    """Rows of raw blocks (2-D uint8) as float32, by the gguf package's reference numpy code."""
    qtype = _readable(path, info)
    try:
        with np.errstate(all="ignore"):  # damaged scales decode to inf/nan, as in llama.cpp
            out = _gguf().quants.dequantize(raw, qtype)
    except (ValueError, NotImplementedError, IndexError) as e:
        raise ConvertError(f"{path}: cannot decode tensor '{info.name}' ({e})") from e
    return np.ascontiguousarray(out, dtype=np.float32)


def dequantize(path: Path, info: TensorInfo) -> np.ndarray:
    """The whole tensor as float32."""
    _readable(path, info)
    raw = read_raw(path, info)
    return decode(path, info, raw.reshape(-1, raw.shape[-1])).reshape(info.shape)
