"""Drafters propose tokens for the target to verify.

A drafter returns its proposal and the distribution q each token was drawn from; a deterministic
drafter returns q = None (a point mass), which the acceptance rule handles as a one-hot q.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .sampling import sample

# probs = dist(logits_rows, extra_tokens, first_row): the shared sampling distribution.
DistFn = Callable[[mx.array, mx.array | None, int], mx.array]


@dataclass
class Proposal:
    tokens: mx.array  # (k,) int32 proposed ids
    probs: mx.array | None  # (k, V) distributions they were drawn from; None = point masses


class Drafter(Protocol):
    name: str
    # True when the drafter reads the target's hidden states (then `hidden` below is given).
    needs_hidden: bool

    def start(self, prompt: list[int], hidden: mx.array | None = None) -> None:
        """Begin a sequence whose context is `prompt` (the target holds all but its last token).
        `hidden`: the target's hidden states (len(prompt) - 1, H) for the positions it read."""

    def propose(self, k: int, dist: DistFn, key: mx.array) -> Proposal:
        """Propose up to k next tokens (lazily evaluated arrays are fine)."""

    def commit(
        self, k: int, accepted: int, emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        """After verification: `accepted` of the k proposed were kept, then `emitted` (the kept
        drafts plus the target's token) extend the context. k == 0 is a plain target step.
        `hidden`: the target's hidden states at the positions it kept this round, i.e. the
        previous last id and the accepted drafts (accepted + 1 rows)."""

    def abort(self, k: int) -> None:
        """Undo a proposal of k tokens whose round failed, so the next round starts clean."""


def prefill(model: nn.Module, cache: list, tokens: list[int], step: int = 512) -> None:
    """Feed `tokens` into `cache` in chunks, so long prompts do not build one huge graph."""
    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i : i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


class ModelDrafter:
    """A small autoregressive model with its own KV cache.

    The cache always holds the context except `pending`, the ids not yet fed: normally the
    target's last token, or the last draft and the target's token after a full acceptance."""

    name = "model"
    needs_hidden = False

    def __init__(self, model: nn.Module, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        self.cache: list = []
        self.pending: list[int] = []
        self._offset = 0  # cache length before the current proposal, for abort()

    def start(self, prompt: list[int], hidden: mx.array | None = None) -> None:
        self.cache = make_prompt_cache(self.model)
        prefill(self.model, self.cache, prompt[:-1])
        self.pending = prompt[-1:]

    def propose(self, k: int, dist: DistFn, key: mx.array) -> Proposal:
        # No host sync between draft steps: each token feeds the next lazily.
        self._offset = self.cache[0].offset
        tokens, probs = [], []
        inputs = mx.array(self.pending, dtype=mx.int32)
        for i, subkey in enumerate(mx.random.split(key, k)):
            logits = self.model(inputs[None], cache=self.cache)[0, -1:, : self.vocab_size]
            drafted = mx.concatenate(tokens) if tokens else None
            q = dist(logits, drafted, i)
            token = sample(q, subkey)
            tokens.append(token)
            probs.append(q)
            inputs = token
        return Proposal(mx.concatenate(tokens), mx.concatenate(probs))

    def commit(
        self, k: int, accepted: int, emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        if k == 0:
            self.pending += emitted
            return
        fed = k - 1  # the pending ids plus d_1..d_{k-1} went in; d_k never did
        kept = min(accepted, fed)
        trim_prompt_cache(self.cache, fed - kept)
        self.pending = emitted[kept:]

    def abort(self, k: int) -> None:
        # Back to the state before propose(); the pending ids stay pending.
        trim_prompt_cache(self.cache, self.cache[0].offset - self._offset)
