"""Recurrent-layer caches that rewind exactly (see rewind.py): a rewindable forward keeps the
states before it and what its recurrence read; rewinding into it replays the recurrence alone."""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from ...base.errors import CacheError
from .rewindable import Rewindable


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


class RecurrentCache(Rewindable, ArraysCache):
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


class _Recorded:
    """A recurrence function (mlx-lm's gated_delta_update, ssm_update) that, inside a
    rewindable forward, leaves its arguments with the layer's cache so that it can be run again
    over the first m tokens only."""

    def __init__(self, fn: Callable[..., object], per_token: tuple[str, ...]) -> None:
        self.fn, self.per_token = fn, per_token
        self.signature = inspect.signature(fn)
        self.__name__ = getattr(fn, "__name__", "recurrence")  # foreign: a partial has none

    def __call__(self, *args: object, **kwargs: object) -> object:
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
            fn = getattr(home, name, None)  # foreign: the mlx-lm modules that define one
            if fn is not None and not isinstance(fn, _Recorded):
                setattr(home, name, _Recorded(fn, per_token))
