"""Finding a checkpoint's MTP heads and bringing them into the stored form of models/mtp.py.

The main model goes through mlx-lm's own loader, which drops these weights (its `sanitize`); the
heads are read here from the same safetensors. A head's decoder layer gets the transforms mlx-lm
applies to the model's own layers (experts stacked, DeepSeek's kv_b_proj split, Qwen3-Next's
zero-centred norm gains, FP8 blocks decoded), so that the target's decoder-layer class loads it
as it is; tests/models/test_mtp.py checks each transform against mlx-lm's on a trunk layer.
"""

from __future__ import annotations

import logging
import re
import struct
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from ..base.errors import ModelError
from .mtp import (
    Layout,
    MtpConfig,
    MtpHead,
    build_heads,
    declared_count,
    layout_for,
    make_block,
    quantize_heads,
    text_config,
    trunk_args,
)
from .store import _safetensors_header

log = logging.getLogger(__name__)

# Norm gains mlx-lm shifts by +1 in Qwen3-Next / Qwen3.5 raw checkpoints (their sanitize).
ZERO_CENTRED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_EXPERT = re.compile(r"^(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.(?P<kind>weight|bias)$")


@dataclass
class Found:
    """The MTP heads of one checkpoint, ready to be built (models/mtp.MtpHead)."""

    layout: Layout
    count: int
    heads: list[dict[str, mx.array]]  # internal names (module-relative), block in mlx-lm's form
    block_layer: int
    own_embed: bool
    own_head: bool
    source_keys: set[str] = field(default_factory=set)  # every checkpoint key the heads use
    source: Path | None = None


@dataclass
class Missing:
    """The config declares heads but the weights hold none (e.g. a re-packaged checkpoint)."""

    layout: Layout
    declared: int


def index(src: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the directory's *.safetensors: key -> (file name, shape)."""
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        try:
            header = _safetensors_header(f)
        except (OSError, ValueError, struct.error) as e:
            raise ModelError(f"{f}: unreadable safetensors header ({e})") from e
        header.pop("__metadata__", None)
        out.update({k: (f.name, list(v.get("shape", []))) for k, v in header.items()})
    return out


def owns(layout: Layout, key: str, num_layers: int) -> bool:
    """Whether a checkpoint key belongs to an MTP head of this layout."""
    if layout.name == "deepseek":
        parts = key.split(".")
        return (
            len(parts) > 3
            and key.startswith("model.layers.")
            and parts[2].isdigit()
            and int(parts[2]) >= num_layers
        )
    return key.startswith(layout.shared_prefix or layout.head_prefix.split("{")[0])


def _head_index(layout: Layout, key: str, num_layers: int) -> int | None:
    parts = key.split(".")
    if layout.name == "deepseek":
        return int(parts[2]) - num_layers
    m = re.match(re.escape(layout.head_prefix.split("{")[0]) + r"(\d+)\.", key)
    return int(m.group(1)) if m else None


def find(src: Path, config: dict, model: nn.Module) -> Found | Missing | None:
    """The checkpoint's MTP heads (None: its architecture has none, or the config sets 0)."""
    layout = layout_for(config)
    if layout is None:
        return None
    keys = index(src)
    num_layers = text_config(config)["num_hidden_layers"]
    owned = {k for k in keys if owns(layout, k, num_layers)}
    declared = declared_count(layout, config)
    present = sorted({i for k in owned if (i := _head_index(layout, k, num_layers)) is not None})
    if declared == 0 or (declared is None and not owned):
        return None
    count = declared if declared is not None else len(present) or layout.count_default
    if not owned:
        return Missing(layout, count)
    for i in range(count):
        if i not in present:
            raise ModelError(
                f"{src}: the config declares {count} MTP heads, but the *.safetensors hold no "
                f"'{layout.prefix(num_layers, i)}*' tensors for head {i} (a truncated checkpoint)"
            )
    extra = [i for i in present if i >= count]
    if extra:
        raise ModelError(
            f"{src}: MTP tensors for head {extra[0]} ('{layout.prefix(num_layers, extra[0])}*'), "
            f"but the config declares {count} heads"
        )
    reader = _Reader(src, keys, getattr(model, "sanitize", None))
    heads = [_read_head(layout, reader, config, num_layers, i) for i in range(count)]
    unused = owned - reader.used
    if unused:
        key = sorted(unused)[0]
        raise ModelError(f"{src / keys[key][0]}: '{key}' belongs to no part of an MTP head")
    block_layer = _match_block(model, heads[0], src, layout.prefix(num_layers, 0))
    for i, head in enumerate(heads[1:], 1):
        _match_block(model, head, src, layout.prefix(num_layers, i), only=block_layer)
    own_embed, own_head = _keep_copies(model, heads)
    return Found(layout, count, heads, block_layer, own_embed, own_head, set(reader.used), src)


class _Reader:
    """Loads tensors by key from the directory's files (each file opened once, lazily)."""

    def __init__(self, src: Path, keys: dict, sanitize=None):
        self.src, self.keys, self.files, self.used = src, keys, {}, set()
        self.sanitize = sanitize  # the model class's own weight sanitizer (FP8 decoding)

    def where(self, key: str) -> Path:
        return self.src / self.keys[key][0] if key in self.keys else self.src / "*.safetensors"

    def get(self, key: str) -> mx.array:
        name = self.keys[key][0]
        if name not in self.files:
            try:
                self.files[name] = mx.load(str(self.src / name))
            except (OSError, ValueError, RuntimeError) as e:
                raise ModelError(f"{self.src / name}: cannot read ({e})") from e
        self.used.add(key)
        return self.files[name][key]


def _read_head(layout: Layout, reader: _Reader, config: dict, num_layers: int, i: int) -> dict:
    cfg = text_config(config)
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    prefix = layout.prefix(num_layers, i)
    fusion_base = layout.shared_prefix or prefix
    out: dict[str, mx.array] = {}
    shapes = {"proj": (hidden, 2 * hidden), "embed": (vocab, hidden), "head": (vocab, hidden)}
    taken = set()
    for internal, name in layout.fusion + layout.copies:
        key = fusion_base + name if (internal, name) in layout.fusion else prefix + name
        taken.add(key)
        if key not in reader.keys:
            if (internal, name) in layout.copies:
                continue
            raise ModelError(
                f"{reader.where(key)}: MTP head {i} lacks '{key}' (a truncated checkpoint)"
            )
        want = shapes.get(internal, (hidden,))
        if tuple(reader.keys[key][1]) != want:
            raise ModelError(
                f"{reader.where(key)}: '{key}' has shape {reader.keys[key][1]}, an MTP head of "
                f"width {hidden} needs {list(want)}"
            )
        out[f"{internal}.weight"] = reader.get(key)
    block = {
        k[len(prefix) :]: reader.get(k)
        for k in sorted(reader.keys)
        if k.startswith(prefix) and k not in taken and not k.endswith("rotary_emb.inv_freq")
    }
    if not block:
        raise ModelError(f"{reader.where(prefix)}: MTP head {i} has no decoder layer ('{prefix}*')")
    block = _dequantize_fp8(block, reader, prefix)
    block = _stack_experts(block, reader, prefix)
    block = _split_kv_b(block, cfg)
    out.update({f"block.{k}": v for k, v in block.items()})
    if layout.zero_centred and _raw_zero_centred(reader.keys):
        out = {k: v + 1.0 if _shifted(k) else v for k, v in out.items()}
    return out


def _shifted(name: str) -> bool:
    return name in ("embed_norm.weight", "hidden_norm.weight", "out_norm.weight") or (
        name.startswith("block.") and name.endswith(ZERO_CENTRED)
    )


def _raw_zero_centred(keys: dict) -> bool:
    """A raw Qwen3-Next / Qwen3.5 checkpoint (norm gains stored as w - 1): its conv1d kernels are
    (C, 1, K), where mlx-lm's saved form is (C, K, 1); the test mlx-lm's own sanitize uses."""
    return any("conv1d.weight" in k and shape and shape[-1] != 1 for k, (_, shape) in keys.items())


def _dequantize_fp8(block: dict, reader: _Reader, prefix: str) -> dict:
    """FP8 blocks (weight + weight_scale_inv, DeepSeek-V3's release) decoded as mlx-lm decodes the
    model's own layers: by the architecture's sanitize, called on each pair alone under a name
    none of its other rules touches."""
    for k in [k for k in block if k.endswith(".weight_scale_inv")]:
        base = k.removesuffix("_scale_inv")
        if base not in block or reader.sanitize is None:
            raise ModelError(
                f"{reader.where(prefix + k)}: FP8 scales '{prefix}{k}' without a loader"
            )
        decoded = reader.sanitize({"fp8.weight": block[base], "fp8.weight_scale_inv": block[k]})
        if set(decoded) != {"fp8.weight"}:
            raise ModelError(
                f"{reader.where(prefix + k)}: FP8 MTP weights ('{prefix}{base}') of an "
                "architecture whose mlx-lm loader does not decode FP8"
            )
        block[base] = decoded["fp8.weight"]
        del block[k]
    return block


def _stack_experts(block: dict, reader: _Reader, prefix: str) -> dict:
    """experts.{e}.{proj}.weight -> switch_mlp.{proj}.weight (E, ...), and the fused Qwen3.5-MoE
    experts.gate_up_proj / down_proj, as mlx-lm's sanitize stacks the model's own layers."""
    groups: dict[tuple[str, str, str], dict[int, mx.array]] = defaultdict(dict)
    out = {}
    for k, v in block.items():
        m = _EXPERT.match(k)
        if m:
            groups[(m["base"], m["proj"], m["kind"])][int(m["e"])] = v
        else:
            out[k] = v
    for (base, proj, kind), by_expert in sorted(groups.items()):
        n = max(by_expert) + 1
        for e in range(n):
            if e not in by_expert:
                key = f"{prefix}{base}.{e}.{proj}.{kind}"
                raise ModelError(f"{reader.where(prefix)}: MTP head lacks '{key}'")
        stacked = base.removesuffix(".experts") + ".switch_mlp"
        out[f"{stacked}.{proj}.{kind}"] = mx.stack([by_expert[e] for e in range(n)])
    for k in [k for k in out if k.endswith(".experts.gate_up_proj")]:
        base = k.removesuffix(".experts.gate_up_proj")
        gate_up = out.pop(k)
        mid = gate_up.shape[-2] // 2
        out[f"{base}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{base}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        down = out.pop(f"{base}.experts.down_proj", None)
        if down is None:
            raise ModelError(
                f"{reader.where(prefix)}: MTP head lacks '{prefix}{base}.experts.down_proj'"
            )
        out[f"{base}.switch_mlp.down_proj.weight"] = down
    return out


def _split_kv_b(block: dict, cfg: dict) -> dict:
    """DeepSeek MLA: kv_b_proj -> embed_q (per-head key part, transposed) and unembed_out (value
    part), the split mlx-lm's deepseek_v3 / v32 sanitize makes."""
    key = "self_attn.kv_b_proj.weight"
    if key not in block:
        return block
    v = block.pop(key)
    nope, heads = cfg["qk_nope_head_dim"], cfg["num_attention_heads"]
    v = v.reshape(heads, nope + cfg["v_head_dim"], -1)
    block["self_attn.embed_q.weight"] = mx.contiguous(v[:, :nope, :].swapaxes(-1, -2))
    block["self_attn.unembed_out.weight"] = mx.contiguous(v[:, nope:, :])
    return block


def _structure(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tree_flatten(module.parameters())}


def _match_block(
    model: nn.Module, head: dict, src: Path, prefix: str, only: int | None = None
) -> int:
    """The index of a target decoder layer whose kind (class, attention, MLP) the head's block
    repeats; a block matching none is a ModelError naming its first differing tensor."""
    have = {k[len("block.") :]: tuple(v.shape) for k, v in head.items() if k.startswith("block.")}
    if any(k.endswith((".scales", ".biases")) for k in have):
        raise ModelError(
            f"{src}: the MTP head '{prefix}*' is quantized; convert from the full-precision "
            "checkpoint (macspec quantizes the heads with the model)"
        )
    seen, best = set(), None
    candidates = [only] if only is not None else range(len(model.layers))
    for j in candidates:
        kind = _kind(model.layers[j])
        if kind in seen:
            continue
        seen.add(kind)
        want = _structure(make_block(model, j))
        if want == have:
            return j
        diff = _first_difference(want, have)
        if best is None or diff[0] < best[0]:
            best = diff
    raise ModelError(f"{src}: MTP head '{prefix}*': {best[1]}")


def _kind(layer: nn.Module) -> tuple:
    return tuple((k, type(m).__name__.replace("Quantized", "")) for k, m in layer.named_modules())


def _first_difference(want: dict, have: dict) -> tuple[int, str]:
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    shapes = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    score = len(missing) + len(extra) + len(shapes)
    if missing:
        return score, f"lacks '{missing[0]}' of the model's decoder layer (a truncated head)"
    if extra:
        return score, f"has '{extra[0]}', which the model's decoder layer has not"
    k = shapes[0]
    return score, f"'{k}' has shape {list(have[k])}, the model's layer has {list(want[k])}"


def _keep_copies(model: nn.Module, heads: list[dict]) -> tuple[bool, bool]:
    """Drop the heads' copies of the embedding / output head where they equal the target's (the
    DeepSeek-style checkpoints repeat them per head); keep them where they differ."""
    params = dict(tree_flatten(model.parameters()))
    embed = next((v for k, v in params.items() if k.endswith("embed_tokens.weight")), None)
    head = next((v for k, v in params.items() if k.endswith("lm_head.weight")), embed)
    keep = []
    for name, ref in (("embed.weight", embed), ("head.weight", head)):
        copies = [h[name] for h in heads if name in h]
        same = all(
            ref is not None and c.shape == ref.shape and mx.array_equal(c, ref).item()
            for c in copies
        )
        if copies and len(copies) != len(heads):
            raise ModelError(f"only {len(copies)} of {len(heads)} MTP heads have their own {name}")
        if same:
            for h in heads:
                h.pop(name, None)
        keep.append(bool(copies) and not same)
    return keep[0], keep[1]


def layer_path(model: nn.Module, index: int) -> str:
    """The parameter path of the target's decoder layer `index` (model.layers.3, or
    language_model.model.layers.3 for Qwen3.5)."""
    layer = model.layers[index]
    return next(name for name, m in model.named_modules() if m is layer)


def build(
    found: Found,
    model: nn.Module,
    config: dict,
    dtype: str,
    quant: dict | None,
    embed_8bit: bool = False,
    source: str = "",
) -> tuple[MtpConfig, list[MtpHead]]:
    """The heads of `found` as modules: loaded, cast to `dtype` and quantized as the target was
    (`quant`: mlx-lm's quantization config; the target's own quant_predicate picks per module,
    asked with the path of the trunk layer the block repeats; `embed_8bit` keeps the heads'
    own embedding / output head copies at 8 bits, as convert does for the target's)."""
    cfg_text = text_config(config)
    args = trunk_args(model)
    cfg = MtpConfig(
        layout=found.layout.name,
        model_type=args.model_type,
        count=found.count,
        hidden_size=args.hidden_size,
        vocab_size=cfg_text["vocab_size"],
        block_layer=found.block_layer,
        order=found.layout.order,
        shared_fusion=bool(found.layout.shared_prefix),
        own_embed=found.own_embed,
        own_head=found.own_head,
        rms_norm_eps=float(cfg_text.get("rms_norm_eps", 1e-6)),
        dtype=dtype,
        cite=found.layout.cite,
        source=source,
    )
    heads = build_heads(model, cfg)
    trunk = layer_path(model, found.block_layer)
    cast = getattr(model, "cast_predicate", lambda _: True)
    target = getattr(mx, dtype)
    for head, arrays in zip(heads, found.heads, strict=True):
        head.load_weights(list(arrays.items()))
        head.update(
            tree_map_with_path(
                lambda k, v: (
                    v.astype(target)
                    if mx.issubdtype(v.dtype, mx.floating) and cast(_as_target(k, trunk))
                    else v
                ),
                head.parameters(),
            )
        )
    if quant:
        cfg = replace(cfg, quantization=_quantize(heads, model, quant, trunk, embed_8bit))
    return cfg, heads


def _quantize(heads: list, model: nn.Module, quant: dict, trunk: str, embed_8bit: bool) -> dict:
    """Quantize the heads as convert quantizes the target (its own quant_predicate, asked with
    the trunk layer's path); returns the quantization config to record (per-module choices)."""
    own = getattr(model, "quant_predicate", None)
    per_module = dict(quant)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if module.weight.shape[-1] % quant["group_size"]:
            return False
        part = path.split(".", 2)[2]
        if embed_8bit and part.split(".")[0] in ("embed", "head"):
            choice = {"group_size": quant["group_size"], "bits": 8, "mode": "affine"}
        else:
            choice = own(_as_target(part, trunk), module) if own else True
        if isinstance(choice, dict) and module.weight.shape[-1] % choice["group_size"]:
            return False
        if isinstance(choice, dict):
            per_module[path] = choice
        return choice

    quantize_heads(heads, quant, predicate=predicate)
    return per_module


def _as_target(path: str, trunk: str) -> str:
    """A head's parameter path as the target names the part it stands for."""
    if path.startswith("block."):
        return f"{trunk}.{path[len('block.') :]}"
    return {"embed": "model.embed_tokens", "head": "lm_head"}.get(path.split(".")[0], path)
