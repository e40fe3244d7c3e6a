"""Optional CPU acceleration: layer kernels (kernels.py), fused decoder layers (blocks.py), few-row
weight products (products.py) and the native extension they run on (native.py, csrc/).

`install()` puts it into the core through core/hooks.py (loading a model does, through
`install_default()`); the core never imports it. This is the only code that switches mlx-lm's
classes; what it keeps as it runs is in state.py. Every function checks that MLX runs on the CPU
and otherwise leaves mlx's own ops (Metal and CUDA have real kernels for all of this).
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

import mlx.nn as nn

from ..core import hooks
from . import alike, blocks, kernels, products, rows, sample
from .state import STATE


def accelerate_draft(module: nn.Module, layers: list) -> int:
    """A drafter's own decoder layers as the target's are switched, and every weight product of
    `module`; returns how many layers changed."""
    changed = kernels.accelerate_layers(layers)
    kernels.switch_products(module)
    return changed


def setup() -> dict:
    """What of this package is in use now, as plain data (kept costs are measured per setup)."""
    return {
        "native_layers": kernels.native_layers() is not None,
        "native_blocks": blocks.enabled(),
        "native_products": products.active(),
        # Kernels changed, or how quantized weights run: costs measured before do not hold.
        "native_build": STATE.ext_build,
        "int8_activations": STATE.int8_activations,
        "repack": STATE.repack_weights,
        # Which pass takes which kernel is decided here (a 17-row pass left the native ones
        # before 2026-12-02): changed, measured again.
        "routing": _routing(),
    }


@cache
def _routing() -> str:
    return hashlib.sha256(
        b"".join(Path(m.__file__).read_bytes() for m in (kernels, products, blocks))
    ).hexdigest()[:16]


HOOKS = hooks.Hooks(
    name="cpu",
    softmax=kernels.softmax,
    argmax=sample.argmax,
    inverse_cdf=sample.inverse_cdf,
    matmul_t=products.matmul_t,
    take_rows=products.take_rows,
    serial=kernels.serial,
    # A token tree's pass: the table RoPE rotates consecutive rows, so the switched attentions
    # run their native path with each row at its own position, their mlx path with the module's
    # `rope` (core/tree.py replaces it).
    tree_positions=STATE.tree_positions,
    accelerate_model=kernels.accelerate,
    accelerate_layers=accelerate_draft,
    setup=setup,
    alike_rows=alike.alike_rows,
    rows_layer=rows.rows_layer,
    stock_class=STATE.stock_class,
    # 256-id chunks: a 512-id chunk's rows spill a core's second-level cache in the products
    # and attention (prefill 4% faster at 4,096 ids on a Zen 4, docs/cpu.md)
    prefill_chunk=256,
)


def install() -> None:
    """Make this package the core's accelerator (core/hooks.py)."""
    hooks.install(HOOKS)


def install_default() -> None:
    """install(), where the core still has its plain defaults: what loading a model does
    (api/loading.py), leaving hooks that someone installed (a test's, a replacement) alone.
    A malformed switch read at import is its OptionError here (State.check)."""
    STATE.check()
    if hooks.installed() == hooks.Hooks():
        install()


def installed() -> bool:
    return hooks.installed() is HOOKS
