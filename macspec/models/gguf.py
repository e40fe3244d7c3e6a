"""GGUF -> an mlx-lm model directory: weights decoded tensor by tensor (by the `gguf` package) and
renamed to mlx-lm's parameters with llama.cpp's converter transforms undone (gguf_arch), a
config.json, and a tokenizer rebuilt from the metadata (gguf_tokenizer).

Memory: one tensor is decoded at a time (large ones in row chunks) and the output goes out in
shards of SHARD_BYTES, so the peak is about one shard plus twice the largest tensor in the output
dtype, never the whole model in float32.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ConvertError
from ..logs import progress
from . import gguf_arch
from .gguf_read import (
    KEEP_BITS,
    GGUFFile,
    TensorInfo,
    decode,
    dequantize,
    read_header,
    read_raw,
    readable_types,
    row_chunks,
)
from .gguf_read import to_affine as _to_affine
from .gguf_tokenizer import build_tokenizer

log = logging.getLogger("macspec.models")

GGUF_GROUP_SIZE = 32  # every GGUF block format that MLX keeps packed uses 32 weights per block
SHARD_BYTES = 1 << 30
PROGRESS_EVERY = 3.0  # seconds between progress lines (a quicker conversion prints none)
_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def is_gguf(path: Path) -> bool:
    """True when `path` is a file starting with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


@dataclass
class Report:
    """What a conversion did, for the user: tensors kept as blocks and tensors it had to decode."""

    kept: Counter = field(default_factory=Counter)  # GGUF type -> tensors kept packed
    decoded: dict[str, list[str]] = field(default_factory=dict)  # GGUF type -> tensor names
    config: dict = field(default_factory=dict)
    dtype: str = "float16"  # what the decoded tensors were written as

    def keep_summary(self) -> str:
        kept = ", ".join(f"{n} {t}" for t, n in sorted(self.kept.items()))
        lines = [f"-q keep: kept as MLX blocks: {kept or 'nothing'}"]
        for t, names in sorted(self.decoded.items()):
            if t in ("F32", "F16", "BF16"):
                continue
            lines.append(
                f"-q keep: {len(names)} {t} tensors have no MLX block format, decoded to "
                f"{self.dtype}: {_collapse(names)}"
            )
        return "\n".join(lines)


def _collapse(names: list[str]) -> str:
    """blk.0.attn_q.weight, blk.1.attn_q.weight -> blk.*.attn_q.weight (2)"""
    groups: Counter = Counter()
    for n in names:
        parts = n.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
            parts[1] = "*"
        groups[".".join(parts)] += 1
    return ", ".join(f"{g} ({c})" if c > 1 else g for g, c in groups.items())


class _Progress:
    """Tensors done / total and an ETA as progress notes, at most every few seconds."""

    def __init__(self, total_bytes: int, count: int):
        self.total, self.count, self.every = max(total_bytes, 1), count, PROGRESS_EVERY
        self.done = self.n = 0
        self.start = self.last = time.perf_counter()

    def step(self, nbytes: int) -> None:
        self.done += nbytes
        self.n += 1
        now = time.perf_counter()
        if now - self.last < self.every and self.n < self.count:
            return
        if now - self.start < self.every:  # a quick conversion prints nothing
            return
        self.last = now
        spent = now - self.start
        eta = spent * (self.total - self.done) / max(self.done, 1)
        progress(
            log,
            f"tensors {self.n}/{self.count} ({100 * self.done // self.total}% of the data), "
            f"{spent:.0f} s, about {eta:.0f} s left",
        )


class _ShardWriter:
    """Collects arrays and writes them as model-NNNNN.safetensors once SHARD_BYTES are held."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.held, self.size, self.files = out_dir, {}, 0, []

    def add(self, name: str, array: mx.array) -> None:
        mx.eval(array)
        self.held[name] = array
        self.size += array.nbytes
        if self.size >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.held:
            return
        path = self.out_dir / f"model-{len(self.files) + 1:05d}.safetensors"
        mx.save_safetensors(str(path), self.held, metadata={"format": "mlx"})
        self.files.append(path)
        self.held, self.size = {}, 0
        mx.clear_cache()  # MLX keeps freed buffers for reuse; give them back between shards


def _check_types(gf: GGUFFile) -> None:
    readable = readable_types()
    for info in gf.tensors.values():
        if info.type_name not in readable:
            raise ConvertError(
                f"{gf.path}: tensor '{info.name}' is stored as {info.type_name}, which no GGUF "
                f"reader decodes; readable: {', '.join(readable)}"
            )


def _decode(path: Path, info: TensorInfo, target: gguf_arch.Target, dtype: str) -> mx.array:
    """One tensor in `dtype`, decoded in row chunks so that the decoder's float32 temporaries stay
    small (a 262k-row embedding would otherwise need several copies of itself in float32)."""
    if target.qk_heads or target.shift:  # the small attention/norm tensors: whole
        values = gguf_arch.transform(dequantize(path, info), target)
        return mx.array(values).astype(_DTYPES[dtype])
    raw = read_raw(path, info)
    raw = raw.reshape(-1, raw.shape[-1])
    step = row_chunks(info)
    parts = []
    for i in range(0, len(raw), step):
        part = mx.array(decode(path, info, raw[i : i + step])).astype(_DTYPES[dtype])
        mx.eval(part)
        parts.append(part)
    del raw
    out = mx.concatenate(parts).reshape(target.shape) if len(parts) > 1 else parts[0]
    mx.eval(out)
    return out.reshape(target.shape)


def _write_weights(
    gf: GGUFFile, targets: dict, out_dir: Path, dtype: str, keep: bool, report: Report
) -> dict:
    """Decode (or repack) each tensor into shards; returns the per-layer quantization config."""
    writer = _ShardWriter(out_dir)
    progress = _Progress(sum(gf.tensors[n].nbytes for n in targets), len(targets))
    layers: dict[str, dict] = {}
    for gname, target in targets.items():
        info: TensorInfo = gf.tensors[gname]
        kind = info.type_name
        module = target.name.removesuffix(".weight")
        if keep and kind in KEEP_BITS and target.quantizable and info.shape == target.shape:
            weight, scales, biases = _to_affine(gf.path, info)
            if target.qk_heads:
                weight, scales, biases = (
                    gguf_arch.unpermute(a, target.qk_heads) for a in (weight, scales, biases)
                )
            writer.add(target.name, mx.array(weight))
            writer.add(f"{module}.scales", mx.array(scales))
            writer.add(f"{module}.biases", mx.array(biases))
            layers[module] = {"group_size": GGUF_GROUP_SIZE, "bits": KEEP_BITS[kind]}
            report.kept[kind] += 1
        else:
            writer.add(target.name, _decode(gf.path, info, target, dtype))
            report.decoded.setdefault(kind, []).append(gname)
        progress.step(info.nbytes)
    writer.flush()
    if not layers:
        return {}
    bits = [q["bits"] for q in layers.values()]
    common = max(set(bits), key=bits.count)
    quant = {"group_size": GGUF_GROUP_SIZE, "bits": common, "mode": "affine"}
    quant.update({m: {**q, "mode": "affine"} for m, q in layers.items() if q["bits"] != common})
    return quant


def prepare(path: Path) -> tuple[GGUFFile, dict, gguf_arch.Arch, dict]:
    """Header, config, spec and tensor plan, all checked before any weight is decoded."""
    if not path.is_file():
        raise ConvertError(f"{path}: no such GGUF file")
    gf = read_header(path)
    gguf_arch.select(gf.metadata, path)  # an unsupported architecture is refused first
    _check_types(gf)

    def read(name: str) -> np.ndarray:
        return dequantize(path, gf.tensors[name])

    config, spec = gguf_arch.model_config(gf.metadata, gf.tensors, path, read)
    arch = gf.metadata["general.architecture"]
    targets = gguf_arch.plan(config, spec, arch, gf.tensors, path)
    return gf, config, spec, targets


def gguf_to_hf(path: Path, out_dir: Path, dtype: str | None = None, keep: bool = False) -> Report:
    """Write `path` as an mlx-lm model directory into `out_dir`; `keep` keeps Q8_0/Q4_0/Q4_1
    blocks packed (MLX affine, group size 32), everything else is decoded to `dtype` (default:
    the architecture's usual checkpoint dtype)."""
    gf, config, spec, targets = prepare(path)
    tok, tok_config, stops = build_tokenizer(gf.metadata, path, spec.family)
    dtype = dtype or spec.dtype
    report = Report(config=config, dtype=dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    quant = _write_weights(gf, targets, out_dir, dtype, keep, report)
    if quant:
        config["quantization"] = quant
        config["quantization_config"] = quant
    if stops:
        config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    config["torch_dtype"] = dtype
    tok_config["model_max_length"] = config["max_position_embeddings"]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return report
