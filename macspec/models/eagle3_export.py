"""Writing an EAGLE-3 draft (models/eagle3.py's internal layout) in a published format, so that a
draft made or converted here runs in vLLM, SGLang or the EAGLE authors' code, and back.

Each format can express only what its reference code runs: a flag the format lacks (e.g.
norm_before_residual in the EAGLE authors' layout) is refused rather than dropped, since the
draft would then compute something else there. Written atomically: a temporary directory is
renamed into place once complete.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..base.errors import ModelError
from .eagle3 import FORMATS, SPECFORGE_ARCH, Eagle3Checkpoint, Eagle3Config, source_name

# Flags each format's reference code implements (vLLM llama_eagle3.py / speculators config,
# SpecForge llama3_eagle.py, EAGLE cnets.py); layouts.md cites them.
SUPPORTED = {
    "eagle": set(),
    "specforge": {"fc_norm", "logits_norm_off", "fc_bias", "aux_layer_ids", "tied"},
    "speculators": {
        "norm_before_residual",
        "fc_norm",
        "norm_before_fc",
        "recycle_normed",
        "aux_layer_ids",
        "layers",
    },
}


def _features(c: Eagle3Config) -> dict[str, bool]:
    """Which non-default behaviours a draft uses (each must be expressible in the target format)."""
    return {
        "norm_before_residual": c.norm_before_residual,
        "fc_norm": c.fc_norm,
        "norm_before_fc": c.norm_before_fc,
        "recycle_normed": c.recycle_normed,
        "logits_norm_off": not c.logits_norm,
        "fc_bias": c.fc_bias,
        "aux_layer_ids": bool(c.aux_layer_ids),
        "layers": c.num_layers > 1,
        "tied": c.tie_word_embeddings,
    }


def _layer_config(c: Eagle3Config, dtype: str) -> dict:
    cfg = {
        "model_type": c.layer_type,
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_layers,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": json.loads(c.rope_scaling) if c.rope_scaling else None,
        "max_position_embeddings": c.max_position_embeddings,
        "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias,
        "vocab_size": c.target_vocab_size,
        "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": dtype,
    }
    return cfg


def config_json(c: Eagle3Config, fmt: str, dtype: str) -> dict:
    """config.json of the draft in format `fmt` (schemas as each reference reads them)."""
    layer = _layer_config(c, dtype)
    extra = (
        {"target_hidden_size": c.target_hidden_size}
        if c.target_hidden_size != c.hidden_size
        else {}
    )
    if fmt == "eagle":
        return {**layer, "draft_vocab_size": c.draft_vocab_size, **extra}
    if fmt == "specforge":
        out = {**layer, "architectures": [SPECFORGE_ARCH], "draft_vocab_size": c.draft_vocab_size}
        out.update(extra, fc_norm=c.fc_norm, norm_output=c.logits_norm, bias=c.fc_bias)
        if c.aux_layer_ids:
            out["eagle_aux_hidden_state_layer_ids"] = list(c.aux_layer_ids)
        return out
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": c.target_name,
                "architectures": list(c.target_architectures),
            },
        },
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.recycle_normed,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids) or None,
    }


def export(
    ckpt: Eagle3Checkpoint,
    out: str | Path,
    fmt: str,
    *,
    dtype: str = "float16",
    target_name: str | None = None,
    target_architectures: tuple[str, ...] = (),
    force: bool = False,
) -> Path:
    """Write `ckpt` into directory `out` in format `fmt`; refuses what the format cannot hold."""
    c = ckpt.config
    if target_name or target_architectures:
        c = replace(
            c,
            target_name=target_name or c.target_name,
            target_architectures=tuple(target_architectures) or c.target_architectures,
        )
    ckpt = replace(ckpt, config=c)
    check_format(c, fmt)
    out = Path(out)
    if out.exists() and not force:
        raise ModelError(f"{out} already exists; pass force=True to replace it")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        write_into(ckpt, tmp, fmt, dtype)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_format(c: Eagle3Config, fmt: str) -> None:
    """Refuse a format that cannot express what the draft does."""
    if fmt not in FORMATS:
        raise ModelError(f"unknown EAGLE-3 format {fmt!r}: choose one of {', '.join(FORMATS)}")
    lacking = [k for k, used in _features(c).items() if used and k not in SUPPORTED[fmt]]
    if lacking:
        raise ModelError(
            f"the {fmt} format cannot hold a draft with {', '.join(lacking)} (its reference code "
            f"would run another draft); choose another format"
        )


def write_into(ckpt: Eagle3Checkpoint, directory: Path, fmt: str, dtype: str) -> None:
    """model.safetensors + config.json of `ckpt` in format `fmt` into an existing directory
    (check_format first; the caller makes the write atomic)."""
    arrays = _arrays(ckpt, ckpt.config, fmt, dtype)
    mx.save_safetensors(str(directory / "model.safetensors"), arrays, metadata={"format": "pt"})
    config = config_json(ckpt.config, fmt, dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=1))


def _arrays(ckpt: Eagle3Checkpoint, c: Eagle3Config, fmt: str, dtype: str) -> dict:
    target = getattr(mx, dtype)
    arrays = {
        source_name(fmt, k): v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in ckpt.weights.items()
    }
    if c.draft_vocab_size != c.target_vocab_size:
        ids = np.asarray(ckpt.d2t, dtype=np.int64)
        arrays["d2t"] = mx.array(ids - np.arange(ids.size, dtype=np.int64))
        mask = np.zeros(c.target_vocab_size, dtype=bool)
        mask[ids] = True
        arrays["t2d"] = mx.array(mask)
    return arrays


def is_draft(path: Path) -> bool:
    """Whether a directory holds an EAGLE-3 draft in one of FORMATS (by its config.json)."""
    from .eagle3 import detect

    try:
        detect(path)
    except ModelError:
        return False
    return True


def store_draft(src: Path, name: str, dtype: str | None, force: bool, source: str) -> Path:
    """`macspec convert` of an EAGLE-3 draft: checked by eagle3.load, written into the store in
    its own format (in `dtype`, default the checkpoint's), atomically like a model."""
    import time

    from .eagle3 import load
    from .store import INFO_FILE, staging, store_root

    ckpt = load(src)
    fmt = ckpt.config.format
    check_format(ckpt.config, fmt)
    stored = str(ckpt.weights["fc.weight"].dtype).removeprefix("mlx.core.")
    chosen = dtype or (stored if stored in ("float16", "bfloat16", "float32") else "float16")
    with staging(name, force=force) as tmp:
        write_into(ckpt, tmp, fmt, chosen)
        info = {
            "source": source,
            "kind": "eagle3",
            "format": fmt,
            "dtype": chosen,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))
    return store_root() / name
