"""Model caches that rewind exactly, for every kind of layer mlx-lm builds.

A speculative round feeds drafts the target may reject, so every cache must go back to the length
the round keeps. mlx-lm's `trim_prompt_cache` cannot do that for two kinds of layer, and says so
only by trimming nothing: a `RotatingKVCache` that has wrapped (sliding-window layers) and the
recurrent states of hybrid models (`ArraysCache`). Here each layer's cache is replaced by one that
can be rewound, and every rewind checks that every layer reached exactly the asked length:

- full attention (`KVCache`): trimmed as before;
- sliding windows: `WindowKVCache`, a ring of window + max_step - 1 slots whose attention mask
  still covers exactly the model's window; a rewind of up to max_step tokens finds what it needs;
- recurrent layers: `RecurrentCache`. A rewindable forward keeps the states before it (arrays
  are immutable: a reference) and what its recurrence read: the convolution's input and the
  arguments of the recurrence function (mlx-lm's `gated_delta_update` / `ssm_update`). Rewinding
  to m of its n tokens slices the convolution window and runs the recurrence alone over the m
  tokens, with no weights involved.

Anything else raises `CacheError`: output is never silently wrong.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    _BaseCache,
    make_prompt_cache,
)

from ..errors import CacheError, ModelError

# Cache classes that are exact when trimmed by offset (appended keys, nothing evicted).
_TRIMMABLE = (KVCache, ConcatenateKVCache, QuantizedKVCache)


class WindowKVCache(_BaseCache):
    """Sliding-window keys and values in a ring of `window + max_step - 1` slots.

    Position p lives in slot p % capacity. The query at position q attends to positions
    q - window + 1 .. q, as with mlx-lm's RotatingKVCache; the spare slots keep the positions a
    rewind of up to `max_step` tokens needs again. Forwards wider than max_step (prompt chunks)
    attend over the window before them in temporal order and keep the last `capacity`."""

    step = 256

    def __init__(self, window: int, max_step: int) -> None:
        self.window = window
        self.capacity = window + max(max_step, 1) - 1
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.wrapped = False  # a position >= capacity was written: slots are in ring order
        self.lost = 0  # positions below this may have been overwritten
        self._fetched: tuple[mx.array, mx.array] | None = None  # the last update's view

    # -- the interface mlx-lm's models use

    def _in_place(self, n: int) -> bool:
        return n <= self.capacity - self.window + 1

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if window_size not in (None, self.window):
            raise CacheError(
                f"a sliding-window layer asked for a window of {window_size} tokens, but its "
                f"cache holds {self.window}"
            )
        start, end = self.offset, self.offset + N
        if not self._in_place(N):  # temporal order: the window before, then the new tokens
            return create_causal_mask(N, min(self.window - 1, start), window_size=self.window)
        if not self.wrapped and end <= self.capacity:  # slot j holds position j
            if end <= self.window and not return_array:
                return None if N == 1 else "causal"
            return create_causal_mask(N, start, window_size=self.window)
        # Ring order: slot j holds the latest position p < end with p % capacity == j.
        slots = mx.arange(self.capacity)
        pos = slots + self.capacity * ((end - 1 - slots) // self.capacity)
        queries = mx.arange(start, end)[:, None]
        return (pos[None] <= queries) & (queries - pos[None] < self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        start, end = self.offset, self.offset + n
        if not self._in_place(n):
            before = min(self.window - 1, start)
            k, v = keys, values
            if before:
                k = mx.concatenate([self._positions(self.keys, start - before, start), k], axis=2)
                v = mx.concatenate([self._positions(self.values, start - before, start), v], axis=2)
            self._store(k, v, end)
            self._fetched = (k, v)
            return k, v
        self._reserve(keys, values, end)
        cap, s = self.capacity, start % self.capacity
        first = min(n, cap - s)
        self.keys[..., s : s + first, :] = keys[..., :first, :]
        self.values[..., s : s + first, :] = values[..., :first, :]
        if first < n:
            self.keys[..., : n - first, :] = keys[..., first:, :]
            self.values[..., : n - first, :] = values[..., first:, :]
        self.wrapped = self.wrapped or end > cap
        self.offset, self.lost = end, max(self.lost, end - cap)
        if self.wrapped:
            self._fetched = (self.keys, self.values)
        else:
            self._fetched = (self.keys[..., :end, :], self.values[..., :end, :])
        return self._fetched

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """What the last update returned, in the layout of its mask: layers that share this
        layer's keys and values (Gemma 3n, Gemma 4) attend over it with that mask."""
        return self._fetched

    def _positions(self, buf: mx.array, lo: int, hi: int) -> mx.array:
        if not self.wrapped:
            return buf[..., lo:hi, :]
        return mx.take(buf, mx.array([p % self.capacity for p in range(lo, hi)]), axis=2)

    def _store(self, k: mx.array, v: mx.array, end: int) -> None:
        """Keep the last `capacity` positions of a temporal-order block ending at `end`."""
        cap = self.capacity
        if end <= cap:  # the block starts at position 0 here (see update_and_fetch)
            self.keys, self.values = k, v
        else:
            shift = (end - cap) % cap
            self.keys = mx.roll(k[..., -cap:, :], shift, axis=2)
            self.values = mx.roll(v[..., -cap:, :], shift, axis=2)
            self.wrapped = True
        self.offset, self.lost = end, max(self.lost, end - cap)

    def _reserve(self, keys: mx.array, values: mx.array, end: int) -> None:
        """Grow the buffer (in steps, up to the capacity) so that the slots written exist."""
        need = self.capacity if end > self.capacity or self.wrapped else end
        have = 0 if self.keys is None else self.keys.shape[2]
        if have >= need:
            return
        size = min(self.capacity, -(-need // self.step) * self.step)
        b, h, _, dk = keys.shape
        grow_k = mx.zeros((b, h, size - have, dk), keys.dtype)
        grow_v = mx.zeros((b, h, size - have, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = grow_k, grow_v
        else:
            self.keys = mx.concatenate([self.keys, grow_k], axis=2)
            self.values = mx.concatenate([self.values, grow_v], axis=2)

    # -- rewinding

    def can_rewind_to(self, length: int) -> bool:
        return 0 <= length <= self.offset and max(0, length - self.window + 1) >= self.lost

    def rewind_to(self, length: int) -> None:
        if not self.can_rewind_to(length):
            raise CacheError(
                f"a sliding-window cache (window {self.window}, {self.capacity} slots) cannot "
                f"go back from {self.offset} to {length} tokens: positions before {self.lost} "
                "were overwritten"
            )
        self.offset = length

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        if not self.can_rewind_to(self.offset - n):
            return 0
        self.offset -= n
        return n

    def size(self) -> int:
        return min(self.offset, self.window)

    @property
    def state(self):
        return self.keys, self.values

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


# ---------------------------------------------------------------- recurrent layers


class _Active(threading.local):
    cache: RecurrentCache | None = None


# The recurrent cache whose state a layer read last: the convolution and recurrence that run next
# belong to that layer. A load-time probe (verify) checks this against fresh computation.
_active = _Active()


@dataclass
class _Segment:
    """One rewindable forward of `n` tokens through a recurrent layer."""

    start: int
    n: int
    before: list  # the slots before it
    assigned: dict = field(default_factory=dict)  # slot -> value the forward stored
    convs: list = field(default_factory=list)  # inputs of its 1-d convolutions
    recurrences: list = field(default_factory=list)  # (recurrence, args, kwargs, new state)

    def state_at(self, slot: int, m: int) -> mx.array:
        value = self.assigned[slot]
        for rec, args, kwargs, out in self.recurrences:
            if value is out:
                return rec.replay(args, kwargs, self.n, m)
        if value is not None and value.ndim == 3:
            # A convolution window: the last w inputs of [window before, new tokens]. Layers
            # with several convolutions of one width (q, k, v) are told apart by content.
            w = value.shape[1]
            inputs = [
                x
                for x in self.convs
                if x.ndim == 3 and x.shape[1] == w + self.n and x.shape[2] == value.shape[2]
            ]
            if len(inputs) > 1:
                inputs = [x for x in inputs if mx.array_equal(x[:, -w:, :], value).item()]
            if len(inputs) == 1:
                return mx.contiguous(inputs[0][:, m : m + w, :])
        raise CacheError(
            f"cannot tell how recurrent state slot {slot} depends on the tokens of a forward "
            "(neither a known recurrence's output nor a convolution window)"
        )


class RecurrentCache(ArraysCache):
    """mlx-lm's ArraysCache with a token count and the records that make it rewindable."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.offset = 0
        self.segments: list[_Segment] | None = None  # kept since the last rewind

    def __getitem__(self, idx: int):
        _active.cache = self
        return self.cache[idx]

    def __setitem__(self, idx: int, value) -> None:
        self.cache[idx] = value
        if self.segments:
            self.segments[-1].assigned[idx] = value

    @property
    def recording(self) -> bool:
        return self.segments is not None

    def begin(self, n: int, record: bool) -> None:
        if record:
            self.segments = (self.segments or []) + [_Segment(self.offset, n, list(self.cache))]
        else:
            self.segments = None
        self.offset += n

    def note_conv(self, x: mx.array) -> None:
        self.segments[-1].convs.append(x)

    def note_recurrence(self, rec: _Recorded, args: tuple, kwargs: dict, state: mx.array) -> None:
        self.segments[-1].recurrences.append((rec, args, kwargs, state))

    def can_rewind_to(self, length: int) -> bool:
        if length == self.offset:
            return True
        return bool(self.segments) and self.segments[0].start <= length < self.offset

    def rewind_to(self, length: int) -> None:
        if length != self.offset:
            if not self.can_rewind_to(length):
                kept = self.segments[0].start if self.segments else self.offset
                raise CacheError(
                    f"a recurrent state cannot go back from {self.offset} to {length} tokens: "
                    f"only the states since token {kept} were kept"
                )
            seg = next(s for s in reversed(self.segments) if s.start <= length)
            m = length - seg.start
            state = list(seg.before)
            if m:
                for slot in seg.assigned:
                    state[slot] = seg.state_at(slot, m)
            mx.eval([s for s in state if s is not None])  # the replay belongs to this round
            self.cache, self.offset = state, length
        self.segments = None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        if not self.can_rewind_to(self.offset - n):
            return 0
        self.rewind_to(self.offset - n)
        return n


class _Recorded:
    """A recurrence function (mlx-lm's gated_delta_update, ssm_update) that, inside a
    rewindable forward, leaves its arguments with the layer's cache so that it can be run again
    over the first m tokens only."""

    def __init__(self, fn: Any, per_token: tuple[str, ...]) -> None:
        self.fn, self.per_token = fn, per_token
        self.signature = inspect.signature(fn)
        self.__name__ = getattr(fn, "__name__", "recurrence")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.fn(*args, **kwargs)
        cache = _active.cache
        if cache is not None and cache.recording:
            cache.note_recurrence(self, args, kwargs, out[1])
        return out

    def replay(self, args: tuple, kwargs: dict, n: int, m: int) -> mx.array:
        bound = self.signature.bind(*args, **kwargs)
        if bound.arguments.get("lengths") is not None:
            raise CacheError(f"{self.__name__} ran with per-sequence lengths: cannot replay it")
        for name in self.per_token:
            x = bound.arguments.get(name)
            if x is None:
                continue
            if x.shape[1] != n:
                raise CacheError(f"{self.__name__}'s {name} does not have one row per token")
            bound.arguments[name] = x[:, :m]
        return self.fn(*bound.args, **bound.kwargs)[1]


# The recurrence functions mlx-lm's hybrid models call, and their per-token arguments (axis 1).
RECURRENCES = {
    "gated_delta_update": ("q", "k", "v", "a", "b", "mask"),
    "ssm_update": ("hidden_states", "B", "C", "dt", "mask"),
}


class _RecordingConv1d(nn.Conv1d):
    """nn.Conv1d that leaves its input with the recurrent layer running it (rewindable forwards
    only); the same computation otherwise."""

    def __call__(self, x: mx.array) -> mx.array:
        cache = _active.cache
        if cache is not None and cache.recording:
            cache.note_conv(x)
        return super().__call__(x)


def _hook(model: nn.Module) -> None:
    """Route the model's recurrences and convolutions through the recorders (idempotent)."""
    for _, module in model.named_modules():
        if type(module) is nn.Conv1d:
            module.__class__ = _RecordingConv1d
        home = sys.modules.get(type(module).__module__)
        for name, per_token in RECURRENCES.items():
            fn = getattr(home, name, None)
            if fn is not None and not isinstance(fn, _Recorded):
                setattr(home, name, _Recorded(fn, per_token))


# ---------------------------------------------------------------- whole-model caches


def _layers(cache: list) -> Iterator[tuple[int, Any]]:
    """(layer index, cache) over every cache, nested CacheLists included."""
    for i, c in enumerate(cache):
        if isinstance(c, CacheList):
            for sub in c.caches:
                yield i, sub
        else:
            yield i, c


def _convert(c: Any, max_step: int) -> Any:
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
    if any(isinstance(c, RecurrentCache) for _, c in _layers(cache)):
        _hook(model)
    return cache


# Cache kinds as `kinds` names them; the first three rewind exactly.
EXACT_KINDS = ("attention", "window", "recurrent")


def kinds(model: nn.Module) -> dict[str, int]:
    """How many layers of each cache kind the model has: attention (full), window (sliding),
    recurrent, or the class name of a cache speculation cannot rewind."""
    out: dict[str, int] = {}
    for _, c in _layers(make_prompt_cache(model)):
        if type(c) is RotatingKVCache and not c.keep:
            kind = "window"
        elif type(c) is ArraysCache:
            kind = "recurrent"
        else:
            kind = "attention" if isinstance(c, _TRIMMABLE) else type(c).__name__
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
    lengths = {c.offset for _, c in _layers(cache)}
    if len(lengths) != 1:
        detail = ", ".join(f"layer {i} ({type(c).__name__}): {c.offset}" for i, c in _layers(cache))
        raise CacheError(f"the layers' caches hold different lengths: {detail}")
    return lengths.pop()


def rewind(cache: list, length_: int) -> None:
    """Bring every layer back to exactly `length_` tokens, or raise CacheError."""
    for i, c in _layers(cache):
        if c.offset < length_:
            raise CacheError(f"layer {i} holds {c.offset} tokens, fewer than {length_}")
        if isinstance(c, (WindowKVCache, RecurrentCache)):
            try:
                c.rewind_to(length_)
            except CacheError as e:
                raise CacheError(f"layer {i}: {e}") from None
        elif isinstance(c, _TRIMMABLE):
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
    for _, c in _layers(cache):
        if isinstance(c, RecurrentCache):
            c.begin(n, rewindable)
    try:
        yield
    finally:
        _active.cache = None


def state_arrays(cache: list) -> list:
    """The arrays a cache holds, for mx.eval."""
    out = []
    for _, c in _layers(cache):
        state = c.cache if isinstance(c, ArraysCache) else c.state
        out += [a for a in state if isinstance(a, mx.array)]
    return out


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
