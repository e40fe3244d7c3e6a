"""Optional CPU acceleration: layer kernels (kernels.py), fused decoder layers (blocks.py), few-row
weight products (products.py) and the native extension they run on (native.py, csrc/).

`install()` puts it into the core through core/hooks.py; the core never imports it. This is
the only code that switches mlx-lm's classes. Every function checks that MLX runs on the CPU
and otherwise leaves mlx's own ops (Metal and CUDA have real kernels for all of this).
"""

from __future__ import annotations

import mlx.nn as nn

from ..core import hooks
from . import blocks, kernels, products


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
    }


HOOKS = hooks.Hooks(
    name="cpu",
    softmax=kernels.softmax,
    matmul_t=products.matmul_t,
    serial=kernels.serial,
    tree_positions=kernels.tree_positions,
    accelerate_model=kernels.accelerate,
    accelerate_layers=accelerate_draft,
    setup=setup,
)


def install() -> None:
    """Make this package the core's accelerator (core/hooks.py)."""
    hooks.install(HOOKS)


def installed() -> bool:
    return hooks.installed() is HOOKS
