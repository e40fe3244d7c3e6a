"""Feature drafts on disk (the EAGLE draft, core/drafters/eagle.py): a directory holding the
draft's own weights, its config.json (so that the store lists it as a model) and draft.json (its
kind, config and how it was made), written by `macspec distill` and read by `macspec.load`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import ModelError
from ..core.drafters.eagle import EagleDraft, EagleDrafter, draft_config, factory
from ..core.loaded import LoadedPair

WEIGHTS = "model.safetensors"  # the store lists a draft dir like a model: config.json + weights
META = "draft.json"


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
    layers = len(target.model.layers)
    if any(not 0 <= i < layers for i in draft.feature_layers):
        raise ModelError(
            f"the eagle draft in {path} reads target layers {list(draft.feature_layers)}, "
            f"but the target has {layers} layers"
        )
    return draft, vocab_ids, meta


def load_draft(path: Path, pair: LoadedPair) -> Callable[[bool], EagleDrafter]:
    """The factory macspec.load uses for a draft.json of kind "eagle": a fresh drafter per
    generation, sharing the weights and the target's embedding and head."""
    draft, vocab_ids, _ = read_draft_for(path, pair.target)
    return factory(draft, vocab_ids, pair.target, pair.vocab_size, pair.kernels)
