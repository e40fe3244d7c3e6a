"""Several generations' target passes as one: a (B, W) block, row r being `[last_r, d_1..d_k_r]`
right-padded to the widest row, each row reading its own cache at its own length.

Every row keeps its own caches (a Target each). The rows share every layer's products (the
MLP, norms, head: row-wise, so each row's result is what it gets alone); attention alone runs
per row (`_RowsAttention`): row r's w_r ids attend over row r's own cache exactly as the row
fed alone, then its padding does, so its keys sit in the cache as the round expects. One
attention over left-padded rows would be one call, but its different reduction lengths and
RoPE change a row's logits by float rounding, which int8 activations turn into whole
quantization steps. After the pass each row rewinds its own cache to what it keeps, as alone.

Only full-attention layers (mlx-lm's `KVCache`) reached as `layer.self_attn` take part;
`shared_reason` says why a pair's rows take turns instead. The mask follows mlx-lm's cache
protocol (`offset`, `make_mask`; pinned mlx-lm>=0.32,<0.33 in pyproject).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..base.errors import CacheError
from . import hooks
from .target import Target, output_head


class _Rows:
    """One layer's caches of B rows and how many real ids each row feeds, for one pass."""

    def __init__(self, caches: list[KVCache], widths: list[int]) -> None:
        self.caches, self.widths = caches, widths
        self.offset = mx.array([c.offset for c in caches], dtype=mx.int32)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """None: `_RowsAttention` gives each row the mask it gets alone."""
        if window_size is not None:
            raise CacheError("a sliding-window layer cannot take part in a shared pass")
        return None


def _mask(n: int) -> str | None:
    return "causal" if n > 1 else None  # what mlx-lm's KVCache.make_mask gives one row


class _Take:
    """A projection computed once over the whole (B, W) block: a row's call gets its part."""

    def __init__(self, block: mx.array) -> None:
        self.block, self.at = block, (0, 0, 0)

    def __call__(self, x: mx.array) -> mx.array:
        r, start, stop = self.at
        return mx.contiguous(self.block[r : r + 1, start:stop])


def _passed(x: mx.array) -> mx.array:
    return x  # o_proj in a row's call: the block's o_proj runs once after every row


# Attention whose call is mlx-lm's llama/qwen2 one (macspec's CPU switch keeps its shape): its
# q/k/v projections read the layer's input alone, and its output is o_proj's.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _projects_row_wise(attn: nn.Module) -> bool:
    from mlx_lm.models import llama, qwen2

    return hooks.stock_class(attn) in (llama.Attention, qwen2.Attention)


class _RowsAttention(nn.Module):
    """A layer's attention in a shared pass: each row's real ids, then its padding, through
    the layer's own attention with the row's own cache, as the row fed alone. Where the
    attention is llama/qwen2's, its products run once over the block (row-wise, so each row's
    result is its own), so that the rows do not read the weights once each."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn
        self.shares = _projects_row_wise(attn)

    def __call__(self, x: mx.array, mask=None, cache: _Rows | None = None) -> mx.array:
        if not isinstance(cache, _Rows):
            raise CacheError("a shared pass's attention needs the rows' caches")
        if not self.shares:
            return self._rows(x, cache, [])
        attn = self.attn
        own = {name: attn[name] for name in (*_PROJECTIONS, "o_proj")}
        takes = [_Take(own[name](x)) for name in _PROJECTIONS]
        try:
            for name, take in zip(_PROJECTIONS, takes, strict=True):
                attn[name] = take
            attn["o_proj"] = _passed
            out = self._rows(x, cache, takes)
        finally:
            for name, module in own.items():
                attn[name] = module
        return own["o_proj"](out)

    def _rows(self, x: mx.array, cache: _Rows, takes: list[_Take]) -> mx.array:
        width, outs = x.shape[1], []
        for r, (c, w) in enumerate(zip(cache.caches, cache.widths, strict=True)):
            parts = []
            for start, stop in [(0, w), (w, width)] if w < width else [(0, w)]:
                for take in takes:
                    take.at = (r, start, stop)
                ids = x[r : r + 1, start:stop]
                parts.append(self.attn(ids, mask=_mask(stop - start), cache=c))
            outs.append(mx.concatenate(parts, axis=1))
        return mx.concatenate(outs)


class _RowsLayer(nn.Module):
    """A decoder layer in a shared pass: the accelerator's own (hooks.rows_layer), else the
    layer itself with its attention run row by row (`_RowsAttention`)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer, self.attn = layer, layer["self_attn"]
        self.rows = _RowsAttention(self.attn)

    def __getattr__(self, key: str) -> object:
        # The model reads its layers' own attributes (llama's `use_sliding`).
        if key in self:
            return self[key]
        if "layer" in self:
            return getattr(self["layer"], key)  # foreign: the wrapped mlx-lm layer's own
        raise AttributeError(key)

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        # mlx-lm's layers take (x, mask, cache), the cache by name or by place.
        cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
        if isinstance(cache, _Rows) and len(args) + len(kwargs) <= 2:
            out = hooks.rows_layer(self.layer, x, cache.caches)
            if out is not None:
                return out
        self.layer["self_attn"] = self.rows
        try:
            return self.layer(x, *args, **kwargs)
        finally:
            self.layer["self_attn"] = self.attn


def _layer_list(model: nn.Module) -> list:
    """The list the model's forward pass reads its layers from at every call: the trunk's own
    (mlx-lm's `model.layers` may be a copy of part of it: qwen2's `pipeline_layers`)."""
    trunk = getattr(model, "model", None)  # foreign: mlx-lm's trunk, where the model has one
    layers = trunk.get("layers") if isinstance(trunk, dict) else None  # an nn.Module's children
    return layers if isinstance(layers, list) else model.layers


@contextmanager
def _attention_per_row(model: nn.Module) -> Iterator[None]:
    layers = _layer_list(model)
    if not all(isinstance(layer, dict) and "self_attn" in layer for layer in layers):
        raise CacheError("a layer without `self_attn` cannot take part in a shared pass")
    own = list(layers)
    layers[:] = [_RowsLayer(layer) for layer in own]
    try:
        yield
    finally:
        layers[:] = own


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
    per_row: AbstractContextManager = nullcontext()
    if len(rows) == 1:
        cache = rows[0][0]
    else:
        widths = [tokens.size for _, tokens in rows]
        cache = [_Rows([c[i] for c, _ in rows], widths) for i in range(len(rows[0][0]))]
        per_row = _attention_per_row(model)
    # Not built whole (hooks.serial): the layers compute while Python builds the rest, as a
    # lone pass does; the rows' drafts were timed before it.
    with per_row:
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
