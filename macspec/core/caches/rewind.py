"""Model caches that rewind exactly, for every kind of layer mlx-lm builds.

A speculative round feeds drafts the target may reject, so every cache must go back to the length
the round keeps. mlx-lm's `trim_prompt_cache` cannot do that for two kinds of layer, and says so
only by trimming nothing: a `RotatingKVCache` that has wrapped (sliding-window layers) and the
recurrent states of hybrid models (`ArraysCache`). Here each layer's cache is replaced by one that
can be rewound, and every rewind checks that every layer reached exactly the asked length:

- full attention (`KVCache`): trimmed as before;
- sliding windows: `WindowKVCache` (window.py), a ring of window + max_step - 1 slots whose
  attention mask still covers exactly the model's window; a rewind of up to max_step tokens
  finds what it needs;
- recurrent layers: `RecurrentCache` (recurrent.py). A rewindable forward keeps the states
  before it (arrays are immutable: a reference) and what its recurrence read: the convolution's
  input and the arguments of the recurrence function (mlx-lm's `gated_delta_update` /
  `ssm_update`). Rewinding to m of its n tokens slices the convolution window and runs the
  recurrence alone over the m tokens, with no weights involved.

Anything else raises `CacheError`: output is never silently wrong.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ...base.errors import CacheError, ModelError
from .. import hooks
from ..memory import clear_on_gpu
from .recurrent import RecurrentCache, _active, _hook
from .window import WindowKVCache

# One layer's cache: mlx-lm's kinds (KVCache, QuantizedKVCache, CacheList...) and ours (window,
# recurrent); they share no base class with the fields read here, so Any (the one place).
Layer = Any

# Cache classes that are exact when trimmed by offset (appended keys, nothing evicted).
TRIMMABLE = (KVCache, ConcatenateKVCache, QuantizedKVCache)


# ---------------------------------------------------------------- whole-model caches


def layers(cache: list) -> Iterator[tuple[int, Layer]]:
    """(layer index, cache) over every cache, nested CacheLists included."""
    for i, c in enumerate(cache):
        if isinstance(c, CacheList):
            for sub in c.caches:
                yield i, sub
        else:
            yield i, c


def _convert(c: Layer, max_step: int) -> Layer:
    if type(c) is RotatingKVCache:
        if c.keep:
            raise ModelError("a rotating cache that keeps attention-sink tokens cannot rewind")
        return WindowKVCache(c.max_size, max_step)
    if type(c) is ArraysCache:
        return RecurrentCache(len(c.cache))
    if type(c) is CacheList:
        return CacheList(*(_convert(sub, max_step) for sub in c.caches))
    return c  # plain decoding runs on any cache; rewind() refuses what it cannot rewind


def make_cache(model: nn.Module, max_step: int = 1) -> list:
    """The model's cache with every layer exactly rewindable by up to `max_step` tokens (the
    widest forward a round may take back)."""
    cache = [_convert(c, max_step) for c in make_prompt_cache(model)]
    if any(isinstance(c, RecurrentCache) for _, c in layers(cache)):
        _hook(model)
    return cache


# Cache kinds as `kinds` names them; the first three rewind exactly.
EXACT_KINDS = ("attention", "window", "recurrent")


def kinds(model: nn.Module) -> dict[str, int]:
    """How many layers of each cache kind the model has: attention (full), window (sliding),
    recurrent, or the class name of a cache speculation cannot rewind."""
    out: dict[str, int] = {}
    for _, c in layers(make_prompt_cache(model)):
        if type(c) is RotatingKVCache and not c.keep:
            kind = "window"
        elif type(c) is ArraysCache:
            kind = "recurrent"
        else:
            kind = "attention" if isinstance(c, TRIMMABLE) else type(c).__name__
        out[kind] = out.get(kind, 0) + 1
    return out


def describe_kinds(found: dict[str, int]) -> str:
    """'24 full attention, 6 sliding window' from `kinds`."""
    names = {"attention": "full attention", "window": "sliding window"}
    return ", ".join(f"{n} {names.get(k, k)}" for k, n in found.items())


def check(model: nn.Module, vocab_size: int) -> dict[str, int]:
    """The model's cache kinds, after making sure speculation rewinds every one exactly
    (recurrent layers: `verify` on this very model). Raises ModelError otherwise."""
    found = kinds(model)
    unknown = [k for k in found if k not in EXACT_KINDS]
    if unknown:
        raise ModelError(
            f"its layers use caches speculation cannot rewind ({', '.join(unknown)}; "
            f"supported: {', '.join(EXACT_KINDS)})"
        )
    if "recurrent" in found:
        verify(model, [i % vocab_size for i in range(1, 7)])
    return found


def length(cache: list) -> int:
    """The number of tokens the cache holds; every layer must agree."""
    lengths = {c.offset for _, c in layers(cache)}
    if len(lengths) != 1:
        detail = ", ".join(f"layer {i} ({type(c).__name__}): {c.offset}" for i, c in layers(cache))
        raise CacheError(f"the layers' caches hold different lengths: {detail}")
    return lengths.pop()


def rewind(cache: list, length_: int) -> None:
    """Bring every layer back to exactly `length_` tokens, or raise CacheError."""
    for i, c in layers(cache):
        if c.offset < length_:
            raise CacheError(f"layer {i} holds {c.offset} tokens, fewer than {length_}")
        if isinstance(c, (WindowKVCache, RecurrentCache)):
            try:
                c.rewind_to(length_)
            except CacheError as e:
                raise CacheError(f"layer {i}: {e}") from None
        elif isinstance(c, TRIMMABLE):
            c.trim(c.offset - length_)
        else:
            raise CacheError(f"layer {i}'s {type(c).__name__} cannot be rewound")
        if c.offset != length_:
            raise CacheError(
                f"layer {i}'s {type(c).__name__} went back to {c.offset} tokens, not {length_}"
            )


@contextmanager
def forward(cache: list, n: int, rewindable: bool = False) -> Iterator[None]:
    """Around a model call feeding n tokens. Recurrent layers count them and, when the forward
    may be taken back, keep what rewinding into it needs (until the next rewind)."""
    for _, c in layers(cache):
        if isinstance(c, RecurrentCache):
            c.begin(n, rewindable)
    try:
        yield
    finally:
        _active.cache = None


def state_arrays(cache: list) -> list:
    """The arrays a cache holds, for mx.eval."""
    out = []
    for _, c in layers(cache):
        state = c.cache if isinstance(c, ArraysCache) else c.state
        out += [a for a in state if isinstance(a, mx.array)]
    return out


def prefill(model: nn.Module, cache: list, tokens: list[int], step: int | None = None) -> None:
    """Feed `tokens` into `cache` in chunks (hooks.prefill_chunk ids unless `step`), so long
    prompts do not build one huge graph."""
    step = step or hooks.prefill_chunk()
    for i in range(0, len(tokens), step):
        chunk = tokens[i : i + step]
        with forward(cache, len(chunk)):
            model(mx.array(chunk)[None], cache=cache)
        mx.eval(state_arrays(cache))
        clear_on_gpu()


def verify(model: nn.Module, ids: list[int]) -> None:
    """Check on this model that rewinding into a forward gives the state a forward of only the
    kept tokens gives (recurrent layers: the recorded convolution and recurrence are the ones
    the layer ran). `ids`: 6 valid token ids. Raises ModelError when it does not."""

    def logits_after(prefix: list[int], probe: list[int], keep: int | None) -> mx.array:
        cache = make_cache(model, max_step=len(probe))
        with forward(cache, len(prefix)):
            model(mx.array(prefix)[None], cache=cache)
        if keep is not None:
            with forward(cache, len(probe), rewindable=True):
                model(mx.array(probe)[None], cache=cache)
            rewind(cache, len(prefix) + keep)
        with forward(cache, 1):
            return model(mx.array([ids[-1]])[None], cache=cache)[0, -1]

    prefix, probe = ids[:2], ids[2:5]
    for keep in (0, 1, 2):
        try:
            got = logits_after(prefix, probe, keep)
        except CacheError as e:
            raise ModelError(f"speculation cannot rewind this model's cache: {e}") from e
        want = logits_after(prefix + probe[:keep], [], None)
        scale = float(mx.max(mx.abs(want))) + 1.0
        if float(mx.max(mx.abs(got - want))) > 1e-3 * scale:
            raise ModelError(
                "speculation would not be exact on this model: after rewinding a recurrent "
                f"layer to {keep} of 3 tokens its output differs from computing them alone"
            )
