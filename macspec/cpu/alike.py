"""Which passes give each row a plain step's bits on the CPU (hooks.alike_rows): where every
layer runs macspec's native primitives, any number of rows; elsewhere mlx's own ops compute
several rows otherwise than one (docs/architecture.md, "Rows alike")."""

from __future__ import annotations

import logging

import mlx.nn as nn

from ..base import switches
from . import kernels, products
from .state import STATE

log = logging.getLogger("macspec.cpu")


def alike_rows(model: nn.Module) -> int | None:
    """hooks.alike_rows: where every layer of `model` runs on the native primitives (a
    llama/qwen2 trunk with a table RoPE, the products and layer kernels on), each product,
    norm and attention of any number of rows gives each row the bits it gets alone: None, no
    limit. Other layers run mlx's own ops, whose attention, masks and scans are computed
    otherwise for several rows than for one (tests/core/test_row_bits.py): then 1, unless
    switches.SPECULATE_UNALIKE lets them speculate (the default; said once, as a warning)."""
    if rows_alike(model):
        return None
    if not switches.SPECULATE_UNALIKE.value():
        return 1
    kind = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    if kind not in STATE.told:
        STATE.told.add(kind)
        log.warning(
            "%s: verification rows agree with a plain step to float rounding, not bit for bit, "
            "on this CPU (its layers run mlx's own ops): greedy output may differ from plain "
            "decoding at near-ties; %s=0 decodes it plainly",
            kind,
            switches.SPECULATE_UNALIKE,
        )
    return None


def rows_alike(model: nn.Module) -> bool:
    """Every decoder layer of `model` runs on the native primitives, which compute each row of
    a pass alone (blocks.py's fused layer, or the attention and MLP ops one by one)."""
    layers = list(getattr(getattr(model, "model", None), "layers", []) or [])
    return (
        products.active()
        and kernels.native_layers() is not None
        and bool(layers)
        and all(
            kernels.fusable(layer) and isinstance(STATE.rope(layer.self_attn), kernels.TableRoPE)
            for layer in layers
        )
    )
