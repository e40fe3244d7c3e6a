"""Picking ids from a whole vocabulary's rows on the CPU (core/hooks.py's argmax and
inverse_cdf): the native primitives of csrc/cpu_sample.cpp on every core where the extension is
built, else mlx's ops. The softmax that comes before them is kernels.softmax."""

from __future__ import annotations

import mlx.core as mx

from ..core import hooks
from .kernels import native_layers
from .products import on_cpu


def argmax(x: mx.array) -> mx.array:
    """hooks.argmax: over the last axis of (rows, V) float32 rows, on every core where the
    native primitive is built (mlx's runs on one core, a large share of a step's sampling)."""
    ext = native_layers()
    if ext is not None and on_cpu() and x.ndim == 2 and x.dtype == mx.float32 and x.shape[1]:
        return ext.argmax(x)
    return mx.argmax(x, axis=-1)


def inverse_cdf(probs: mx.array, u: mx.array) -> mx.array:
    """hooks.inverse_cdf on every core where the native primitive is built (mlx's cumulative
    sum runs on one core)."""
    ext = native_layers()
    if ext is not None and on_cpu() and probs.ndim == 2 and probs.shape[1]:
        return ext.sample(probs.astype(mx.float32), u.astype(mx.float32))
    return hooks.inverse_cdf_mlx(probs, u)
