"""Several generations' target passes as one: a (B, W) block, row r being `[last_r, d_1..d_k_r]`
right-padded to the widest row, each row reading its own cache at its own length.

Every row keeps its own caches (a Target each): for the pass, each layer gets a view (`_Rows`)
that appends row r's new keys to row r's own cache, left-pads the rows' keys to a common length
and hides the padding with a per-row mask; RoPE takes the rows' own offsets (an array, as
mlx-lm's BatchKVCache gives). After the pass each row rewinds its own cache to what it keeps,
exactly as alone. mlx-lm's BatchKVCache keeps one buffer for all rows and rolls rows to rewind
them; keeping each row's cache whole lets rows join and leave (and keep their prompt cache)
with no merge or filter, at the price of the same O(context) copy per round.

Only full-attention layers (mlx-lm's `KVCache`) take part; `shared_reason` says why a pair's
rows take turns instead. The mask and offsets follow mlx-lm's cache protocol (`offset`,
`update_and_fetch`, `make_mask`; pinned mlx-lm>=0.32,<0.33 in pyproject).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..errors import CacheError
from . import hooks
from .target import Target, output_head


class _Rows:
    """One layer's caches of B rows, seen as one batched cache for a single forward pass."""

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches
        self.lengths = [c.offset for c in caches]
        self.width = max(self.lengths)
        self.offset = mx.array(self.lengths, dtype=mx.int32)  # RoPE: each row at its own place

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys, values (B, heads, W, dim): row r's go into row r's cache; returns every row's
        keys and values (B, heads, width + W, dim), left-padded with zeros the mask hides."""
        ks, vs = [], []
        for r, c in enumerate(self.caches):
            k, v = c.update_and_fetch(keys[r : r + 1], values[r : r + 1])
            pad = self.width - self.lengths[r]
            if pad:
                widths = [(0, 0), (0, 0), (pad, 0), (0, 0)]
                k, v = mx.pad(k, widths), mx.pad(v, widths)
            ks.append(k)
            vs.append(v)
        return mx.concatenate(ks), mx.concatenate(vs)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """(B, 1, n, width + n) bool: row r sees its own keys (not the left padding) and, among
        the n new ones, those at or before each query (causal)."""
        if window_size is not None:
            raise CacheError("a sliding-window layer cannot take part in a shared pass")
        cols = mx.arange(self.width + n)[None, None, :]
        first = (self.width - self.offset)[:, None, None]  # (B, 1, 1): each row's first key
        last = self.width + mx.arange(n)[None, :, None]  # (1, n, 1): each query's own key
        return ((cols >= first) & (cols <= last))[:, None]


def shared_pass(
    model: nn.Module, vocab_size: int, rows: list[tuple[list, mx.array]], hidden: bool = False
) -> list[tuple[mx.array, mx.array | None]]:
    """(logits (w_r, vocab_size), final hidden states (w_r, H) or None) for each row's ids
    `tokens_r` (w_r,) fed after its cache, all in one forward pass; `hidden`: through the trunk
    and the output head (as a Target that keeps hidden states), else the model's own call.
    Every row's cache then holds W = max w_r more positions (the padding included): the row
    rewinds to what it keeps. One row is fed alone, as a Target would feed it."""
    width = max(tokens.size for _, tokens in rows)
    block = mx.stack([mx.pad(tokens, (0, width - tokens.size)) for _, tokens in rows])
    if len(rows) == 1:
        cache = rows[0][0]
    else:
        cache = [_Rows([c[i] for c, _ in rows]) for i in range(len(rows[0][0]))]
    with hooks.serial():  # built whole, as verify.speculative_round builds its pass
        if hidden:
            states = model.model(block, cache=cache)
            logits = output_head(model, states)
        else:
            states, logits = None, model(block, cache=cache)
    return [
        (logits[r, : t.size, :vocab_size], None if states is None else states[r, : t.size])
        for r, (_, t) in enumerate(rows)
    ]


def can_share(target: Target) -> bool:
    """Whether this generation's rounds can go into a shared pass: a local target whose every
    layer is full attention, keeping no hidden states or only the final ones (no taps)."""
    return not target.taps and bool(target.cache) and all(type(c) is KVCache for c in target.cache)


def shared_reason(model: nn.Module, vocab_size: int, kinds: dict[str, int], sharded: bool) -> str:
    """Why this target's generations must take turns, or "" when they can share passes: its
    cache kinds, a sharded target, or a shared pass that does not give each row's own logits
    (checked on this very model, two rows of different lengths against each alone)."""
    if sharded:
        return "a sharded target"
    other = sorted(k for k in kinds if k != "attention")
    if other:
        return f"{', '.join(other)} layers (only full attention shares a pass)"
    try:
        worst = _check(model, vocab_size)
    except Exception as e:  # an architecture that reads its cache beyond the protocol
        return f"this architecture's layers do not take a shared pass ({type(e).__name__}: {e})"
    if worst > 1e-2:
        return f"a shared pass changes a row's logits here (by up to {worst:.3g})"
    return ""


def _check(model: nn.Module, vocab_size: int) -> float:
    """The largest difference, relative to the logits' scale, between two rows' logits in one
    shared pass and each row fed alone (prompts of 3 and 6 ids, then 2 and 4 ids fed)."""
    from mlx_lm.models.cache import make_prompt_cache

    ids = [(7 * i + 3) % vocab_size for i in range(12)]
    prompts, feeds = (ids[:3], ids[3:9]), (ids[9:11], ids[8:12])

    def caches() -> list[list]:
        out = []
        for p in prompts:
            cache = make_prompt_cache(model)
            model(mx.array(p)[None], cache=cache)
            out.append(cache)
        return out

    together = [
        logits
        for logits, _ in shared_pass(
            model, vocab_size, [(c, mx.array(f)) for c, f in zip(caches(), feeds, strict=True)]
        )
    ]
    alone = [
        shared_pass(model, vocab_size, [(c, mx.array(f))])[0][0]
        for c, f in zip(caches(), feeds, strict=True)
    ]
    worst = 0.0
    for a, b in zip(alone, together, strict=True):
        scale = float(mx.max(mx.abs(a))) + 1.0
        worst = max(worst, float(mx.max(mx.abs(a - b))) / scale)
    return worst
