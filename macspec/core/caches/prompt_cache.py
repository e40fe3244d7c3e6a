"""The prompt cache: model states kept after a generation, so that the next prompt that starts
with the same ids reads only its new ids (a chat's next turn, a server's repeated system prompt).

An entry holds the ids a generation ended with, a detached copy of the target's layer caches and
the drafter's state (`DraftState`: a draft model's cache, or the EAGLE draft's cache and its
pending target features; an n-gram index is rebuilt from the ids). A new prompt restores the
entry that lets it skip the most ids: the longest common prefix of ids that every layer can go
back to exactly (rewind.py):

- full attention: any length;
- sliding window: only the last `max_step` tokens or so (the ring's spare slots; a prompt cache
  makes them at least `MIN_STEP`) -- earlier, the window's keys are gone;
- recurrent: only the exact length the state was kept at (no snapshot in between).

Where no entry reaches far enough the prompt is prefilled from the start: never wrong, only
slower. Models with window or recurrent layers therefore also keep a checkpoint right after
the prompt's prefill, so that a chat's next turn (which re-renders the last answer, maybe with
other ids) can still go back to the end of the previous prompt.

Entries are copies that no generation writes into: MLX's `array[...] = x` rebinds that array
object, so an entry holds array objects of its own (slices), and a restored cache holds new
slices of the entry's; a KV cache restored to `n` ids grows into a new buffer on its first write.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import CacheList

from ...base.errors import CacheError
from .recurrent import RecurrentCache
from .rewind import TRIMMABLE, Layer, layers, length
from .window import WindowKVCache

# A drafter's extra state: nested lists, tuples and dicts of arrays (mlx.utils' trees), any shape.
PyTree = Any

MIN_STEP = 32  # sliding-window rings keep this many spare positions while a prompt cache is on
DEFAULT_BYTES = 1 << 30
MAX_ENTRIES = 16
_EMPTY = (1, 0)  # a range no length is in


@dataclass
class DraftState:
    """What a drafter keeps of its context, for the prompt cache: its model
    cache (None: nothing kept, the state is rebuilt from the ids), the context positions it
    can resume at most (past its cache: `extra`), and how many ids past a position its state
    reads (EAGLE pairs each position with the next id). A draft model `catches_up` by reading
    the ids after its state itself; EAGLE reads the target's features, so it resumes where the
    target does."""

    kind: str
    cache: list | None
    length: int
    lookahead: int = 0
    extra: PyTree = None
    catches_up: bool = False  # it reads the ids itself: may resume behind the target
    start: int = 0  # context ids before its cache (a draft that read only a prompt's end)


# ---------------------------------------------------------------- one model's cache


def _span(c: Layer, max_step: int) -> tuple[int, int]:
    """The lengths (lo, hi) this layer's cache can be brought back to exactly."""
    if isinstance(c, WindowKVCache):
        if c.capacity < c.window + max_step - 1:  # its ring is too small for these rounds
            return _EMPTY
        return (0 if c.lost == 0 else c.lost + c.window - 1), c.offset
    if isinstance(c, RecurrentCache):
        return c.offset, c.offset  # no state kept between checkpoints
    if isinstance(c, TRIMMABLE):
        return 0, c.offset
    return _EMPTY


def span(cache: list, max_step: int) -> tuple[int, int]:
    """The lengths every layer of `cache` can go back to: one interval (lo > hi: none)."""
    lo, hi = 0, length(cache)
    for _, c in layers(cache):
        a, b = _span(c, max_step)
        lo, hi = max(lo, a), min(hi, b)
    return lo, hi


def _alias(tree: PyTree) -> PyTree:
    return tree_map(lambda a: a[...] if isinstance(a, mx.array) else a, tree)


def _cut(tree: PyTree, n: int) -> PyTree:
    return tree_map(lambda a: a[..., :n, :], tree)


def _copy_layer(c: Layer, n: int | None = None) -> Layer:
    """A copy of one layer's cache that shares no array object with `c`, holding its first `n`
    tokens (None: all of them; `_span` says which n are exact)."""
    if isinstance(c, CacheList):
        return CacheList(*(_copy_layer(sub, n) for sub in c.caches))
    new = copy.copy(c)
    if isinstance(c, WindowKVCache):
        new.keys, new.values = _alias(c.keys), _alias(c.values)
        new._fetched = None
        if n is not None:
            new.rewind_to(n)
    elif isinstance(c, RecurrentCache):
        if n not in (None, c.offset):
            raise CacheError(f"a recurrent state kept at {c.offset} tokens cannot go to {n}")
        new.cache = [None if a is None else a[...] for a in c.cache]
        new.segments = None
    elif c.keys is not None:  # KVCache, QuantizedKVCache, ConcatenateKVCache: cut to length
        keep = c.offset if n is None else n
        new.keys, new.values, new.offset = _cut(c.keys, keep), _cut(c.values, keep), keep
    return new


def copy_cache(cache: list, n: int | None = None) -> list:
    return [_copy_layer(c, n) for c in cache]


def _leaves(tree: PyTree) -> list:
    return [a for _, a in tree_flatten(tree) if isinstance(a, mx.array)]


def _arrays(cache: list) -> list:
    out = []
    for _, c in layers(cache):
        if isinstance(c, RecurrentCache):
            out += [a for a in c.cache if a is not None]
        elif c.keys is not None:
            out += [a for _, a in tree_flatten((c.keys, c.values))]
    return out


# ---------------------------------------------------------------- entries


class Resumable(Protocol):
    """What the prompt cache asks of a drafter (drafters/base.Drafter declares both; declared
    here so that the caches, which the drafters import, import no drafter)."""

    state_kind: str | None | bool  # the kind of state it keeps; False: it cannot resume
    rebuilds_from_ids: bool  # it can start from the prompt's ids alone (a draft model)

    def snapshot(self) -> DraftState | None: ...


@dataclass
class Entry:
    ids: np.ndarray  # the context the states belong to (may run past the target's cache)
    target: list  # detached layer caches holding a prefix of ids
    draft: DraftState | None  # detached; None: kept without a drafter's state
    nbytes: int = 0
    spare: int = 0  # the widest round (max_step) its window rings allow
    reach: tuple[int, int] = _EMPTY  # lengths the target's state can be restored to
    draft_reach: tuple[int, int] = _EMPTY  # and the drafter's

    def target_length(self, common: int, kind: str | None, limit: int, rebuilds: bool) -> int:
        """The most ids this entry restores for a prompt that shares `common` ids with it (at
        most `limit`); 0: none. A drafter that reads the target's features (EAGLE) must be
        restored to the same length; a draft model catches up on its own (`draft_length`), and
        one that `rebuilds` from the ids takes the target's states without its own (an entry
        of plain decoding's: the draft then reads the prompt itself)."""
        lo, hi = self.reach
        hi = min(hi, common, limit)
        if kind is not None and self.holds(kind):
            if not self.draft.catches_up:
                lo = max(lo, self.draft_reach[0])
                hi = min(hi, self.draft_reach[1], common - self.draft.lookahead)
        elif kind is not None and not rebuilds:
            return 0
        return hi if hi >= max(lo, 1) else 0

    def holds(self, kind: str) -> bool:
        """Whether the entry keeps a drafter's state of this kind."""
        return self.draft is not None and self.draft.kind == kind

    def draft_length(self, common: int, n: int) -> int:
        """Where the drafter resumes when the target resumes at n (0: from the start)."""
        lo, hi = self.draft_reach
        if not self.draft.catches_up:
            return n
        hi = min(hi, n, common - self.draft.lookahead)
        return hi if hi >= max(lo, 1) else 0


def _draft_span(state: DraftState, max_step: int) -> tuple[int, int]:
    """Lengths a drafter's state restores to: its cache's span, then on through the
    positions it holds beyond its cache (EAGLE's pending features)."""
    if state.cache is None:
        return 0, state.length
    lo, hi = span(state.cache, max_step)
    at = length(state.cache)
    if lo > hi:  # the cache can only stay where it is
        lo = at if state.start + at == state.length else at + 1
    return state.start + lo, state.length


@dataclass
class Hit:
    """Restored states: the target's caches holding `length` ids, the drafter's holding
    `draft_length` (None: the drafter starts afresh)."""

    length: int
    target: list
    draft: DraftState | None
    draft_length: int = 0


@dataclass
class PromptCache:
    """An LRU of entries, at most `max_bytes` of arrays in all. One per loaded pair (its models'
    states); every front end's generations go through it (api.py)."""

    max_bytes: int = DEFAULT_BYTES
    max_entries: int = MAX_ENTRIES
    min_step: int = MIN_STEP
    _entries: OrderedDict = field(default_factory=OrderedDict)
    # Reentrant: save() sums nbytes under it. Other threads (a server's /health) read too.
    _lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def restore(self, prompt: list[int], drafter: Resumable | None, max_step: int) -> Hit | None:
        """Copies of the states that let `prompt` skip the most ids (at most all but its last,
        which the first step reads), or None: prefill it all."""
        kind = _kind(drafter)
        if kind is False:
            return None
        want = np.asarray(prompt, dtype=np.int64)
        rebuilds = drafter is not None and drafter.rebuilds_from_ids
        with self._lock:
            best, best_len, best_common = None, 0, 0
            for key, e in reversed(self._entries.items()):
                if e.spare < max_step:
                    continue
                common = _common(e.ids, want)
                n = e.target_length(common, kind, len(prompt) - 1, rebuilds)
                if n > best_len:
                    best, best_len, best_common = key, n, common
            if best is None:
                return None
            self._entries.move_to_end(best)
            e = self._entries[best]
            hit = Hit(best_len, copy_cache(e.target, best_len), None)
            if kind is not None and e.holds(kind):
                hit.draft_length = e.draft_length(best_common, best_len)
                if hit.draft_length:
                    hit.draft = _restore_draft(e.draft, hit.draft_length)
        return hit

    def save(self, ids: list[int], cache: list, drafter: Resumable | None) -> None:
        """Keep the states after `ids` (the target's cache holds a prefix of them) as an entry,
        dropping the entries it makes useless (a prefix it can restore as well) and the least
        recently used ones beyond the caps."""
        kind = _kind(drafter)
        if kind is False:
            return
        state = drafter.snapshot() if kind is not None else None
        draft = None
        if state is not None:
            held = None if state.cache is None else copy_cache(state.cache)
            draft = replace(state, cache=held, extra=_alias(state.extra))
        e = Entry(np.asarray(ids, dtype=np.int64), copy_cache(cache), draft)
        arrays = _arrays(e.target)
        if draft is not None:
            arrays += _arrays(draft.cache or []) + _leaves(draft.extra)
        mx.eval(arrays)
        e.nbytes = sum(a.nbytes for a in arrays)
        e.spare = _spare(e.target + ([] if draft is None else draft.cache or []))
        e.reach = span(e.target, 1)
        if draft is not None:
            e.draft_reach = _draft_span(draft, 1)
        if e.reach[1] < max(e.reach[0], 1) or e.nbytes > self.max_bytes:
            return
        with self._lock:
            for key, old in list(self._entries.items()):
                if _covers(e, old):
                    del self._entries[key]
            self._entries[id(e)] = e
            while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
                self._entries.popitem(last=False)

    def wants_checkpoint(self, cache: list) -> bool:
        """True when later prompts may need this prefill's end kept apart from the generation's
        end: some layer cannot go back to any length."""
        return any(not isinstance(c, TRIMMABLE) for _, c in layers(cache))


def _kind(drafter: Resumable | None) -> str | None | bool:
    """The kind of state a drafter keeps (None: no drafter, or one rebuilt from the ids);
    False for a drafter that cannot resume from a kept state (no prompt cache then)."""
    if drafter is None:
        return None
    return drafter.state_kind


def _restore_draft(state: DraftState, n: int) -> DraftState:
    if state.cache is None:
        return replace(state, length=n)
    held = min(n - state.start, length(state.cache))
    return replace(state, cache=copy_cache(state.cache, held), length=n)


def _spare(cache: list) -> int:
    windows = [c for _, c in layers(cache) if isinstance(c, WindowKVCache)]
    return min((c.capacity - c.window + 1 for c in windows), default=1 << 30)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _within(inner: tuple[int, int], outer: tuple[int, int]) -> bool:
    return inner[0] > inner[1] or (outer[0] <= inner[0] and inner[1] <= outer[1])


def _covers(new: Entry, old: Entry) -> bool:
    """`new` restores every length `old` does, for every prompt (so `old` can go)."""
    if old.ids.size > new.ids.size or _common(new.ids, old.ids) < old.ids.size:
        return False
    if old.draft is not None:
        if new.draft is None or new.draft.kind != old.draft.kind:
            return False
        if not _within(old.draft_reach, new.draft_reach):
            return False
    return _within(old.reach, new.reach) and new.spare >= old.spare
