"""What a backend's accelerator may replace in the core: a small, named interface whose defaults
are plain mlx, so that the core runs the same on Metal, CUDA and a CPU with nothing installed.

The CPU package (macspec/cpu) installs its own functions here on the CPU backend; nothing else
in the core knows it exists. Every hook computes what its default computes (to float rounding:
the CPU's softmax uses its own exp); which one runs is the only difference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..base import switches


def _softmax(x: mx.array, temperature: float = 1.0) -> mx.array:
    return mx.softmax(x / temperature if temperature != 1.0 else x, axis=-1)


def _argmax(x: mx.array) -> mx.array:
    return mx.argmax(x, axis=-1)


def inverse_cdf_mlx(probs: mx.array, u: mx.array) -> mx.array:
    """hooks.inverse_cdf in mlx's ops (the default, and an accelerator's fallback)."""
    total = mx.cumsum(probs, axis=-1)
    index = mx.sum(total <= u * total[:, -1:], axis=-1)
    # u * total can round up to the total itself: keep to the last id that has probability.
    last = probs.shape[-1] - 1 - mx.argmax(probs[:, ::-1] > 0, axis=-1)
    return mx.minimum(index, last).astype(mx.uint32)


def _matmul_t(x: mx.array, w: mx.array) -> mx.array:
    return x @ w.T


@contextmanager
def _no_positions(modules: list[nn.Module], positions: mx.array, end: int) -> Iterator[None]:
    yield


def _take_rows(module: nn.Module, name: str, ids: mx.array) -> mx.array:
    return mx.take(module[name], ids, axis=0)


def _unchanged(*args: Any) -> int:
    return 0


def _mlx_rows(model: nn.Module) -> int | None:
    """mlx's own kernels promise no row a plain step's bits beside others: Metal and CUDA pick
    their matmul, quantized and attention kernels by the number of rows (docs/architecture.md,
    "Rows alike"), so a pass holds one row where SPECULATE_UNALIKE is off; else any number."""
    return None if switches.SPECULATE_UNALIKE.value() else 1


def _rows_by_module(layer: nn.Module, x: mx.array, caches: list) -> None:
    return None


def _own_class(module: nn.Module) -> type:
    return type(module)


@dataclass(frozen=True)
class Hooks:
    """The replaceable parts, each with its plain-mlx default.

    - softmax(x, temperature): softmax(x / temperature) over the last axis of float32 rows (the
      sampling distribution's);
    - argmax(x): the first id of each float32 row's largest value, (rows, V) -> (rows,);
    - inverse_cdf(probs, u): per row of float32 probabilities (rows, V), the first id whose
      running sum exceeds u (rows, 1) times the row's sum, never an id of probability 0;
    - matmul_t(x, w): x @ w.T for a float32 matrix held outside any layer (the EAGLE head's rows);
    - take_rows(module, name, ids): rows `ids` of a layer's array `name` (weight, scales, biases,
      bias) in mlx's layout, for an accelerator that holds a layer's weights in one of its own;
    - serial(): a context in which each forward pass is built whole before it is evaluated (a
      round times the drafts apart from the verification graph's build);
    - tree_positions(modules, positions, end): a context in which these attention modules rotate
      row r at positions[r] (a token tree's pass; `end`: past the deepest), for an accelerator
      that rotates rows itself instead of calling the module's `rope`;
    - accelerate_model(model): switch a loaded model's layers to faster ones; how many changed;
    - accelerate_layers(module, layers): the same for a drafter's own decoder layers (and the
      products of `module`);
    - setup(): what of the accelerator is active, as plain data (measured costs depend on it);
    - alike_rows(model): the most ids one pass of `model` may hold for each row's results to be
      the very bits that row gets in a pass of its own (None: any number);
    - rows_layer(layer, x, caches): a decoder layer's output in a shared pass (batch.py), the
      block x (B, W, hidden), row r fed after its own cache caches[r] (its padding after its
      real ids), each row's real ids getting the bits they get alone; None where the
      accelerator cannot (the core then runs each row's attention through the module);
    - prefill_chunk: the ids a prompt is read in at a time (caches.prefill, Target.start):
      one size wherever a prompt is read, so the same chunks give the same bits; it divides
      loop.READ_CHUNK, the turns a reported reading takes."""

    name: str = "mlx"
    softmax: Callable[..., mx.array] = _softmax
    argmax: Callable[[mx.array], mx.array] = _argmax
    inverse_cdf: Callable[[mx.array, mx.array], mx.array] = inverse_cdf_mlx
    matmul_t: Callable[[mx.array, mx.array], mx.array] = _matmul_t
    take_rows: Callable[[nn.Module, str, mx.array], mx.array] = _take_rows
    serial: Callable[[], AbstractContextManager] = nullcontext
    tree_positions: Callable[[list, mx.array, int], AbstractContextManager] = _no_positions
    accelerate_model: Callable[[nn.Module], int] = _unchanged
    accelerate_layers: Callable[[nn.Module, list], int] = _unchanged
    setup: Callable[[], dict] = field(default=dict)
    alike_rows: Callable[[nn.Module], int | None] = _mlx_rows
    rows_layer: Callable[[nn.Module, mx.array, list], mx.array | None] = _rows_by_module
    stock_class: Callable[[nn.Module], type] = _own_class
    prefill_chunk: int = 512


_installed = Hooks()


def install(hooks: Hooks) -> Hooks:
    """Make `hooks` the core's; returns the ones they replace."""
    global _installed
    old, _installed = _installed, hooks
    return old


def installed() -> Hooks:
    return _installed


def prefill_chunk() -> int:
    return _installed.prefill_chunk


def softmax(x: mx.array, temperature: float = 1.0) -> mx.array:
    return _installed.softmax(x, temperature)


def argmax(x: mx.array) -> mx.array:
    return _installed.argmax(x)


def inverse_cdf(probs: mx.array, u: mx.array) -> mx.array:
    return _installed.inverse_cdf(probs, u)


def matmul_t(x: mx.array, w: mx.array) -> mx.array:
    return _installed.matmul_t(x, w)


def take_rows(module: nn.Module, name: str, ids: mx.array) -> mx.array:
    return _installed.take_rows(module, name, ids)


def serial() -> AbstractContextManager:
    return _installed.serial()


def tree_positions(modules: list, positions: mx.array, end: int) -> AbstractContextManager:
    return _installed.tree_positions(modules, positions, end)


def accelerate_model(model: nn.Module) -> int:
    return _installed.accelerate_model(model)


def accelerate_layers(module: nn.Module, layers: list) -> int:
    return _installed.accelerate_layers(module, layers)


def setup() -> dict:
    return _installed.setup()


def alike_rows(model: nn.Module) -> int | None:
    return _installed.alike_rows(model)


def rows_layer(layer: nn.Module, x: mx.array, caches: list) -> mx.array | None:
    return _installed.rows_layer(layer, x, caches)


def stock_class(module: nn.Module) -> type:
    return _installed.stock_class(module)
