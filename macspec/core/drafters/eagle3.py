"""Published EAGLE-3 drafts (Li et al. 2025): the EAGLE authors', SpecForge and vLLM speculators
checkpoints, read by models/eagle3.py into one layout and run here.

    g   = fc(norm_in(cat(f_low, f_mid, f_high)))       target features of three layers
    x0  = cat(input_layernorm(e), hidden_norm(g))      attention over 2H, the embedding first
    h   = res + attn(x0), res = hidden_norm(g) if norm_before_residual else g;  h += mlp(...)
    out = further decoder layers (speculators);  logits = lm_head(norm(out)) (or of out)
    the next drafted position reads out (norm(out) with speculators' norm_output) in place of g

The draft's logits cover its own vocabulary (d2t: draft id -> target id). The drafter draws from
q over those ids and reports q on the target's whole vocabulary, 0 for the ids the draft lacks
(EagleDrafter._full), so the acceptance rule (verify.accept) stays exact at every temperature:
those ids are produced only by the residual max(0, p - q), exactly as the target samples them.

Feature taps: an EAGLE-3 layer id i names the *input* of target layer i (the authors'
modeling_llama_kv.py and vLLM's llama.py collect it before running layer i), i.e. the output of
layer i - 1, which Target(taps=...) keeps.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama, qwen3
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ...base.errors import ModelError
from .. import hooks
from ..target import language_model
from .eagle import STOP_BELOW, EagleDrafter

# models/eagle3.py's Eagle3Config (the core may not import the models): its fields by name.
Config = Any


def _args(c: Config) -> llama.ModelArgs | qwen3.ModelArgs:
    """mlx-lm ModelArgs of one draft decoder layer (width H)."""
    common = {
        "hidden_size": c.hidden_size,
        "num_hidden_layers": 1,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": json.loads(c.rope_scaling) if c.rope_scaling else None,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": 1,
    }
    if c.layer_type == "qwen3":
        return qwen3.ModelArgs(model_type="qwen3", tie_word_embeddings=False, **common)
    extra = {"attention_bias": c.attention_bias, "mlp_bias": c.mlp_bias}
    return llama.ModelArgs(model_type="llama", **common, **extra)


class FirstLayer(nn.Module):
    """EAGLE-3's layer 0 (`midlayer`): attention over cat(input_layernorm(e), hidden_norm(g))."""

    def __init__(self, c: Config):
        super().__init__()
        args, h = _args(c), c.hidden_size
        self.self_attn = (qwen3 if c.layer_type == "qwen3" else llama).Attention(args)
        bias = c.attention_bias
        a = self.self_attn
        a.q_proj = nn.Linear(2 * h, c.num_attention_heads * c.head_dim, bias=bias)
        a.k_proj = nn.Linear(2 * h, c.num_key_value_heads * c.head_dim, bias=bias)
        a.v_proj = nn.Linear(2 * h, c.num_key_value_heads * c.head_dim, bias=bias)
        self.mlp = llama.MLP(_args(c) if c.layer_type == "llama" else _llama_mlp_args(c))
        self.input_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.norm_before_residual = c.norm_before_residual

    def inputs(self, embeds: mx.array, g: mx.array) -> tuple[mx.array, mx.array]:
        """(the residual stream, the attention's input) of the layer."""
        normed = self.hidden_norm(g)
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        return (normed if self.norm_before_residual else g), x

    def __call__(
        self, embeds: mx.array, g: mx.array, mask: mx.array | str | None, cache: KVCache | None
    ) -> mx.array:
        residual, x = self.inputs(embeds, g)
        h = residual + self.self_attn(x, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def _llama_mlp_args(c: Config) -> llama.ModelArgs:
    """qwen3's MLP is llama's without biases: the same parameter names."""
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=c.hidden_size,
        num_hidden_layers=1,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps,
        vocab_size=1,
    )


class Eagle3Draft(nn.Module):
    """The draft under models/eagle3.py's internal names (load_weights strict). `taps`: the
    target layers Target keeps (ascending), `order`: for each of fc's inputs (the checkpoint's
    layer ids in their order) its tap's index."""

    def __init__(self, c: Config, taps: tuple[int, ...], order: tuple[int, ...]):
        super().__init__()
        if c.recycle_normed and not c.logits_norm:
            raise ModelError("an EAGLE-3 draft recycling norm(out) must apply norm to logits")
        h, ht = c.hidden_size, c.target_hidden_size
        self.feature_layers, self.order, self.target_hidden = taps, order, ht
        self.fc = nn.Linear(c.aux_count * ht, h, bias=c.fc_bias)
        if c.fc_norm:
            self.fc_norm = [nn.RMSNorm(ht, eps=c.rms_norm_eps) for _ in range(c.aux_count)]
        if c.norm_before_fc:
            self.input_norm = nn.RMSNorm(c.aux_count * ht, eps=c.rms_norm_eps)
        block = qwen3.TransformerBlock if c.layer_type == "qwen3" else llama.TransformerBlock
        self.layers = [FirstLayer(c)] + [block(_args(c)) for _ in range(c.num_layers - 1)]
        self.norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        if c.has_embed or c.tie_word_embeddings:
            self.embed_tokens = nn.Embedding(c.target_vocab_size, h)
        self.logits_norm, self.recycle_normed = c.logits_norm, c.recycle_normed

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def head_weight(self) -> mx.array:
        """(Vd, H): lm_head, or the tied embeddings (in float, quantized or not)."""
        layer = self.lm_head if "lm_head" in self else self.embed_tokens
        if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return mx.dequantize(
                layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits
            )
        return layer.weight

    def quantize(self, bits: int) -> None:
        """Quantize the weight products (fc, the layers, lm_head) to `bits` in mlx's affine
        groups of 64 (32 where a layer's width is not a multiple of 64; left in float where it
        is neither). The draft reads ~40M weights a token: in float32 that cost the 1.5B Qwen
        target's EAGLE-3 draft 0.13-0.19 of a target step on a CPU."""

        def group(path: str, m: nn.Module) -> dict | bool:
            if not isinstance(m, nn.Linear):
                return False
            width = m.weight.shape[-1]
            size = 64 if width % 64 == 0 else 32 if width % 32 == 0 else 0
            return {"group_size": size, "bits": bits} if size else False

        nn.quantize(self, class_predicate=group)

    def state(self, features: mx.array) -> mx.array:
        """g from the target's features (1, n, (taps + 1) * Ht): the taps in the checkpoint's
        order (the final features, last, are not read), normed as the format says, then fc."""
        ht = self.target_hidden
        parts = [features[..., i * ht : (i + 1) * ht] for i in self.order]
        if "fc_norm" in self:
            parts = [norm(p) for norm, p in zip(self.fc_norm, parts, strict=True)]
        x = mx.concatenate(parts, axis=-1)
        if "input_norm" in self:
            x = self.input_norm(x)
        return self.fc(x)

    def step(self, g: mx.array, embeds: mx.array, cache: list[KVCache] | None = None) -> mx.array:
        """The next position's state: out, or norm(out) (speculators' norm_output)."""
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(g, cache[0])
        x = self.layers[0](embeds, g, mask, cache[0])
        for layer, c in zip(self.layers[1:], cache[1:], strict=True):
            x = layer(x, mask, cache=c)
        return self.recycle(x)

    def first_input(self, embeds: mx.array, g: mx.array) -> tuple[mx.array, mx.array]:
        """Layer 0's residual stream and attention input (distill's unrolled training)."""
        return self.layers[0].inputs(embeds, g)

    def recycle(self, out: mx.array) -> mx.array:
        """The state the next drafted position reads of the last layer's output."""
        return self.norm(out) if self.recycle_normed else out

    def decode(self, state: mx.array) -> mx.array:
        """What lm_head reads of a step's output."""
        if self.logits_norm and not self.recycle_normed:
            return self.norm(state)
        return state

    def logits(self, state: mx.array, head: mx.array) -> mx.array:
        """Logits over the draft's own vocabulary (`head`, the target's rows, is not read)."""
        if isinstance(self.get("lm_head"), nn.QuantizedLinear):
            return self.lm_head(self.decode(state))
        return self.decode(state) @ self.head_weight().T


class DraftVocabParts:
    """The draft's own head over its vocabulary (the ids of `vocab_ids` the pair can produce)
    and the embeddings it reads (its own, or the target's)."""

    def __init__(self, draft: Eagle3Draft, target: nn.Module, vocab_ids: np.ndarray, vocab: int):
        keep = np.flatnonzero(vocab_ids < vocab)
        self.draft, self.target = draft, target
        self.vocab_ids = mx.array(vocab_ids[keep].astype(np.int32))
        # A quantized lm_head over ids all of which the pair can produce runs as it is (its
        # product switched as the layers'); else its rows for those ids, in float.
        whole = keep.size == vocab_ids.size
        quantized = whole and isinstance(draft.get("lm_head"), nn.QuantizedLinear)
        self.head: mx.array | None = None  # (Vd, H)
        if not quantized:
            weight = draft.head_weight().astype(mx.float32)
            self.head = mx.contiguous(mx.take(weight, mx.array(keep), axis=0))
        self.native = False
        # Target id -> column of the draft's logits, len(vocab_ids) for ids it lacks (for the
        # repetition penalty's windows, verify.make_dist).
        table = np.full(vocab, keep.size, np.int32)
        table[vocab_ids[keep]] = np.arange(keep.size, dtype=np.int32)
        self.lookup = mx.array(table)
        mx.eval(self.head if self.head is not None else [])

    def embed(self, ids: mx.array) -> mx.array:
        table = self.draft.embed_tokens if "embed_tokens" in self.draft else None
        if table is None:
            table = language_model(self.target).model.embed_tokens
        return table(ids).astype(mx.float32)

    def logits(self, features: mx.array) -> mx.array:
        if self.head is None:  # quantized
            return self.draft.lm_head(features)
        if self.native:
            return hooks.matmul_t(features, self.head)
        return features @ self.head.T


class Eagle3Drafter(EagleDrafter):
    """EagleDrafter's bookkeeping (pending features, rewinds, trees, the prompt cache) over a
    published EAGLE-3 draft."""

    name = "eagle3"
    summary = "a published EAGLE-3 draft reading three of the target's layers"
    state_kind = "eagle3"


def factory(
    draft: Eagle3Draft, vocab_ids: np.ndarray, target: nn.Module, vocab_size: int, accelerate: bool
) -> Callable[[bool], Eagle3Drafter]:
    """A fresh drafter per generation over `draft` (weights shared); with `accelerate`, its
    layers switched as the target's (hooks.py)."""
    if accelerate:
        hooks.accelerate_layers(draft, draft.blocks[1:])  # layer 0's attention is 2H wide
    parts = DraftVocabParts(draft, target, vocab_ids, vocab_size)
    parts.native = accelerate

    def make(adaptive: bool = True) -> Eagle3Drafter:
        return Eagle3Drafter(draft, parts, vocab_size, STOP_BELOW if adaptive else 0.0)

    return make
