"""`--draft PATH` for a published EAGLE-3 draft (models/eagle3.py reads the three layouts): the
checkpoint checked against the target, built as core/drafters/eagle3.py's module, and the
factory of its drafters."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from ..base import switches
from ..base.errors import ModelError
from ..core.drafters.eagle3 import Eagle3Draft, Eagle3Drafter, factory
from ..core.loaded import LoadedPair
from .eagle3 import Eagle3Checkpoint, aux_layers, check_target, load


def taps_for(ids: tuple[int, ...], where: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The target layers to tap for EAGLE-3 layer ids (id i reads layer i-1's output), ascending
    and unique, and for each id in the checkpoint's order the index of its tap."""
    if 0 in ids:
        raise ModelError(
            f"{where} reads the input of target layer 0 (the embeddings), which macspec does "
            "not tap"
        )
    taps = tuple(sorted({i - 1 for i in ids}))
    return taps, tuple(taps.index(i - 1) for i in ids)


def read_for(
    path: Path, pair: LoadedPair
) -> tuple[Eagle3Checkpoint, tuple[int, ...], tuple[int, ...]]:
    """(checkpoint, taps, order) of the EAGLE-3 draft in `path`, refused (ModelError naming what
    differs) when made for another target than `pair`'s."""
    ckpt = load(path)
    config_file = Path(pair.target_path) / "config.json"
    try:
        target_config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {config_file}: {e}") from e
    check_target(ckpt, target_config, str(pair.target_path))
    taps, order = taps_for(aux_layers(ckpt.config, len(pair.target.layers)), path)
    return ckpt, taps, order


def fill(draft: Eagle3Draft, ckpt: Eagle3Checkpoint, *extra: tuple[str, mx.array]) -> None:
    """Load the checkpoint's weights (as float32) into `draft`, every one and nothing else
    (`extra`: the module's own parameters besides them); ModelError naming the directory
    where they do not fit its config."""
    weights = [(k, v.astype(mx.float32)) for k, v in ckpt.weights.items()]
    try:
        draft.load_weights(weights + list(extra), strict=True)
    except ValueError as e:
        raise ModelError(f"the EAGLE-3 draft in {ckpt.path} does not fit its config: {e}") from e


def load_draft(path: Path, pair: LoadedPair) -> Callable[[bool], Eagle3Drafter]:
    """The factory macspec.load uses for an EAGLE-3 draft directory: refused (ModelError naming
    what differs) when made for another target."""
    ckpt, taps, order = read_for(path, pair)
    draft = Eagle3Draft(ckpt.config, taps, order)
    fill(draft, ckpt)
    bits = switches.DRAFT_BITS.value()
    if bits != "float":
        draft.quantize(int(bits))
    mx.eval(draft.parameters())
    return factory(draft, ckpt.d2t, pair.target, pair.vocab_size, pair.kernels)
