"""Published EAGLE-3 draft checkpoints: the three layouts people publish, read into one internal
layout (plain arrays + a frozen Eagle3Config), and checked against the target they will draft for.

The draft (EAGLE-3, Li et al. 2025; the authors' eagle/model/cnets.py):

    g   = fc(cat(f_low, f_mid, f_high))            target features at 3 layers, 3*Ht -> H
    x   = layer0(cat(input_layernorm(e), hidden_norm(g)), residual = g)   attention over 2H
    out = more decoder layers (speculators only), then the next position reads `out`
    p   = softmax(lm_head(norm(out)))  over the draft vocabulary; draft id i is target id d2t_abs[i]

Layouts (file + commit for each in notes/drafters/layouts.md):
  "eagle"       SafeAILab/EAGLE: config.json (LlamaConfig + draft_vocab_size), keys midlayer.*,
                fc, norm, lm_head, d2t (target id - draft id), t2d (bool over target ids)
  "specforge"   sgl-project/SpecForge exports: the same keys, architectures
                ["LlamaForCausalLMEagle3"], optional fc_norm.{0,1,2} and norm_output (the final
                norm before lm_head, default true), optional embed_tokens
  "speculators" vllm-project/speculators: speculators_model_type "eagle3", transformer_layer_config,
                speculators_config.verifier, eagle_aux_hidden_state_layer_ids, keys layers.{i}.*,
                norm_before_residual (vLLM's default when absent: true), norm_output (recycle the
                normed state, Eagle 3.1), fc_norm, norm_before_fc (input_norm)

Internal names: fc.weight, layers.{i}.<llama decoder layer> (layer 0 adds hidden_norm),
norm.weight, lm_head.weight, and when present embed_tokens.weight, fc_norm.{k}.weight,
input_norm.weight.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..base.errors import ModelError

log = logging.getLogger(__name__)

FORMATS = ("eagle", "specforge", "speculators")
SPECFORGE_ARCH = "LlamaForCausalLMEagle3"
LAYER_TYPES = ("llama", "qwen3")  # decoder layers of the draft (qwen3 adds q_norm / k_norm)
# Keys a checkpoint may hold that no drafter reads (speculators' training-only copies).
IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight")


@dataclass(frozen=True)
class Eagle3Config:
    """Everything about a draft checkpoint that is not an array, in one internal form."""

    format: str
    hidden_size: int
    target_hidden_size: int  # width of each target feature fed to fc
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: str | None  # JSON of the rope_scaling dict (frozen), or None
    max_position_embeddings: int
    layer_type: str  # "llama" | "qwen3"
    attention_bias: bool
    mlp_bias: bool
    draft_vocab_size: int
    target_vocab_size: int
    # Target layers whose *input* (the output of layer id-1; 0: the embeddings) fc reads, as
    # EAGLE's modeling_llama_kv.py and vLLM's llama.py collect them; () = the default
    # (2, L // 2, L - 3) for a target of L layers (aux_layers()).
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool  # layer 0's residual is hidden_norm(g), not g
    fc_norm: bool  # each feature RMS-normed before fc (fc_norm.{k})
    norm_before_fc: bool  # one RMSNorm over the joined features (input_norm)
    logits_norm: bool  # norm applied before lm_head (SpecForge's norm_output; true elsewhere)
    recycle_normed: bool  # the next position reads norm(out), not out (speculators' norm_output)
    fc_bias: bool
    tie_word_embeddings: bool  # lm_head is the draft's own embed_tokens (SGLang)
    has_embed: bool  # the checkpoint carries its own embed_tokens
    target_architectures: tuple[str, ...] = ()  # speculators: verifier.architectures
    target_name: str | None = None

    @property
    def aux_count(self) -> int:
        return len(self.aux_layer_ids) or 3


@dataclass
class Eagle3Checkpoint:
    config: Eagle3Config
    weights: dict[str, mx.array]  # internal names
    d2t: np.ndarray  # (draft_vocab,) int64 absolute target id of each draft id
    path: Path


def aux_layers(config: Eagle3Config, num_layers: int) -> tuple[int, ...]:
    """The target layers (inputs of) whose states fc joins: the checkpoint's own, else EAGLE's
    default choice (2, L // 2, L - 3) (cnets / modeling_llama_kv.py; speculators and vLLM)."""
    return config.aux_layer_ids or (2, num_layers // 2, num_layers - 3)


# ------------------------------------------------------------------ reading


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: unreadable ({e})") from e
    if not isinstance(data, dict):
        raise ModelError(f"{path}: not a JSON object")
    return data


def _weights(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(
            p.name for p in path.glob("*.pt")
        )
        if pickles:
            raise ModelError(
                f"{path / pickles[0]}: a pickled PyTorch checkpoint; macspec loads safetensors "
                "only (pickles can run code); convert it with safetensors' convert script"
            )
        raise ModelError(f"{path}: no *.safetensors weights")
    out: dict[str, mx.array] = {}
    for f in files:
        try:
            out.update(mx.load(str(f)))
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelError(f"{f}: unreadable ({e})") from e
    return out


def detect(path: Path) -> str:
    """Which of FORMATS a draft directory is in (ModelError if none)."""
    config = _read_json(path / "config.json")
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind != "eagle3":
            raise ModelError(f"{path / 'config.json'}: speculators model type {kind!r}, not eagle3")
        return "speculators"
    if "draft_vocab_size" not in config:
        raise ModelError(
            f"{path / 'config.json'}: not an EAGLE-3 draft (no draft_vocab_size and no "
            "speculators_model_type)"
        )
    return "specforge" if SPECFORGE_ARCH in (config.get("architectures") or []) else "eagle"


def _get(cfg: dict, key: str, where: Path, kind: type = int, default: Any = ...) -> Any:
    value = cfg.get(key, default)
    if value is ...:
        raise ModelError(f"{where}: config lacks '{key}'")
    wrong = value is not None and not isinstance(value, kind)
    if wrong or (isinstance(value, bool) and kind is int):
        raise ModelError(f"{where}: '{key}' = {value!r} is not a {kind.__name__}")
    return value


def _config(path: Path, fmt: str, weights: dict) -> Eagle3Config:
    where = path / "config.json"
    top = _read_json(where)
    layer = top.get("transformer_layer_config") if fmt == "speculators" else top
    if not isinstance(layer, dict):
        raise ModelError(f"{where}: transformer_layer_config must be an object")
    layer_type = layer.get("model_type", "llama")
    if layer_type not in LAYER_TYPES:
        raise ModelError(
            f"{where}: draft layers of type {layer_type!r}; macspec reads {LAYER_TYPES}"
        )
    hidden = _get(layer, "hidden_size", where)
    heads = _get(layer, "num_attention_heads", where)
    spec = top if fmt == "speculators" else {}
    verifier = (top.get("speculators_config") or {}).get("verifier") or {}
    t2d = weights.get("t2d")
    target_vocab = _get(layer, "vocab_size", where)
    rope = layer.get("rope_scaling") or layer.get("rope_parameters")
    ids = spec.get("eagle_aux_hidden_state_layer_ids") or top.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return Eagle3Config(
        format=fmt,
        hidden_size=hidden,
        target_hidden_size=_get(top, "target_hidden_size", where, default=None) or hidden,
        intermediate_size=_get(layer, "intermediate_size", where),
        num_attention_heads=heads,
        num_key_value_heads=_get(layer, "num_key_value_heads", where, default=heads),
        head_dim=_get(layer, "head_dim", where, default=None) or hidden // heads,
        num_layers=_get(layer, "num_hidden_layers", where, default=1),
        rms_norm_eps=float(_get(layer, "rms_norm_eps", where, (int, float), 1e-6)),
        rope_theta=float(_get(layer, "rope_theta", where, (int, float), 10000.0)),
        rope_scaling=json.dumps(rope, sort_keys=True) if isinstance(rope, dict) else None,
        max_position_embeddings=_get(layer, "max_position_embeddings", where, default=4096),
        layer_type=layer_type,
        attention_bias=bool(layer.get("attention_bias", False)),
        mlp_bias=bool(layer.get("mlp_bias", False)),
        draft_vocab_size=_get(top, "draft_vocab_size", where, default=None) or target_vocab,
        target_vocab_size=int(t2d.shape[0]) if t2d is not None else target_vocab,
        aux_layer_ids=tuple(int(i) for i in ids or ()),
        norm_before_residual=bool(top.get("norm_before_residual", fmt == "speculators")),
        fc_norm=bool(top.get("fc_norm", False)),
        norm_before_fc=bool(top.get("norm_before_fc", False)),
        logits_norm=bool(top.get("norm_output", True)) if fmt == "specforge" else True,
        recycle_normed=bool(top.get("norm_output", False)) if fmt == "speculators" else False,
        fc_bias=bool(top.get("bias", False)) if fmt != "speculators" else False,
        tie_word_embeddings=bool(layer.get("tie_word_embeddings", False)) and fmt != "speculators",
        has_embed="embed_tokens.weight" in weights,
        target_architectures=tuple(verifier.get("architectures") or ()),
        target_name=verifier.get("name_or_path"),
    )


def expected_shapes(c: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every internal key the config implies, with its shape."""
    h, hd = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    out: dict[str, tuple[int, ...]] = {"fc.weight": (h, c.aux_count * c.target_hidden_size)}
    if c.fc_bias:
        out["fc.bias"] = (h,)
    for i in range(c.num_layers):
        p, width = f"layers.{i}.", 2 * h if i == 0 else h
        out.update(
            {p + "self_attn.q_proj.weight": (q, width), p + "self_attn.o_proj.weight": (h, q)}
        )
        out.update({p + f"self_attn.{n}_proj.weight": (kv, width) for n in "kv"})
        if c.attention_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.o_proj.bias": (h,)})
            out.update({p + f"self_attn.{n}_proj.bias": (kv,) for n in "kv"})
        if c.layer_type == "qwen3":
            out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        out.update({p + f"mlp.{n}_proj.weight": (c.intermediate_size, h) for n in ("gate", "up")})
        out[p + "mlp.down_proj.weight"] = (h, c.intermediate_size)
        if c.mlp_bias:
            out.update({p + f"mlp.{n}_proj.bias": (c.intermediate_size,) for n in ("gate", "up")})
            out[p + "mlp.down_proj.bias"] = (h,)
        norms = ("input_layernorm", "post_attention_layernorm") + (
            ("hidden_norm",) if i == 0 else ()
        )
        out.update({p + f"{n}.weight": (h,) for n in norms})
    out["norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.draft_vocab_size, h)
    if c.has_embed or c.tie_word_embeddings:
        out["embed_tokens.weight"] = (c.target_vocab_size, h)
    if c.fc_norm:
        out.update({f"fc_norm.{k}.weight": (c.target_hidden_size,) for k in range(c.aux_count)})
    if c.norm_before_fc:
        out["input_norm.weight"] = (c.aux_count * c.target_hidden_size,)
    return out


def source_name(fmt: str, key: str) -> str:
    """The checkpoint's own name of an internal key (EAGLE and SpecForge call layer 0 midlayer)."""
    if fmt != "speculators" and key.startswith("layers.0."):
        return "midlayer." + key[len("layers.0.") :]
    return key


def _internal(fmt: str, weights: dict, path: Path) -> dict[str, mx.array]:
    out = {}
    for k, v in weights.items():
        if k in IGNORED or k in ("d2t", "t2d"):
            continue
        if fmt != "speculators" and k.startswith("midlayer."):
            k = "layers.0." + k[len("midlayer.") :]
        elif fmt != "speculators" and k.startswith("layers."):
            raise ModelError(f"{path}: '{k}' in an {fmt}-format draft (its layer is midlayer.*)")
        out[k] = v
    return out


def _check_arrays(c: Eagle3Config, weights: dict, path: Path) -> None:
    want = expected_shapes(c)
    for key, shape in want.items():
        name = source_name(c.format, key)
        if key not in weights:
            raise ModelError(f"{path}: the draft lacks '{name}' (a truncated checkpoint?)")
        if tuple(weights[key].shape) != shape:
            raise ModelError(
                f"{path}: '{name}' has shape {list(weights[key].shape)}, its config implies "
                f"{list(shape)}"
            )
    extra = sorted(set(weights) - set(want))
    if extra:
        raise ModelError(
            f"{path}: '{source_name(c.format, extra[0])}' is no part of an EAGLE-3 draft"
        )


def _vocab_map(c: Eagle3Config, raw: dict, path: Path) -> np.ndarray:
    """Absolute target ids of the draft ids, from d2t (offsets: target = draft + d2t[draft]),
    refused where out of range, repeated, or contradicting t2d."""
    d2t, t2d = raw.get("d2t"), raw.get("t2d")
    if c.draft_vocab_size > c.target_vocab_size:
        raise ModelError(
            f"{path}: the draft vocabulary ({c.draft_vocab_size} ids) is larger than the target "
            f"vocabulary it names ({c.target_vocab_size})"
        )
    if d2t is None:
        if c.draft_vocab_size != c.target_vocab_size:
            raise ModelError(f"{path}: a draft vocabulary of {c.draft_vocab_size} ids needs d2t")
        return np.arange(c.draft_vocab_size, dtype=np.int64)
    offsets = np.array(d2t.astype(mx.int64))
    if offsets.shape != (c.draft_vocab_size,):
        raise ModelError(f"{path}: d2t has shape {list(offsets.shape)}, not [{c.draft_vocab_size}]")
    ids = np.arange(c.draft_vocab_size, dtype=np.int64) + offsets
    bad = np.flatnonzero((ids < 0) | (ids >= c.target_vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ModelError(
            f"{path}: d2t maps draft id {i} to target id {int(ids[i])}, outside the target's "
            f"{c.target_vocab_size} ids"
        )
    if np.unique(ids).size != ids.size:
        raise ModelError(f"{path}: d2t maps two draft ids to one target id")
    if t2d is not None:
        mask = np.array(t2d).astype(bool).reshape(-1)
        want = np.zeros(c.target_vocab_size, dtype=bool)
        want[ids] = True
        if mask.shape != want.shape or not np.array_equal(mask, want):
            raise ModelError(f"{path}: t2d does not mark exactly the target ids d2t maps to")
    return ids


def load(path: str | Path) -> Eagle3Checkpoint:
    """Read a draft directory in any of FORMATS into the internal layout (float arrays as
    stored; d2t as absolute target ids), refusing a malformed one by file and key."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: not an EAGLE-3 draft directory (no config.json)")
    fmt = detect(path)
    raw = _weights(path)
    config = _config(path, fmt, raw)
    weights = _internal(fmt, raw, path)
    ids = _vocab_map(config, raw, path)
    _check_arrays(config, weights, path)
    log.info("read a %s-format EAGLE-3 draft from %s", fmt, path)
    return Eagle3Checkpoint(config, weights, ids, path)


def check_target(ckpt: Eagle3Checkpoint, target_config: dict, target: str = "the target") -> None:
    """Refuse, naming what differs, a draft made for another target: architecture (where the
    checkpoint records it), hidden size, vocabulary, or target layers the target lacks."""
    c, where = ckpt.config, ckpt.path
    cfg = {**target_config, **(target_config.get("text_config") or {})}
    hidden, vocab, layers = (
        cfg.get("hidden_size"),
        cfg.get("vocab_size"),
        cfg.get("num_hidden_layers"),
    )
    archs = tuple(target_config.get("architectures") or ())
    if c.target_architectures and archs and not set(archs) & set(c.target_architectures):
        raise ModelError(
            f"{where} drafts for {', '.join(c.target_architectures)}, but {target} is "
            f"{', '.join(archs)}"
        )
    if hidden != c.target_hidden_size:
        raise ModelError(
            f"{where} reads target features of width {c.target_hidden_size}, but {target} has "
            f"hidden size {hidden}"
        )
    if c.hidden_size != hidden and not c.has_embed:
        raise ModelError(
            f"{where}: a draft of width {c.hidden_size} without its own embed_tokens cannot use "
            f"the embeddings of {target} (width {hidden})"
        )
    if vocab != c.target_vocab_size:
        raise ModelError(
            f"{where} was made for a vocabulary of {c.target_vocab_size} ids, but {target} has "
            f"{vocab}"
        )
    for i in aux_layers(c, layers):
        if not 0 <= i < layers:
            raise ModelError(f"{where} reads target layer {i}, but {target} has {layers} layers")
