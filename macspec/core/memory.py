"""Metal hygiene, as mlx-lm's generate.py has it: the models' memory wired while a generation runs,
and MLX's buffer cache emptied now and then. Both act on a GPU only: the CPU backend has no wired
memory, and there its buffer cache holds what the next pass reuses."""

from __future__ import annotations

import mlx.core as mx

# mlx-lm's own context manager (the field's code, kept as it is): it sets the device's
# recommended working set as the wired limit, and does nothing where the device recommends none.
from mlx_lm.generate import wired_limit

__all__ = ["CLEAR_EVERY", "CacheClearing", "clear_on_gpu", "on_gpu", "wired_limit"]

# Generated tokens between two mx.clear_cache() calls: mlx-lm's period (generate_step).
CLEAR_EVERY = 256


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def clear_on_gpu() -> None:
    """Empty MLX's buffer cache on a GPU (after a prompt's chunk, as mlx-lm's prefill does)."""
    if on_gpu():
        mx.clear_cache()


class CacheClearing:
    """mx.clear_cache() once per `every` generated tokens on a GPU: freed buffers of a growing
    context otherwise pile up in MLX's cache. `gpu`: None asks the default device."""

    def __init__(self, gpu: bool | None = None, every: int = CLEAR_EVERY) -> None:
        self.gpu = on_gpu() if gpu is None else gpu
        self.every = every
        self.due = every

    def after(self, generated: int) -> None:
        """Called after each round with the tokens generated so far."""
        if self.gpu and generated >= self.due:
            mx.clear_cache()
            self.due = (generated // self.every + 1) * self.every
