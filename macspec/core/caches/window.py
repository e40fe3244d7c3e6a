"""Sliding-window attention caches that rewind exactly (see rewind.py)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from ...base.errors import CacheError
from .rewindable import Rewindable


class WindowKVCache(Rewindable, _BaseCache):
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
