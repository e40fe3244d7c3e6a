"""A feature-level draft (EAGLE, Li et al. 2024): one decoder layer that reads the target's own
final hidden state and the next token's embedding, predicts the next hidden state, and turns it
into tokens through the target's output head (rows cut to the ids the draft may propose).

Why this kind (SmolLM2-135M target, issue 7): a from-scratch small draft (15.7M parameters)
reached 0.35 top-1 agreement after 124K tokens, far below the ~0.7 that K=4 needs. Reusing the
target's features, embeddings and head leaves only "feature + next token -> next feature" to learn,
with 4.2M parameters and a step of ~6% of a target step. Measured here (held-out top-1
agreement, first / second draft token): 0.30 / 0.19 after 48K tokens, 0.46 / 0.42 after 335K
tokens with --unroll 2 (0.011 before training); still rising with data, and EAGLE drafts are known
to reach 0.7-0.8 with more (--tokens in the millions, practical on a GPU).

Draft position t reads (f_t, e(x_{t+1})), where f_t is the target's hidden state after x_t, and
outputs g_t ~ f_{t+1}, whose logits predict x_{t+2}. While drafting, g feeds the next position in
place of the target's feature; after verification the target's real features replace them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, trim_prompt_cache

from .drafters import DistFn, Proposal
from .errors import ModelError
from .sampling import sample

WEIGHTS = "model.safetensors"  # the store lists a draft dir like a model: config.json + weights
META = "draft.json"
# Draft confidence (its own probability of the token, temperature 1) below which adaptive drafting
# stops a proposal early: a doubtful token is rarely accepted and every later one depends on it.
STOP_BELOW = 0.3


def draft_config(target: nn.Module) -> dict[str, Any]:
    """The draft's decoder layer mirrors one layer of the target (same widths and RoPE)."""
    a = target.args
    heads = a.num_attention_heads
    return {
        "hidden_size": a.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(a, "num_key_value_heads", None) or heads,
        "head_dim": getattr(a, "head_dim", None) or a.hidden_size // heads,
        "intermediate_size": a.intermediate_size,
        "rms_norm_eps": float(getattr(a, "rms_norm_eps", 1e-5)),
        "rope_theta": float(getattr(a, "rope_theta", 10000.0)),
        "vocab_size": int(a.vocab_size),  # the target's rows, for `macspec check`
    }


class EagleDraft(nn.Module):
    """fc([norm(e), norm(f)]) -> one llama decoder layer -> predicted next feature."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        h = config["hidden_size"]
        args = llama.ModelArgs(
            model_type="llama",
            hidden_size=h,
            num_hidden_layers=1,
            intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=config["rope_theta"],
            vocab_size=1,
        )
        # Features are standardised with the target's per-dimension mean and spread (set from
        # the training data by init_from_features) and predicted in that space: the target's
        # features hold a few huge, nearly constant dimensions that an RMS norm would let dominate
        # everything. Measured on SmolLM2: with RMS norms in and out, training stalled near 4%
        # agreement, predicting one constant distribution.
        self.embed_norm = nn.RMSNorm(h, eps=config["rms_norm_eps"])
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = llama.TransformerBlock(args)
        self.feature_mean = mx.zeros((h,))
        self.feature_std = mx.ones((h,))
        self.freeze(keys=["feature_mean", "feature_std"], recurse=False)

    def init_from_features(self, mean: mx.array, std: mx.array) -> None:
        self.feature_mean = mean.astype(mx.float32)
        self.feature_std = std.astype(mx.float32)

    def __call__(
        self, features: mx.array, embeds: mx.array, cache: KVCache | None = None
    ) -> mx.array:
        z = (features - self.feature_mean) / self.feature_std
        x = self.fc(mx.concatenate([self.embed_norm(embeds), z], -1))
        out = self.layer(x, create_attention_mask(x, cache), cache=cache)
        return self.feature_mean + self.feature_std * out


class TargetParts:
    """What the draft borrows from the target: the input embedding and the output head's rows
    for the draft's vocabulary, in float32 (the fast type on CPUs; MLX casts on GPUs too)."""

    def __init__(self, target: nn.Module, vocab_ids: mx.array):
        from .engine import output_head

        self.target = target
        self.vocab_ids = vocab_ids  # (Vd,) target ids the draft can propose
        h = target.args.hidden_size
        # The head applied to the identity gives its weight whatever its form (tied, untied,
        # quantized); only the draft's rows are kept.
        rows = output_head(target, mx.eye(h, dtype=mx.float32))  # (H, V)
        self.head = mx.take(rows.astype(mx.float32), vocab_ids, axis=1).T  # (Vd, H)
        mx.eval(self.head)

    def embed(self, ids: mx.array) -> mx.array:
        return self.target.model.embed_tokens(ids).astype(mx.float32)

    def logits(self, features: mx.array) -> mx.array:
        return features @ self.head.T


class EagleDrafter:
    """Drafter protocol (macspec/drafters.py) over an EagleDraft.

    The draft cache holds positions whose input pair used a real target feature; `pending` holds
    real (feature, next id) pairs not fed yet. A proposal feeds them, then drafts on its own
    predicted features; commit() rewinds the predicted positions and queues the target's real
    features for the kept ids (EAGLE recomputes them the same way)."""

    name = "eagle"
    needs_hidden = True

    def __init__(
        self, draft: EagleDraft, parts: TargetParts, vocab_size: int, stop_below: float = 0.0
    ):
        self.draft, self.parts, self.vocab_size = draft, parts, vocab_size
        self.stop_below = stop_below
        self.cache = KVCache()
        self.pending_f: list[mx.array] = []  # (n, H) real features
        self.pending_ids: list[int] = []  # the id that follows each pending feature
        self._offset = 0
        self._fed = 0  # pending pairs fed by the current proposal
        self._proposed = False

    def _queue(self, hidden: mx.array | None, ids: list[int]) -> None:
        if hidden is None or hidden.shape[0] != len(ids):
            got = None if hidden is None else hidden.shape[0]
            raise ModelError(f"the eagle draft needs {len(ids)} target hidden states, got {got}")
        if ids:
            self.pending_f.append(hidden.astype(mx.float32))
            self.pending_ids += ids

    def start(self, prompt: list[int], hidden: mx.array | None = None) -> None:
        self.cache = KVCache()
        self.pending_f, self.pending_ids = [], []
        self._proposed = False
        # Prompt position t pairs the target's feature f_t with the id x_{t+1}.
        self._queue(hidden, prompt[1:])

    def _full_logits(self, feature: mx.array) -> mx.array:
        """(1, vocab_size) logits; ids outside the draft's vocabulary get -inf (q = 0 there)."""
        small = self.parts.logits(feature)
        full = mx.full((1, self.vocab_size), -mx.inf, dtype=mx.float32)
        return mx.put_along_axis(full, self.parts.vocab_ids[None], small, axis=-1)

    def label(self) -> None:
        return None

    def propose(self, k: int, dist: DistFn, key: mx.array) -> Proposal:
        self._offset, self._proposed = self.cache.offset, True
        self._fed = len(self.pending_ids)
        if not self.pending_ids:  # cannot happen after the engine's first plain step
            raise ModelError("the eagle draft has no target feature to draft from")
        feats = mx.concatenate(self.pending_f)[None]
        embeds = self.parts.embed(mx.array(self.pending_ids, dtype=mx.int32))[None]
        tokens, probs = [], []
        for i, subkey in enumerate(mx.random.split(key, k)):
            g = self.draft(feats, embeds, self.cache)[:, -1:]  # (1, 1, H) predicted feature
            logits = self._full_logits(g[0])
            drafted = mx.concatenate(tokens) if tokens else None
            q = dist(logits, drafted, i)
            token = sample(q, subkey)
            tokens.append(token)
            probs.append(q)
            if i + 1 == k:
                break
            if self.stop_below > 0:
                confidence = mx.softmax(logits[0], axis=-1)[token[0]]
                if confidence.item() < self.stop_below:
                    break
            feats, embeds = g, self.parts.embed(token)[None]
        return Proposal(mx.concatenate(tokens), mx.concatenate(probs))

    def commit(
        self, k: int, accepted: int, emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        if k > 0 and self._proposed:
            # Keep the positions fed with real features; drop those fed with predicted ones.
            trim_prompt_cache([self.cache], self.cache.offset - (self._offset + self._fed))
            self.pending_f, self.pending_ids = [], []
        self._proposed = False
        # The kept positions (the previous last id and the accepted drafts) and their next ids.
        self._queue(hidden, emitted)

    def abort(self, k: int) -> None:
        if self._proposed:
            trim_prompt_cache([self.cache], self.cache.offset - self._offset)
        self._proposed = False


# ---------------------------------------------------------------- files


def save_draft(
    path: Path, draft: EagleDraft, vocab_ids: list[int], config: dict, extra: dict | None = None
) -> None:
    """Write the draft's own weights (float16), config.json and draft.json into `path`."""
    path.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in _flat(draft).items()}
    weights["vocab_ids"] = mx.array(vocab_ids, dtype=mx.int32)
    mx.save_safetensors(str(path / WEIGHTS), weights, metadata={"format": "macspec-eagle"})
    meta = {"kind": "eagle", "config": config, "vocab_size": len(vocab_ids), **(extra or {})}
    (path / META).write_text(json.dumps(meta, indent=1))
    # config.json makes the directory a model for the store (`macspec models`); mlx-lm never
    # loads it: macspec.load sees draft.json first.
    (path / "config.json").write_text(json.dumps({"model_type": "eagle-draft", **config}, indent=1))


def _flat(module: nn.Module) -> dict[str, mx.array]:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(module.parameters()))


def read_draft(path: Path) -> tuple[EagleDraft, mx.array, dict]:
    """(draft in float32, vocabulary ids, draft.json) from a draft directory."""
    try:
        meta = json.loads((path / META).read_text())
        weights = mx.load(str(path / WEIGHTS))
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelError(f"cannot read the eagle draft in {path}: {e}") from e
    try:
        draft = EagleDraft(meta["config"])
        vocab_ids = weights.pop("vocab_ids")
        draft.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()], strict=True)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelError(f"the eagle draft in {path} is malformed: {e}") from e
    mx.eval(draft.parameters())
    return draft, vocab_ids, meta


def read_draft_for(path: Path, target: nn.Module) -> tuple[EagleDraft, mx.array, dict]:
    """read_draft, refusing a draft made for a target of another width."""
    draft, vocab_ids, meta = read_draft(path)
    expected = draft_config(target)
    if meta["config"]["hidden_size"] != expected["hidden_size"]:
        raise ModelError(
            f"the eagle draft in {path} was trained for hidden size "
            f"{meta['config']['hidden_size']}, but the target has {expected['hidden_size']}"
        )
    return draft, vocab_ids, meta


def load_draft(path: Path, pair: Any) -> Callable[[bool], EagleDrafter]:
    """The factory macspec.load uses for a draft.json of kind "eagle": a fresh drafter per
    generation, sharing the weights and the target's embedding and head."""
    draft, vocab_ids, meta = read_draft_for(path, pair.target)
    vocab_ids = mx.array([i for i in vocab_ids.tolist() if i < pair.vocab_size], dtype=mx.int32)
    parts = TargetParts(pair.target, vocab_ids)

    def make(adaptive: bool = True) -> EagleDrafter:
        return EagleDrafter(draft, parts, pair.vocab_size, STOP_BELOW if adaptive else 0.0)

    return make
