"""`--kind eagle3`: distill trains a draft in EAGLE-3's published architecture (Li et al. 2025)
and writes it in vLLM speculators' layout (fused `fc`, the `midlayer` that attends over the
token's embedding joined with the state, its own `lm_head` over the draft's ids, `d2t`/`t2d`).
macspec then loads it through models/eagle3_draft.py, the code that runs downloaded drafts, so
what distill makes is what vLLM, SGLang or the EAGLE authors' code would run too.

Training differs from a published draft in one place, undone on export: fc reads the target's
features divided by their per-dimension RMS. The residual stream holds a few dimensions in the
thousands (Qwen2.5's layers 13 and 24: ~2,960 against an RMS of ~5), where Adam's equal-sized
steps would swamp everything else. fc(x / s) = (W / s) x, so the exported fc is exact.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ...base.errors import ModelError, OptionError
from ...core.drafters.eagle3 import Eagle3Draft
from ...models.eagle3 import Eagle3Checkpoint, Eagle3Config, aux_layers
from ...models.eagle3_draft import fill, read_for
from ...models.store import resolve_model

FORMAT = "speculators"


def eagle3_taps(num_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs EAGLE-3 reads by default: the inputs of layers 2, L // 2
    and L - 3 (models/eagle3.aux_layers), i.e. the outputs of the layers before them."""
    if num_layers < 2:
        raise OptionError("an EAGLE-3 draft reads the target's layers: this one has one layer")
    # Clamped into the layers there are, for targets too shallow for the default (tests' own).
    ids = (2, num_layers // 2, num_layers - 3)
    return tuple(sorted({min(max(i - 1, 0), num_layers - 2) for i in ids}))


def eagle3_config(
    pair: Any, taps: tuple[int, ...], layers: int, mlp: int | None, vocab_ids: list[int]
) -> Eagle3Config:
    """A llama-layer EAGLE-3 draft as wide as the target (it reads the target's embeddings),
    with `mlp` as its MLP width (default the target's)."""
    a = pair.target.args
    heads = a.num_attention_heads
    ids = tuple(t + 1 for t in taps)
    config = Eagle3Config(
        format=FORMAT,
        hidden_size=a.hidden_size,
        target_hidden_size=a.hidden_size,
        intermediate_size=mlp or a.intermediate_size,
        num_attention_heads=heads,
        # foreign: mlx-lm's ModelArgs differ by architecture (the fields some lack default)
        num_key_value_heads=getattr(a, "num_key_value_heads", None) or heads,
        head_dim=getattr(a, "head_dim", None) or a.hidden_size // heads,  # foreign: as above
        num_layers=layers,
        rms_norm_eps=float(getattr(a, "rms_norm_eps", 1e-6)),  # foreign: as above
        rope_theta=float(getattr(a, "rope_theta", 10000.0)),  # foreign: as above
        rope_scaling=None,
        max_position_embeddings=int(pair.context_length),
        layer_type="llama",
        attention_bias=False,
        mlp_bias=False,
        draft_vocab_size=len(vocab_ids),
        target_vocab_size=int(a.vocab_size),  # the target's rows (the tokenizer may know fewer)
        aux_layer_ids=ids,
        norm_before_residual=False,
        fc_norm=False,
        norm_before_fc=False,
        logits_norm=True,
        recycle_normed=False,
        fc_bias=False,
        tie_word_embeddings=False,
        has_embed=False,
        target_architectures=tuple(_architectures(pair)),
        target_name=pair.target_path.name,
    )
    # The default layers are written as no choice at all, which the EAGLE authors' layout
    # (it has no such key) can hold too.
    if aux_layers(replace(config, aux_layer_ids=()), len(pair.target.model.layers)) == ids:
        return replace(config, aux_layer_ids=())
    return config


def _architectures(pair: Any) -> list[str]:
    import json

    try:
        return list(json.loads((pair.target_path / "config.json").read_text())["architectures"])
    except (OSError, ValueError, KeyError):
        return []


class TrainableEagle3(Eagle3Draft):
    """An Eagle3Draft whose fc reads the features over their per-dimension RMS (frozen)."""

    def __init__(self, config: Eagle3Config, taps: tuple[int, ...], scale: mx.array):
        super().__init__(config, taps, tuple(range(len(taps))))
        self.config = config
        self.feature_scale = scale
        self.freeze(keys=["feature_scale"], recurse=False)

    def state(self, features: mx.array) -> mx.array:
        return super().state(features / self.feature_scale)

    def with_scale(self, scale: mx.array) -> TrainableEagle3:
        """The same draft reading the features over `scale` instead: fc's columns are multiplied
        by scale / the old scale, so it computes what it did (up to rounding)."""
        ht = self.target_hidden
        ratio = scale / self.feature_scale
        columns = mx.concatenate([ratio[i * ht : (i + 1) * ht] for i in self.order])
        draft = TrainableEagle3(self.config, self.feature_layers, scale)
        weights = {k: v for k, v in tree_flatten(self.parameters()) if k != "feature_scale"}
        weights["fc.weight"] = self.fc.weight * columns[None, :]
        draft.load_weights(list(weights.items()), strict=False)
        mx.eval(draft.parameters())
        return draft

    def checkpoint(self, vocab_ids: list[int]) -> Eagle3Checkpoint:
        """The published draft: fc folded with the scale, the other weights as trained."""
        weights = {k: v for k, v in tree_flatten(self.parameters()) if k != "feature_scale"}
        ht = self.target_hidden
        columns = [self.feature_scale[i * ht : (i + 1) * ht] for i in self.order]
        weights["fc.weight"] = self.fc.weight / mx.concatenate(columns)[None, :]
        ids = np.asarray(vocab_ids, dtype=np.int64)
        return Eagle3Checkpoint(self.config, weights, ids, Path(self.config.target_name or "."))


# What training assumes of a draft it continues, as distill's own drafts have it (eagle3_config):
# it embeds with the target's table, and fc reads the tapped states as they are, in ascending
# order (a per-tap norm before fc would undo the feature scale).
_TRAINABLE = {
    "layer_type": "llama",
    "has_embed": False,
    "tie_word_embeddings": False,
    "fc_norm": False,
    "norm_before_fc": False,
}


def read_init(init: str, pair: Any) -> tuple[TrainableEagle3, list[int], Path]:
    """(draft, vocabulary ids, directory) of the EAGLE-3 draft a run continues (--init): read by
    the code that loads downloaded drafts, checked against the target, and computing what that
    draft computes (a unit feature scale until the data's replaces it, with_scale). ModelError
    naming the directory for one made for another target or of a shape distill cannot train."""
    path = resolve_model(init)
    ckpt, taps, order = read_for(path, pair)
    c = ckpt.config
    odd = [f"{k}={getattr(c, k)!r}" for k, v in _TRAINABLE.items() if getattr(c, k) != v]
    if order != tuple(range(len(taps))):
        odd.append(f"target layers read in the order {[taps[i] + 1 for i in order]}")
    if odd:
        raise ModelError(
            f"{path}: distill continues EAGLE-3 drafts of the shape it writes; this one has "
            + ", ".join(odd)
        )
    draft = TrainableEagle3(c, taps, mx.ones(((len(taps) + 1) * c.target_hidden_size,)))
    fill(draft, ckpt, ("feature_scale", draft.feature_scale))
    mx.eval(draft.parameters())
    return draft, [int(i) for i in ckpt.d2t], path


def feature_scale(data: Any) -> mx.array:
    """The features' per-dimension RMS over the data, which fc reads them over."""
    mean, std = data.feature_stats()
    return mx.sqrt(mean * mean + std * std)


def new_draft(config: Eagle3Config, taps: tuple[int, ...], data: Any, head: mx.array) -> Any:
    """A fresh draft: the feature scale from the data, lm_head starting as the target's own rows
    for the draft's ids (`head`), the rest initialised as mlx does."""
    draft = TrainableEagle3(config, taps, feature_scale(data))
    draft.lm_head.weight = head.astype(mx.float32)
    mx.eval(draft.parameters())
    return draft
