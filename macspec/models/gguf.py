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

from ..base.errors import ConvertError
from ..base.logs import progress
from . import gguf_arch
from .gguf_blocks import KEPT, keep_tensor
from .gguf_read import (
    GGUFFile,
    TensorInfo,
    decode,
    dequantize,
    read_header,
    read_raw,
    readable_types,
    row_chunks,
)
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
    scales: str = "float32"  # what the kept blocks' scales and biases were written as
    weights: Counter = field(default_factory=Counter)  # GGUF type -> weights kept
    rounded: Counter = field(default_factory=Counter)  # GGUF type -> weights not kept exactly
    worst: dict[str, float] = field(default_factory=dict)  # GGUF type -> largest error, in steps
    scale_moved: float = 0.0  # largest relative change of a scale or bias by a 16-bit dtype

    def keep_summary(self) -> str:
        kept = ", ".join(
            f"{n} {t} as {KEPT[t][0]}-bit groups of 32" for t, n in sorted(self.kept.items())
        )
        lines = [f"-q keep: kept as MLX blocks: {kept or 'nothing'}"]
        exact = [t for t in sorted(self.kept) if not self.rounded[t]]
        if exact:
            lines.append(
                f"-q keep: {', '.join(exact)}: every weight exactly the file's"
                + (" in float32" if self.scales == "float32" else "")
            )
        for t in sorted(self.rounded):
            share = self.rounded[t] / max(self.weights[t], 1)
            lines.append(
                f"-q keep: {t} has 16-weight sub-blocks, which no MLX group holds: "
                f"{share:.0%} of its weights rounded to the 8-bit grid, at most "
                f"{self.worst[t]:.2f} of their group's coarser step (`macspec eval` measures "
                "the KL)"
            )
        if self.kept and self.scales != "float32":
            lines.append(
                f"-q keep: scales and biases stored as {self.scales}, rounded by up to "
                f"{self.scale_moved:.1e} of their value (--dtype float32 keeps them exactly)"
            )
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


def _moved(a: np.ndarray, dtype: str) -> float:
    """Largest |a - a in dtype| / |a| over a's nonzero entries."""
    b = np.array(mx.array(a).astype(_DTYPES[dtype]).astype(mx.float32))
    nz = a != 0
    return float((np.abs(b - a)[nz] / np.abs(a[nz])).max(initial=0.0))


def _keep(gf: GGUFFile, info: TensorInfo, target: gguf_arch.Target, writer, report: Report):
    kept = keep_tensor(gf.path, info)
    arrays = [kept.weight, kept.scales, kept.biases]
    if target.qk_heads:
        arrays = [gguf_arch.unpermute(a, target.qk_heads) for a in arrays]
    weight, scales, biases = arrays
    module = target.name.removesuffix(".weight")
    writer.add(target.name, mx.array(weight))
    for name, a in (("scales", scales), ("biases", biases)):
        if report.scales != "float32":
            report.scale_moved = max(report.scale_moved, _moved(a, report.scales))
        writer.add(f"{module}.{name}", mx.array(a).astype(_DTYPES[report.scales]))
    kind = info.type_name
    report.kept[kind] += 1
    report.weights[kind] += int(np.prod(info.shape))
    if kept.inexact:
        report.rounded[kind] += kept.inexact
        report.worst[kind] = max(report.worst.get(kind, 0.0), kept.worst)


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
        if keep and kind in KEPT and target.quantizable and info.shape == target.shape:
            _keep(gf, info, target, writer, report)
            layers[module] = {"group_size": GGUF_GROUP_SIZE, "bits": KEPT[kind][0]}
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


def gguf_to_hf(
    path: Path, out_dir: Path, dtype: str | None = None, keep: bool = False, scales: str = "float32"
) -> Report:
    """Write `path` as an mlx-lm model directory into `out_dir`; `keep` keeps the blocks MLX can
    hold (gguf_blocks: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K exactly, Q6_K at 8 bits) as MLX affine groups
    of 32 with `scales`-typed scales, everything else is decoded to `dtype` (default: the
    architecture's usual checkpoint dtype)."""
    gf, config, spec, targets = prepare(path)
    tok, tok_config, stops = build_tokenizer(gf.metadata, path, spec.family)
    dtype = dtype or spec.dtype
    report = Report(config=config, dtype=dtype, scales=scales)
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
