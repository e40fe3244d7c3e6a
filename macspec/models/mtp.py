"""A model's own multi-token-prediction (MTP) heads: the published layouts, the head as an MLX
module, and the `mtp.safetensors` + `mtp.json` pair `macspec convert` writes beside a model.

Every published MTP head computes the same thing (vLLM's deepseek_mtp.py, qwen3_next_mtp.py,
glm4_moe_mtp.py, mimo_mtp.py; the citations per layout are in LAYOUTS and in
notes/drafters/layouts.md):

    h'  = block(proj(cat(embed_norm(embed(x_{t+1})), hidden_norm(h_t))))   (MiMo: cat(h, e))
    p   = softmax(head(out_norm(h')))                                        predicts x_{t+2}

where h_t is the target's final (normed) hidden state at position t and `block` is one decoder
layer of the target's own architecture, with its own KV cache. Depth k > 1 chains it: head
k mod count reads the previous head's out_norm(h') and the embedding of the token it drafted.

Stored form (models/mtp_extract.py writes it): the block in mlx-lm's own parameter layout (the
target's decoder-layer class loads it unchanged), the fusion parts under fixed names:
    heads.{i}.embed_norm.weight  heads.{i}.hidden_norm.weight  heads.{i}.proj.weight
    heads.{i}.out_norm.weight    heads.{i}.block.<layer params>
    heads.{i}.embed.weight / heads.{i}.head.weight  only where the checkpoint's copy differs from
                                                    the target's embedding / output head
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import ModelError
from ..core import hooks

log = logging.getLogger(__name__)

WEIGHTS = "mtp.safetensors"
META = "mtp.json"
FORMAT = 1  # mtp.json's own version


@dataclass(frozen=True)
class Layout:
    """Where one family of checkpoints keeps its MTP heads (source names, Hugging Face layout).

    `head_prefix` is formatted with n = num_hidden_layers + i and i (head index); `fusion` maps
    the internal names above to names under the head's prefix, or under `shared_prefix` when the
    fusion weights exist once for every head (Qwen3-Next keeps one fc and its norms)."""

    name: str
    model_types: tuple[str, ...]  # mlx-lm model types whose checkpoints use this layout
    count_keys: tuple[str, ...]  # config fields giving the number of heads
    head_prefix: str
    fusion: tuple[tuple[str, str], ...]
    copies: tuple[tuple[str, str], ...] = ()  # per-head copies of the embedding / output head
    shared_prefix: str = ""  # non-empty: `fusion` lives here once, shared by every head
    order: str = "embed_hidden"  # the fused input: cat(embed, hidden) or "hidden_embed"
    zero_centred: bool = False  # raw checkpoints store RMSNorm gains as w - 1 (Qwen3-Next)
    count_default: int = 0  # heads when the config names none (vLLM's default for qwen3_next)
    cite: str = ""

    def prefix(self, num_layers: int, i: int) -> str:
        return self.head_prefix.format(n=num_layers + i, i=i)


_NEXTN = (
    ("embed_norm", "enorm.weight"),
    ("hidden_norm", "hnorm.weight"),
    ("proj", "eh_proj.weight"),
    ("out_norm", "shared_head.norm.weight"),
)
_NEXTN_COPIES = (("embed", "embed_tokens.weight"), ("head", "shared_head.head.weight"))

LAYOUTS = (
    Layout(
        "deepseek",
        ("deepseek_v3", "deepseek_v32", "glm4_moe"),
        ("num_nextn_predict_layers",),
        "model.layers.{n}.",
        _NEXTN,
        _NEXTN_COPIES,
        cite="vllm deepseek_mtp.py@03356f8c, glm4_moe_mtp.py@028aedf6",
    ),
    Layout(
        "qwen3_next",
        ("qwen3_next", "qwen3_5", "qwen3_5_moe"),
        ("num_nextn_predict_layers", "mtp_num_hidden_layers"),
        "mtp.layers.{i}.",
        (
            ("embed_norm", "pre_fc_norm_embedding.weight"),
            ("hidden_norm", "pre_fc_norm_hidden.weight"),
            ("proj", "fc.weight"),
            ("out_norm", "norm.weight"),
        ),
        shared_prefix="mtp.",
        zero_centred=True,
        count_default=1,
        cite="vllm qwen3_next_mtp.py@055e47c2, qwen3_5_mtp.py@01d99805",
    ),
    Layout(
        "mimo",
        ("mimo",),
        ("num_nextn_predict_layers",),
        "model.mtp_layers.{i}.",
        (
            ("embed_norm", "token_layernorm.weight"),
            ("hidden_norm", "hidden_layernorm.weight"),
            ("proj", "input_proj.weight"),
            ("out_norm", "final_layernorm.weight"),
        ),
        order="hidden_embed",
        cite="vllm mimo_mtp.py@0bb55d60",
    ),
)


def text_config(config: dict) -> dict:
    """The language model's config (Qwen3.5 nests it under text_config)."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def layout_for(config: dict) -> Layout | None:
    """The MTP layout of a model config's architecture, or None if it ships no MTP heads."""
    model_type = config.get("model_type")
    return next((lay for lay in LAYOUTS if model_type in lay.model_types), None)


def declared_count(layout: Layout, config: dict) -> int | None:
    """Heads the config declares (None: it names none)."""
    cfg = text_config(config)
    for key in layout.count_keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclass(frozen=True)
class MtpConfig:
    """mtp.json: what a drafter needs to rebuild and run the heads.

    `hidden_input`: the target state a head reads (the final normed hidden state, as vLLM feeds
    it and as DeepSeek's own modeling code does); `recycle`: what depth k+1 reads from depth k
    (the head's out_norm output); layouts.md gives the sources and the open disagreement."""

    layout: str
    model_type: str
    count: int
    hidden_size: int
    vocab_size: int
    block_layer: int  # the target decoder layer whose class and structure the block repeats
    order: str = "embed_hidden"
    shared_fusion: bool = False
    own_embed: bool = False
    own_head: bool = False
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"
    quantization: dict | None = None
    hidden_input: str = "final_norm"
    recycle: str = "out_norm"
    source: str = ""
    cite: str = ""
    format: int = FORMAT
    extra: dict = field(default_factory=dict)

    def describe(self) -> str:
        s = "s" if self.count != 1 else ""
        return f"{self.count} MTP head{s} ({self.layout} layout)"


def trunk_args(model: nn.Module) -> Any:
    """The decoder's ModelArgs (Qwen3.5 keeps them on its language model)."""
    return getattr(model, "language_model", model).args


def make_block(model: nn.Module, index: int) -> nn.Module:
    """A fresh decoder layer built as the target's layer `index` is (same class and arguments)."""
    # A layer the CPU kernels switched keeps mlx-lm's class here; the block is switched alone.
    cls = hooks.stock_class(model.layers[index])
    args = trunk_args(model)
    takes_index = len(inspect.signature(cls.__init__).parameters) > 2
    return cls(args, index) if takes_index else cls(args)


class MtpHead(nn.Module):
    """One MTP module: fuse (embedding, hidden state), run one decoder layer of the target's own
    kind with its own cache. Returns the layer's output (before out_norm), as the checkpoints'
    reference forward does; `normed` applies out_norm (the input of the output head)."""

    def __init__(self, block: nn.Module, cfg: MtpConfig, own_embed: bool, own_head: bool):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_norm = nn.RMSNorm(h, eps=eps)
        self.hidden_norm = nn.RMSNorm(h, eps=eps)
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.block = block
        self.out_norm = nn.RMSNorm(h, eps=eps)
        if own_embed:
            self.embed = nn.Embedding(cfg.vocab_size, h)
        if own_head:
            self.head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.hidden_first = cfg.order == "hidden_embed"

    def __call__(
        self, hidden: mx.array, embeds: mx.array, mask: Any = None, cache: Any = None
    ) -> mx.array:
        """hidden, embeds: (B, T, H) -> (B, T, H)."""
        e, h = self.embed_norm(embeds), self.hidden_norm(hidden)
        x = self.proj(mx.concatenate([h, e] if self.hidden_first else [e, h], axis=-1))
        return self.block(x, mask, cache)

    def normed(self, out: mx.array) -> mx.array:
        return self.out_norm(out)

    @staticmethod
    def make_mask(x: mx.array, cache: Any = None) -> Any:
        """The block's attention mask for x (B, T, H) after `cache`: always an array, since some
        layer classes (DeepSeek's MLA attention) take no "causal" shorthand."""
        from mlx_lm.models.base import create_attention_mask

        return create_attention_mask(x, cache, return_array=True)


def build_heads(model: nn.Module, cfg: MtpConfig) -> list[MtpHead]:
    """Empty heads shaped by the target (weights loaded by read_heads)."""
    return [
        MtpHead(make_block(model, cfg.block_layer), cfg, cfg.own_embed, cfg.own_head)
        for _ in range(cfg.count)
    ]


def quantize_heads(
    heads: list[MtpHead], quant: dict, weights: dict | None = None, predicate: Any = None
) -> None:
    """Quantize like the target: `quant` is an mlx-lm quantization config (group_size, bits,
    mode, and per-module overrides keyed heads.{i}.<path>). With `weights` (loading), exactly
    the modules that have scales there, as mlx-lm's loader decides; with `predicate(path,
    module)` (converting), what it says for each quantizable module."""
    for i, head in enumerate(heads):

        def choose(path: str, module: nn.Module, i: int = i) -> Any:
            full = f"heads.{i}.{path}"
            if not hasattr(module, "to_quantized"):
                return False
            if weights is not None:
                return f"{full}.scales" in weights and quant.get(full, True)
            if predicate is not None:
                return predicate(full, module)
            return module.weight.shape[-1] % quant["group_size"] == 0

        nn.quantize(
            head,
            group_size=quant["group_size"],
            bits=quant["bits"],
            mode=quant.get("mode", "affine"),
            class_predicate=choose,
        )


def read_config(path: Path) -> MtpConfig | None:
    """mtp.json of a model directory (None when the model keeps no MTP heads)."""
    meta = path / META
    if not meta.is_file():
        return None
    try:
        data = json.loads(meta.read_text())
        if data.get("format") != FORMAT:
            raise ModelError(f"{meta}: MTP format {data.get('format')!r}, this macspec reads 1")
        return MtpConfig(**data)
    except (OSError, ValueError, TypeError) as e:
        raise ModelError(f"{meta}: unreadable MTP description ({e})") from e


def summary(path: Path) -> str | None:
    """'2 MTP heads (deepseek layout)' for a model directory, or None."""
    try:
        cfg = read_config(path)
    except ModelError as e:
        return f"unreadable MTP heads ({e})"
    return cfg.describe() if cfg else None


def write(out: Path, cfg: MtpConfig, heads: list[MtpHead]) -> None:
    """mtp.safetensors + mtp.json into a model directory being written."""
    from mlx.utils import tree_flatten

    arrays = {}
    for i, head in enumerate(heads):
        arrays.update({f"heads.{i}.{k}": v for k, v in tree_flatten(head.parameters())})
    mx.save_safetensors(str(out / WEIGHTS), arrays, metadata={"format": "macspec-mtp"})
    (out / META).write_text(json.dumps(asdict(cfg), indent=1))


def read_heads(path: Path, model: nn.Module) -> tuple[MtpConfig, list[MtpHead]]:
    """The heads kept beside the model in `path`, built on the loaded target `model`; a missing,
    truncated or mismatched file is a ModelError naming it and the first key that differs."""
    cfg = read_config(path)
    if cfg is None:
        raise ModelError(
            f"{path} keeps no MTP heads ({META} is missing): convert the model again from a "
            "checkpoint that ships them (macspec convert SOURCE --mtp)"
        )
    args = trunk_args(model)
    if cfg.hidden_size != args.hidden_size or cfg.model_type != args.model_type:
        raise ModelError(
            f"{path / META} describes heads for a {cfg.model_type} of width {cfg.hidden_size}, "
            f"not this {args.model_type} of width {args.hidden_size}"
        )
    try:
        weights = mx.load(str(path / WEIGHTS))
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelError(f"cannot read {path / WEIGHTS}: {e}") from e
    heads = build_heads(model, cfg)
    if cfg.quantization:
        quantize_heads(heads, cfg.quantization, weights)
    expected = set()
    for i, head in enumerate(heads):
        expected |= _load_head(head, weights, i, path / WEIGHTS)
    extra = sorted(set(weights) - expected)
    if extra:
        raise ModelError(f"{path / WEIGHTS} holds '{extra[0]}', which no MTP head has")
    return cfg, heads


def _load_head(head: MtpHead, weights: dict, i: int, where: Path) -> set[str]:
    """Load head i from `weights`; returns the keys it took."""
    from mlx.utils import tree_flatten

    prefix = f"heads.{i}."
    want = dict(tree_flatten(head.parameters()))
    for name, value in want.items():
        got = weights.get(prefix + name)
        if got is None:
            raise ModelError(f"{where} lacks '{prefix}{name}' (a truncated MTP head)")
        if got.shape != value.shape:
            raise ModelError(
                f"{where}: '{prefix}{name}' has shape {list(got.shape)}, the head needs "
                f"{list(value.shape)}"
            )
    head.load_weights([(k, weights[prefix + k]) for k in want])
    mx.eval(head.parameters())
    return {prefix + k for k in want}


def drafter_factory(path: Path, model: nn.Module, vocab_size: int, accelerate: bool) -> Any:
    """`macspec.load(target, drafter="mtp")`: the heads kept beside the model in `path`, and a
    factory of fresh drafters over them (its argument: adaptive K); with `accelerate`, the heads'
    blocks switched as the target's layers are (core/hooks.py)."""
    from ..core.drafters.mtp import STOP_BELOW, MtpDrafter

    cfg, heads = read_heads(path, model)
    if accelerate:
        for head in heads:
            hooks.accelerate_layers(head, [head.block])
    recycle = cfg.recycle == "out_norm"
    log.info("%s: drafting with %s", path.name, cfg.describe())

    def make(adaptive: bool = True) -> Any:
        stop = STOP_BELOW if adaptive else 0.0
        return MtpDrafter(heads, model, vocab_size, recycle_normed=recycle, stop_below=stop)

    return cfg, make
