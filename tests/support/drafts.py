"""An untrained EAGLE-style draft for the tiny targets (the EAGLE, batch, tree, prompt cache and
plain-ahead tests)."""

import shutil

import mlx.core as mx

import macspec
from macspec.core.drafters.eagle import EagleDraft, draft_config
from macspec.models.draft_files import save_draft


def make_draft(path, target_dir, *, seed=1, vocab_ids=None, noise=0.3, feature_layers=(), layers=1):
    """An untrained eagle draft that guesses "the next token repeats the last one": fc passes the
    (normed) feature through and the layer adds only small random terms. Tiny random targets
    repeat themselves often enough that such a draft is accepted part of the time.
    `feature_layers`: the draft also reads those target layers (through a noisy projection);
    `layers`: decoder layers stacked, each adding small random terms."""
    target = macspec.load(target_dir).target
    config = draft_config(target, feature_layers, layers)
    mx.random.seed(seed)
    draft = EagleDraft(config)
    h = config["hidden_size"]
    identity = mx.concatenate([mx.zeros((h, h)), mx.eye(h)], axis=1)
    draft.fc.weight = identity + noise * draft.fc.weight
    draft.fc.bias = mx.zeros((h,))
    if feature_layers:  # the tapped layers matter: a noisy mix of them and the final features
        width = h * (len(feature_layers) + 1)
        final = mx.concatenate([mx.zeros((h, width - h)), mx.eye(h)], axis=1)
        draft.proj.weight = final + noise * mx.random.normal((h, width)) / width**0.5
    for block in draft.blocks:
        block.self_attn.o_proj.weight = noise * block.self_attn.o_proj.weight
        block.mlp.down_proj.weight = noise * block.mlp.down_proj.weight
    ids = vocab_ids if vocab_ids is not None else list(range(config["vocab_size"]))
    save_draft(path, draft, ids, config, {"target": "tiny"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_dir / name, path / name)
    return path
