"""GGUF architectures -> mlx-lm model configs and weight names, one small spec per architecture.

Tensor names come from the gguf package's own maps (`gguf.get_tensor_name_map`, which knows the
Hugging Face names llama.cpp's converter reads); each spec only says what llama.cpp's converter
(convert_hf_to_gguf.py) did to the weights and what its runtime assumes that the file leaves out,
so that the mapping can be inverted exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..base.errors import ConvertError
from . import gguf_mtp
from .gguf_read import _gguf

Reader = Callable[[str], np.ndarray]  # GGUF tensor name -> float32 values


@dataclass(frozen=True)
class Arch:
    model_type: str  # the mlx-lm module that runs it
    extra: Callable[[Meta, dict], dict] | None = None  # config beyond the common keys
    permute_qk: bool = False  # convert_hf_to_gguf's LlamaModel.permute was applied to Q/K rows
    norm_shift: float = 0.0  # the converter stored every "*norm.weight" plus this (Gemma: +1)
    rope_scaling: tuple[str, ...] = ()  # rope scalings the mlx-lm class applies
    partial_rotary: bool = False  # the mlx-lm class rotates fewer dimensions than head_dim
    family: str = ""  # "gemma": chat template fallback and SentencePiece details
    dtype: str = "float16"  # the dtype its Hugging Face checkpoints are published in


class Meta:
    """Typed access to `<arch>.<key>` metadata; a missing or mistyped key is a ConvertError."""

    def __init__(self, meta: dict, arch: str, path: Path):
        self.meta, self.arch, self.path = meta, arch, path

    def get(self, key: str, default: Any = ..., kind: type | tuple = (int, float)) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.meta:
            if default is ...:
                raise ConvertError(f"{self.path}: GGUF metadata lacks '{full}'")
            return default
        value = self.meta[full]
        if isinstance(value, list) and value and len(set(value)) == 1:
            value = value[0]  # a per-layer list with one value throughout
        ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _kinds(kind))
        if not ok or (isinstance(value, int | float) and not math.isfinite(value)):
            raise ConvertError(f"{self.path}: GGUF metadata '{full}' = {value!r} is not usable")
        return value

    def int(self, key: str, default: Any = ...) -> int:
        value = self.get(key, default, int)
        if value is not None and value < 0:
            raise ConvertError(f"{self.path}: GGUF metadata '{self.arch}.{key}' is negative")
        return value

    def float(self, key: str, default: Any = ...) -> float:
        value = self.get(key, default)
        return None if value is None else float(value)


def _kinds(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


# ------------------------------------------------------------------ per-architecture extras


def _attention_scalar(m: Meta, c: dict, big_layers: int) -> float:
    """llama.cpp's Gemma 2/3 rule (the file does not store query_pre_attn_scalar): the 27B models
    scale by hidden/heads, all others by head_dim."""
    if c["num_hidden_layers"] == big_layers:
        return c["hidden_size"] // c["num_attention_heads"]
    return c["head_dim"]


def _llama(m: Meta, c: dict) -> dict:
    return {"attention_bias": "blk.0.attn_q.bias" in c["_tensors"], "mlp_bias": False}


def _experts(m: Meta, c: dict) -> dict:
    count, used = m.int("expert_count"), m.int("expert_used_count")
    if not 0 < used <= count <= 4096:
        raise ConvertError(f"{m.path}: implausible expert counts ({used} used of {count})")
    return {
        "num_experts": count,
        "num_local_experts": count,
        "num_experts_per_tok": used,
        "moe_intermediate_size": m.int("expert_feed_forward_length", c["intermediate_size"]),
    }


def _qwen2moe(m: Meta, c: dict) -> dict:
    shared = m.int("expert_shared_feed_forward_length")
    return {**_experts(m, c), "shared_expert_intermediate_size": shared}


def _qwen3moe(m: Meta, c: dict) -> dict:
    # llama.cpp runs every layer as MoE and normalizes the top-k weights (norm_w = true)
    extra = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    return {**_experts(m, c), **extra}


def _gemma2(m: Meta, c: dict) -> dict:
    return {
        "attn_logit_softcapping": m.float("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": m.float("final_logit_softcapping", 30.0),
        "query_pre_attn_scalar": _attention_scalar(m, c, 46),
    }


def _gemma3(m: Meta, c: dict) -> dict:
    if m.float("final_logit_softcapping", 0.0):
        raise ConvertError(f"{m.path}: Gemma 3 with final logit soft-capping: mlx-lm lacks it")
    window = m.int("attention.sliding_window", 0)
    pattern = m.meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per-layer flags; mlx-lm knows "every n-th layer is global"
        n = pattern.index(False) + 1 if False in pattern else 0
        want = [(i + 1) % n != 0 for i in range(len(pattern))] if n else []
        if not n or pattern != want:
            raise ConvertError(f"{m.path}: sliding-window layer pattern {pattern} is not periodic")
        pattern = n
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise ConvertError(f"{m.path}: gemma3.attention.sliding_window_pattern = {pattern!r}")
    return {
        "sliding_window": window or c["max_position_embeddings"],
        "sliding_window_pattern": pattern if window else 1,  # no window: every layer is global
        "rope_local_base_freq": m.float("rope.freq_base_swa", 10000.0),  # llama.cpp's default
        "query_pre_attn_scalar": _attention_scalar(m, c, 62),
    }


def _phi3(m: Meta, c: dict) -> dict:
    original = m.int("rope.scaling.original_context_length", 0) or c["max_position_embeddings"]
    scale = c["max_position_embeddings"] / original
    # convert_hf_to_gguf stores longrope's attention factor; another value means Phi-3's YaRN
    # variant, which mlx-lm's phi3 does not implement
    want = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    if abs(m.float("rope.scaling.attn_factor", want) - want) > 1e-4:
        raise ConvertError(f"{m.path}: phi3 rope attention factor is not longrope's")
    return {"original_max_position_embeddings": original}


def _olmo2(m: Meta, c: dict) -> dict:
    if m.int("attention.sliding_window", 0):  # OLMo 3 files say olmo2 but slide a window
        raise ConvertError(f"{m.path}: olmo2 with a sliding window (OLMo 3) is not supported")
    return {}


def _starcoder2(m: Meta, c: dict) -> dict:
    return {"norm_epsilon": m.float("attention.layer_norm_epsilon", 1e-5)}


_ROPE = ("linear", "yarn", "llama3")
ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", _llama, permute_qk=True, rope_scaling=_ROPE),
    "llama+experts": Arch("mixtral", _experts, permute_qk=True, dtype="bfloat16"),
    "qwen2": Arch("qwen2", rope_scaling=_ROPE, dtype="bfloat16"),
    "qwen2moe": Arch("qwen2_moe", _qwen2moe, rope_scaling=("linear",), dtype="bfloat16"),
    "qwen3": Arch("qwen3", rope_scaling=_ROPE, dtype="bfloat16"),
    "qwen3moe": Arch("qwen3_moe", _qwen3moe, dtype="bfloat16"),
    "gemma": Arch("gemma", norm_shift=1.0, family="gemma", dtype="bfloat16"),
    "gemma2": Arch("gemma2", _gemma2, norm_shift=1.0, family="gemma", dtype="bfloat16"),
    "gemma3": Arch(
        "gemma3_text",
        _gemma3,
        norm_shift=1.0,
        rope_scaling=("linear",),
        family="gemma",
        dtype="bfloat16",
    ),  # fmt: skip
    "phi3": Arch("phi3", _phi3, rope_scaling=("linear", "longrope"), partial_rotary=True),
    "olmo2": Arch("olmo2", _olmo2, rope_scaling=_ROPE, dtype="float32"),
    "starcoder2": Arch("starcoder2", _starcoder2, dtype="float32"),
    "glm4moe": Arch("glm4_moe", gguf_mtp.glm4moe, partial_rotary=True, dtype="bfloat16"),
}


def supported() -> list[str]:
    return sorted(k for k in ARCHS if "+" not in k)


def select(meta: dict, path: Path) -> tuple[str, Arch]:
    """The spec for the file's general.architecture, refused by name when there is none."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ConvertError(f"{path}: GGUF metadata lacks 'general.architecture'")
    if arch not in ARCHS:
        raise ConvertError(
            f"{path}: GGUF architecture '{arch}' is not supported; supported: "
            + ", ".join(supported())
            + " (llama covers Mistral, Mixtral and SmolLM files); or convert the model from its "
            "Hugging Face repo"
        )
    if arch == "llama" and meta.get("llama.expert_count"):
        return arch, ARCHS["llama+experts"]
    return arch, ARCHS[arch]


# ------------------------------------------------------------------ config


def _rope_scaling(m: Meta, spec: Arch, c: dict, tensors: dict, read: Reader) -> dict | None:
    kind = m.meta.get(f"{m.arch}.rope.scaling.type", "none")
    found = None
    if "rope_freqs.weight" in tensors:  # Llama 3.1: only the per-frequency factors are stored
        found = _llama3_scaling(read("rope_freqs.weight"), c, m.path)
    elif "rope_factors_long.weight" in tensors:
        found = {
            "type": "longrope",
            "long_factor": read("rope_factors_long.weight").tolist(),
            "short_factor": read("rope_factors_short.weight").tolist(),
        }
    elif kind == "linear":
        found = {"type": "linear", "factor": m.float("rope.scaling.factor")}
    elif kind == "yarn":
        found = {
            "type": "yarn",
            "factor": m.float("rope.scaling.factor"),
            "original_max_position_embeddings": m.int("rope.scaling.original_context_length"),
        }
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if m.get(f"rope.scaling.{key}", None) is not None:
                found[hf] = m.float(f"rope.scaling.{key}")
        default = 0.1 * math.log(max(found["factor"], 1e-9)) + 1.0  # mlx-lm YarnRoPE's own
        attn = m.float("rope.scaling.yarn_attn_factor", default)
        if abs(attn - default) > 1e-4 or m.get("rope.scaling.yarn_log_multiplier", None):
            raise ConvertError(f"{m.path}: YaRN with its own attention factor is not supported")
    elif kind not in ("none", None):
        raise ConvertError(f"{m.path}: rope scaling type {kind!r} is not supported")
    if found is None or (found.get("factor") == 1.0 and found.get("type") != "yarn"):
        return None
    if found.get("factor", 1.0) <= 0:
        raise ConvertError(f"{m.path}: rope scaling factor {found['factor']} is not positive")
    mine = found.get("type") or found["rope_type"]
    if mine not in spec.rope_scaling:
        raise ConvertError(
            f"{m.path}: {m.arch} with {mine} rope scaling: mlx-lm's {spec.model_type} does not "
            "apply it, so the model would be wrong past its original context"
        )
    return found


def _llama3_factors(base: float, dim: int, factor: float, low: float, high: float, old: int):
    """The per-frequency factors convert_hf_to_gguf stores as rope_freqs for Llama 3.1 rope."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _llama3_scaling(freqs: np.ndarray, c: dict, path: Path) -> dict:
    """Llama 3.1's rope_scaling from rope_freqs (the released Llama 3.x models all use low 1,
    high 4, original context 8192; anything else is refused rather than guessed)."""
    have = [float(x) for x in freqs.reshape(-1)]
    factor = max(have) if have else 0.0
    close = False
    if len(have) == c["head_dim"] // 2 and factor > 0:
        want = _llama3_factors(c["rope_theta"], c["head_dim"], factor, 1.0, 4.0, 8192)
        close = all(abs(a - b) <= 1e-4 * b for a, b in zip(want, have, strict=True))
    if close:
        return {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    raise ConvertError(
        f"{path}: its rope_freqs factors do not match Llama 3.1-style rope scaling; convert the "
        "model from its Hugging Face repo instead"
    )


def model_config(meta: dict, tensors: dict, path: Path, read: Reader) -> tuple[dict, Arch]:
    """The mlx-lm config.json for the file (and its spec); every value the model needs is read
    or derived here, before any weight is touched."""
    arch, spec = select(meta, path)
    m = Meta(meta, arch, path)
    if "token_embd.weight" not in tensors:
        raise ConvertError(f"{path}: GGUF has no token_embd.weight tensor")
    hidden = m.int("embedding_length")
    heads = m.int("attention.head_count")
    if hidden != tensors["token_embd.weight"].shape[-1] or not heads:
        raise ConvertError(f"{path}: embedding_length/head_count do not fit token_embd.weight")
    kv_heads = m.int("attention.head_count_kv", heads)
    head_dim = m.int("attention.key_length", hidden // heads)
    if not kv_heads or heads % kv_heads or m.int("attention.value_length", head_dim) != head_dim:
        raise ConvertError(f"{path}: unusable attention shape ({heads} heads, {kv_heads} KV)")
    c: dict[str, Any] = {
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": m.int("block_count") - gguf_mtp.heads(m),  # MTP layers follow
        "intermediate_size": m.int("feed_forward_length", 0),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": m.float("rope.freq_base", 10000.0),
        "max_position_embeddings": m.int("context_length", 4096),
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_traditional": False,
        "_tensors": tensors,
    }
    if gguf_mtp.heads(m):
        c["num_nextn_predict_layers"] = gguf_mtp.heads(m)
    _check_sizes(c, tensors, path)
    rotary = m.int("rope.dimension_count", head_dim)
    if rotary != head_dim:
        if not spec.partial_rotary or not 0 < rotary < head_dim:
            raise ConvertError(f"{path}: rotary over {rotary} of {head_dim} dims is not supported")
        c["partial_rotary_factor"] = rotary / head_dim
    if spec.extra:
        c.update(spec.extra(m, c))
    scaling = _rope_scaling(m, spec, c, tensors, read)
    if scaling:
        c["rope_scaling"] = scaling
    del c["_tensors"]
    _special_ids(meta, c)
    return c, spec


MAX_SIZE = 1 << 24  # no real width, head count or FFN size comes near; a damaged file might


def _check_sizes(c: dict, tensors: dict, path: Path) -> None:
    """Sizes that shape the model must be plausible before an mlx-lm model is built from them
    (a damaged block_count of 2^31 would otherwise build 2^31 layers)."""
    blocks = {n.split(".")[1] for n in tensors if n.startswith("blk.") and n.count(".") >= 2}
    count = c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0)
    if count != len(blocks) or blocks != {str(i) for i in range(len(blocks))}:
        raise ConvertError(
            f"{path}: block_count is {count} but the file holds tensors for "
            f"{len(blocks)} numbered blocks"
        )
    for key in ("intermediate_size", "num_attention_heads", "head_dim", "max_position_embeddings"):
        if not 0 <= c[key] <= (MAX_SIZE << 8 if key == "max_position_embeddings" else MAX_SIZE):
            raise ConvertError(f"{path}: implausible {key} = {c[key]}")


def _special_ids(meta: dict, c: dict) -> None:
    for key in ("bos", "eos"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(value, int) and not isinstance(value, bool):
            c[f"{key}_token_id"] = value


# ------------------------------------------------------------------ weights


def _mlx_model(config: dict, path: Path):
    """The mlx-lm model for `config`, parameters left lazy (nothing is allocated)."""
    import importlib

    try:
        module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        return module.Model(module.ModelArgs.from_dict(config))
    except Exception as e:  # mlx-lm raises many types for a config its class cannot build
        raise ConvertError(
            f"{path}: mlx-lm cannot build a {config['model_type']} model from this file's "
            f"metadata ({type(e).__name__}: {e})"
        ) from e


# mlx-lm names some modules differently from Hugging Face (stacked experts live in switch_mlp)
_MLX_TO_HF = (("block_sparse_moe.switch_mlp.", "mlp.experts."), ("switch_mlp.", "experts."))


@dataclass(frozen=True)
class Target:
    name: str  # mlx-lm parameter name
    shape: tuple[int, ...]
    quantizable: bool  # its module has a quantized form (Linear, Embedding, SwitchLinear)
    qk_heads: int = 0  # undo the Q/K row permutation with this many heads
    shift: float = 0.0  # subtract this (Gemma norms)


def plan(config: dict, spec: Arch, arch: str, tensors: dict, path: Path) -> dict[str, Target]:
    """GGUF tensor name -> where it goes in the mlx-lm model. Every tensor must land somewhere and
    every parameter must come from somewhere (the output head may be tied), shapes must agree."""
    from mlx.utils import tree_flatten

    gguf = _gguf()
    model = _mlx_model(config, path)
    modules = dict(model.named_modules())
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    blocks = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)
    names = gguf.get_tensor_name_map(arch_id, blocks)
    q_name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_Q]
    k_name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_K]
    out: dict[str, Target] = {}
    for name, param in tree_flatten(model.parameters()):
        module, _, suffix = name.rpartition(".")
        gname = _gguf_name(names, name)
        if gname is None:
            raise ConvertError(f"{path}: no GGUF tensor corresponds to mlx-lm's '{name}'")
        base = gname.rsplit(".", 1)[0]
        heads = 0
        if spec.permute_qk and _matches(base, q_name):
            heads = config["num_attention_heads"]
        elif spec.permute_qk and _matches(base, k_name):
            heads = config["num_key_value_heads"]
        shift = spec.norm_shift if name.endswith("norm.weight") else 0.0
        can_quantize = suffix == "weight" and hasattr(modules.get(module), "to_quantized")
        out[gname] = Target(name, tuple(param.shape), can_quantize, heads, shift)
    mtp = gguf_mtp.plan_heads(model, config, tensors, lambda n: _gguf_name(names, n), path)
    # Always decoded: the heads are quantized (or not) with the model by convert.
    out.update({g: Target(name, shape, False) for g, (name, shape) in mtp.items()})
    _check_coverage(out, tensors, path)
    return out


def _gguf_name(names: Any, mlx_name: str) -> str | None:
    """The GGUF tensor name of an mlx-lm parameter, through gguf-py's Hugging Face name map."""
    module, _, suffix = mlx_name.rpartition(".")
    for a, b in _MLX_TO_HF:
        module = module.replace(a, b)
    if suffix == "e_score_correction_bias":  # convert_hf_to_gguf renames it ...correction.bias
        module, suffix = f"{module}.e_score_correction", "bias"
    found = names.get_type_and_name(f"{module}.{suffix}", try_suffixes=(".weight", ".bias"))
    return found[1] if found else None


def _matches(base: str, pattern: str) -> bool:
    head, _, tail = pattern.partition("{bid}")
    return base.startswith(head) and base.endswith(tail) and base[len(head) : -len(tail)].isdigit()


IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _check_coverage(targets: dict[str, Target], tensors: dict, path: Path) -> None:
    extra = [n for n in tensors if n not in targets and n not in IGNORED]
    if extra:
        raise ConvertError(
            f"{path}: unexpected tensor '{extra[0]}' ({len(extra)} in all) for this architecture"
        )
    missing = [n for n, t in targets.items() if n not in tensors and t.name != "lm_head.weight"]
    if missing:
        raise ConvertError(f"{path}: GGUF lacks tensor '{missing[0]}' ({len(missing)} missing)")
    for gname in list(targets):
        if gname not in tensors:  # the tied output head
            del targets[gname]
            continue
        have, want = tensors[gname].shape, targets[gname].shape
        if have != want and tuple(d for d in have if d != 1) != tuple(d for d in want if d != 1):
            raise ConvertError(
                f"{path}: tensor '{gname}' has shape {list(have)}, the model needs {list(want)}"
            )


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute (interleaved -> half-split rotary rows).
    It only reorders rows, so it applies alike to weights, biases and quantized scales."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def transform(values: np.ndarray, target: Target) -> np.ndarray:
    """A float32 GGUF tensor as the mlx-lm parameter it stands for."""
    values = values.reshape(target.shape)
    if target.qk_heads:
        values = unpermute(values, target.qk_heads)
    if target.shift:
        values = values - np.float32(target.shift)
    return values
