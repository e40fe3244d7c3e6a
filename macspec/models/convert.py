"""`macspec convert`: a Hugging Face repo, a local Hugging Face directory or a GGUF file -> an MLX
model in the store, optionally quantized by mlx-lm. Written atomically; never runs repo code."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ..base.errors import ConvertError, ModelError, OptionError
from ..base.logs import progress
from . import mtp as mtp_heads
from .source import check_safe, download, source_kind
from .store import INFO_FILE, staging, store_root, validate_name, weights_summary

Q_CHOICES = ("4", "8", "none", "keep")
MTP_CHOICES = ("auto", "require", "drop")  # keep MTP heads if present / must / never
DTYPES = ("float16", "bfloat16", "float32")
GROUP_SIZES = (32, 64, 128)

log = logging.getLogger("macspec.models")


def _say(msg: str) -> None:
    progress(log, msg)


def _default_name(kind: str, source: str, q: str, dtype: str | None) -> str:
    base = Path(source).stem if kind == "gguf" else Path(source.rstrip("/")).name
    base = re.sub(r"[^A-Za-z0-9._+-]", "-", base).lstrip(".-") or "model"
    suffix = {"4": "-4bit", "8": "-8bit"}.get(q, "")
    if q == "none" and dtype:
        suffix = {"float32": "-f32", "float16": "-f16", "bfloat16": "-bf16"}[dtype]
    return base[:110] + suffix


def _quant_predicate(model: Any, group_size: int, embed_8bit: bool):
    own = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: Any):
        if embed_8bit and path.endswith(("embed_tokens", "lm_head")):
            return {"group_size": group_size, "bits": 8, "mode": "affine"}
        return own(path, module) if own else True

    return predicate


def _transform(model: Any, config: dict, q: str, group_size: int, dtype: str, embed_8bit: bool):
    """Cast, dequantize or quantize the loaded model as asked; returns (model, config)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import dequantize_model, quantize_model

    target = getattr(mx, dtype)
    cast = getattr(model, "cast_predicate", lambda _: True)

    def set_dtype(k, v):
        if q == "keep" and k.endswith((".scales", ".biases")):  # as the source's blocks hold them
            return v
        if cast(k) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(target)
        return v

    # Cast first (quantization scales/biases included) so that dequantizing computes in `dtype`.
    model.update(tree_map_with_path(set_dtype, model.parameters()))
    if q != "keep" and ("quantization" in config or "quantization_config" in config):
        config.pop("quantization", None)
        config.pop("quantization_config", None)
        model = dequantize_model(model)
    config["torch_dtype"] = dtype
    if q in ("4", "8"):
        with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints its summary to stdout
            model, config = quantize_model(
                model,
                config,
                group_size,
                int(q),
                mode="affine",
                quant_predicate=_quant_predicate(model, group_size, embed_8bit),
            )
    return model, config


def _write(model: Any, tokenizer: Any, config: dict, src: Path, out: Path, info: dict) -> None:
    from mlx_lm.utils import save_config, save_model

    save_model(out, model, donate_model=True)
    save_config(config, config_path=out / "config.json")
    tokenizer.save_pretrained(str(out))
    if (src / "generation_config.json").is_file():
        shutil.copy(src / "generation_config.json", out)
    (out / INFO_FILE).write_text(json.dumps(info, indent=2))


def _from_gguf(src: Path, out: Path, q: str, dtype: str | None) -> list[str]:
    """Decode the GGUF into an intermediate directory (in the final dtype, so that nothing is
    held in float32 but one tensor) and say what -q keep could not keep. Kept blocks' scales are
    written in `dtype` too: float32 (the CPU's default) holds them exactly."""
    from .gguf import gguf_to_hf

    _say(f"reading {src}")
    scales = dtype or "float16"
    report = gguf_to_hf(src, out, dtype=dtype, keep=q == "keep", scales=scales)
    if q == "keep":
        for line in report.keep_summary().splitlines():
            _say(line)
    elif q in ("4", "8"):
        _say(f"-q {q} quantizes the file's values again (the default, -q keep, keeps its blocks)")
    return sorted(report.kept) if q == "keep" else []


def _measure(src: Path, tmp: Path, q: str) -> None:
    """What -q `q` cost, said and kept in the model's macspec.json."""
    from .fidelity import measure_requantized

    r = measure_requantized(src, tmp, tmp / ".fidelity-reference")
    _say(
        f"-q {q} moved the file's next-token distributions by a mean KL of {r.kl_mean:.4f} nats "
        f"(p99 {r.kl_p99:.4f}); top-1 agreement {r.top1_agreement:.3f}, over {r.positions} "
        f"positions of built-in text, against its blocks kept (the default, -q keep). On your "
        f"own text: `macspec eval NAME TEXT --reference {src}`"
    )
    info = json.loads((tmp / INFO_FILE).read_text())
    info["fidelity"] = {
        "reference": "the GGUF's blocks kept (-q keep)",
        "text": "built-in sample (models/fidelity-sample.txt)",
        "positions": r.positions,
        "kl_mean": round(r.kl_mean, 6),
        "kl_p99": round(r.kl_p99, 6),
        "top1_agreement": round(r.top1_agreement, 4),
    }
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))


def _backend_dtype(kind: str, src: Path) -> str | None:
    """Full precision on the CPU backend follows platform_info.choose_weight_format (float32: BLAS
    products; bfloat16 when float32 would not fit half of memory); elsewhere the source's."""
    from ..base.platform_info import choose_weight_format, detect_backend

    if detect_backend() != "cpu":
        return None
    if kind == "gguf":
        from .gguf_read import read_header

        count = sum(math.prod(t.shape) for t in read_header(src).tensors.values())
    else:
        count = weights_summary(src, {})[0]
    return choose_weight_format(count, backend="cpu").dtype


def _model_classes(layout: Any, config: dict):
    """mlx-lm's classes for `config`, with the checkpoint's MTP tensors removed before mlx-lm's
    own sanitize (which drops them for released checkpoints anyway; on other layer counts its
    rule can miss them, e.g. deepseek_v3 drops layer 61 by number)."""
    from mlx_lm.utils import _get_classes

    if layout is None:
        return _get_classes
    from .mtp_extract import owns

    layers = mtp_heads.text_config(config)["num_hidden_layers"]

    def get(config: dict):
        model_cls, args_cls = _get_classes(config)

        class WithoutMtp(model_cls):
            def sanitize(self, weights):
                weights = {k: v for k, v in weights.items() if not owns(layout, k, layers)}
                own = getattr(super(), "sanitize", None)
                return own(weights) if own else weights

        WithoutMtp.__name__ = WithoutMtp.__qualname__ = model_cls.__name__
        return WithoutMtp, args_cls

    return get


def _info(source: str, kind: str, opts: dict, mtp: str | None) -> dict:
    """What macspec.json records about a converted model."""
    q = opts["q"]
    return {
        "source": source,
        "kind": kind,
        "q": q,
        "group_size": opts["group_size"] if q in ("4", "8") else None,
        "dtype": opts["dtype"],
        "embed_8bit": opts["embed_8bit"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mtp": mtp,
    }


def _load_model(src: Path, config: dict) -> tuple[Any, dict]:
    """mlx-lm's lazy model of the checkpoint, its MTP tensors left to mtp_extract."""
    from mlx_lm.utils import load_model

    classes = _model_classes(mtp_heads.layout_for(config), config)
    try:
        return load_model(src, lazy=True, get_model_classes=classes)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        raise ConvertError(f"{src}: cannot load the weights ({e})") from e


def _is_draft(src: Path) -> bool:
    from .eagle3_export import is_draft

    return is_draft(src)


def _store_draft(src: Path, name: str, q: str, dtype: str | None, force: bool, shown: str):
    """An EAGLE-3 draft directory into the store (models/eagle3_export.store_draft)."""
    from .eagle3_export import store_draft

    if q in ("4", "8"):
        raise OptionError(f"{src} is an EAGLE-3 draft: macspec stores drafts unquantized")
    dest = store_draft(src, name, dtype, force, shown)
    _say(f"stored the EAGLE-3 draft {shown} -> {dest}")
    return dest


def _find_heads(src: Path, config: dict, model: Any, mode: str, shown: Any) -> Any:
    """The MTP heads (mtp_extract.Found) of the checkpoint in `src` (a GGUF's decoded directory
    too), or None, as `mode` asks; `shown` names the source in messages."""
    from .mtp_extract import Missing, find

    if mode == "drop":
        return None
    found = find(src, config, model)
    if isinstance(found, Missing):
        if mode == "require":
            raise ModelError(
                f"{shown}: the config declares {found.declared} MTP head(s) ({found.layout.name} "
                "layout) but no *.safetensors holds their weights (re-packaged checkpoints often "
                "drop them); convert the original checkpoint"
            )
        _say(f"{shown}: the config declares MTP heads but the weights hold none; not kept")
        return None
    if found is None and mode == "require":
        raise ModelError(
            f"{shown}: no MTP heads: architecture {config.get('model_type')!r} ships none or its "
            f"config declares 0 (macspec keeps those of {', '.join(_mtp_types())})"
        )
    return found


def _mtp_types() -> list[str]:
    return [t for layout in mtp_heads.LAYOUTS for t in layout.model_types]


def _heads(found: Any, model: Any, config: dict, opts: dict, source: str):
    """(MtpConfig, heads) to write beside the converted model, quantized as it is; `opts`: q,
    group_size, dtype, embed_8bit as convert was asked."""
    from .mtp_extract import build

    q, group = opts["q"], opts["group_size"]
    quant = {"group_size": group, "bits": int(q), "mode": "affine"} if q in ("4", "8") else None
    e8 = opts["embed_8bit"]
    return build(found, model, config, opts["dtype"], quant, embed_8bit=e8, source=source)


def convert(
    source: str,
    output: str | None = None,
    q: str | None = None,
    group_size: int = 64,
    dtype: str | None = None,
    force: bool = False,
    embed_8bit: bool = False,
    revision: str | None = None,
    mtp: str = "auto",
    measure: bool = True,
) -> Path:
    """Convert `source` into the store as `output` (default: derived from the source name).

    q: "4"/"8" quantize (affine, `group_size`); "none" keeps full precision (dequantizing a
    quantized source); "keep" keeps a source's quantization (a GGUF's blocks: gguf_blocks). The
    default: "keep" for a GGUF file, whose blocks are the model the user chose; else "none".
    dtype: float16 | bfloat16 | float32 for the unquantized tensors (default: on the CPU backend
    float32, MLX's fast type there; elsewhere the source's, else float16). embed_8bit: keep the
    embeddings and the output head at 8 bits when quantizing. measure: with -q 4|8 of a GGUF,
    score the result against the file's blocks kept (models/fidelity.py) and say the KL.
    Returns the new model's directory.
    """
    asked, q = q, _checked_options(q or "none", group_size, dtype, mtp)
    kind, src = source_kind(source)
    if asked is None and kind == "gguf":
        q = "keep"
    name = validate_name(output) if output else None  # a bad name fails before any download
    if name is not None and (store_root() / name).exists() and not force:
        raise ConvertError(f"{store_root() / name} already exists; pass --force to replace it")
    if kind == "hub":
        src = download(src, revision)  # into the Hugging Face cache, before touching the store
    if dtype is None and (q == "none" or (q == "keep" and kind == "gguf")):
        dtype = _backend_dtype(kind, src)
    name = name or _default_name(kind, source, q, dtype)
    dest = store_root() / name
    if dest.exists() and not force:
        raise ConvertError(f"{dest} already exists; pass --force to replace it")
    if kind != "gguf" and _is_draft(src):  # an EAGLE-3 draft: checked, stored as it is
        return _store_draft(src, name, q, dtype, force, str(source) if kind == "hub" else str(src))

    start = time.perf_counter()
    with staging(name, force=force) as tmp:
        opts = {"q": q, "group_size": group_size, "embed_8bit": embed_8bit, "mtp": mtp}
        _convert_into(tmp, kind, src, source, dtype, opts)
        if measure and kind == "gguf" and q in ("4", "8"):
            _measure(src, tmp, q)
    _say(f"converted {source} -> {dest} ({time.perf_counter() - start:.1f} s)")
    return dest


def _checked_options(q: str, group_size: int, dtype: str | None, mtp: str) -> str:
    """The quantization choice (without a "bit" suffix); OptionError for any option not offered."""
    q = str(q).lower().removesuffix("bit")
    if q not in Q_CHOICES:
        raise OptionError(f"-q must be one of {', '.join(Q_CHOICES)}, not {q!r}")
    if dtype is not None and dtype not in DTYPES:
        raise OptionError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if group_size not in GROUP_SIZES:
        raise OptionError(f"--group-size must be one of {GROUP_SIZES}, not {group_size}")
    if mtp not in MTP_CHOICES:
        raise OptionError(f"mtp must be one of {', '.join(MTP_CHOICES)}, not {mtp!r}")
    return q


def _convert_into(
    tmp: Path, kind: str, src: Path, source: str, dtype: str | None, opts: dict
) -> None:
    """Write the converted model (and its MTP heads, if kept) into the staging directory `tmp`.
    opts: q, group_size, embed_8bit, mtp."""
    from mlx_lm.utils import load_tokenizer

    q = opts["q"]
    if kind == "gguf":
        model_src = tmp / ".gguf-raw"  # intermediate mlx-lm layout, removed before publishing
        kept = _from_gguf(src, model_src, q, dtype)
    else:
        model_src, kept = src, []
    config = check_safe(model_src)
    chosen = dtype or config.get("torch_dtype") or config.get("dtype")
    opts = {**opts, "dtype": chosen if chosen in DTYPES else "float16"}
    shown = str(source) if kind == "hub" else str(src)
    model, config = _load_model(model_src, config)
    found = _find_heads(model_src, config, model, opts["mtp"], shown)
    try:
        tokenizer = load_tokenizer(model_src)
    except Exception as e:  # transformers raises many types for a missing/broken tokenizer
        raise ConvertError(f"{model_src}: no usable tokenizer ({e})") from e
    heads = found and _heads(found, model, config, opts, shown)
    model, config = _transform(
        model, config, q, opts["group_size"], opts["dtype"], opts["embed_8bit"]
    )
    info = _info(shown, kind, opts, heads[0].describe() if heads else None)
    if kept:
        info["kept"] = kept  # the GGUF block types held as they are in the file
    try:
        if heads:
            mtp_heads.write(tmp, *heads)  # beside the model, as models/mtp.py reads them
        _write(model, tokenizer, config, model_src, tmp, info)
    except (ValueError, RuntimeError, OSError) as e:
        raise ConvertError(f"{source}: writing the converted model failed ({e})") from e
    del model
    shutil.rmtree(tmp / ".gguf-raw", ignore_errors=True)


def _run(args: argparse.Namespace) -> int:
    kwargs = {k: v for k, v in vars(args).items() if k not in ("func", "command")}

    def on_term(signum, frame):  # SIGTERM cleans up like Ctrl-C: nothing half-written stays
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        path = convert(**kwargs)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(path)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "convert",
        help="fetch/convert a model into the local store",
        description="Convert a Hugging Face repo id, a local Hugging Face directory or a GGUF file "
        "into an MLX model in the store (see `macspec models`).",
    )
    p.add_argument("source", help="HF repo id (org/name), model directory, or .gguf file")
    p.add_argument("-o", "--output", metavar="NAME", help="store name (default: from the source)")
    p.add_argument(
        "-q",
        dest="q",
        default=None,
        choices=Q_CHOICES,
        help="quantize to 4 or 8 bits, 'none' for full precision, 'keep' a source's quantization "
        "(default: keep for a GGUF file, whose blocks stay as they are; else none)",
    )
    p.add_argument("--group-size", type=int, default=64, choices=GROUP_SIZES)
    p.add_argument("--dtype", choices=DTYPES, help="dtype of unquantized tensors")
    p.add_argument(
        "--embed-8bit",
        action="store_true",
        help="with -q 4: keep embeddings and the output head at 8 bits",
    )
    p.add_argument("--revision", help="HF branch, tag or commit")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--mtp",
        dest="mtp",
        action="store_const",
        const="require",
        default="auto",
        help="require the source's multi-token-prediction heads (kept by default when present)",
    )
    group.add_argument(
        "--no-mtp", dest="mtp", action="store_const", const="drop", help="do not keep MTP heads"
    )
    p.add_argument(
        "--no-measure",
        dest="measure",
        action="store_false",
        help="with -q 4|8 of a GGUF file: do not measure what requantizing cost (KL against the "
        "file's blocks kept, about a minute for 1.5B parameters)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing store entry")
    p.set_defaults(func=_run)
