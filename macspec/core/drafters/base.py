"""Drafters propose tokens for the target to verify.

A drafter returns its proposal and the distribution q each token was drawn from; a deterministic
drafter returns q = None (a point mass), which the acceptance rule handles as a one-hot q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from ..sampling import Distribution


@dataclass
class Proposal:
    tokens: mx.array  # (k,) int32 proposed ids
    probs: mx.array | None  # (k, V) distributions they were drawn from; None = point masses


class Drafter(Protocol):
    name: str  # its key in the registry (drafters/__init__.py)
    summary: str  # what it drafts from, in a few words
    # True when the drafter reads the target's hidden states (then `hidden` below is given).
    needs_hidden: bool
    # Optional: decoder layers whose outputs the drafter reads too (joined before the final
    # hidden state in `hidden`); absent or () = the final hidden state only.

    def start(self, prompt: list[int], hidden: mx.array | None = None, max_step: int = 1) -> None:
        """Begin a sequence whose context is `prompt` (the target holds all but its last token).
        `hidden`: the target's hidden states (len(prompt) - 1, H) for the positions it read;
        `max_step`: 1 + the most drafts a proposal will be asked for."""

    def label(self) -> int | None:
        """A grade of the next proposal from the context alone, for the policy to keep separate
        acceptance statistics: the n-gram match length (0 = nothing to propose), or None for a
        draft model."""

    def propose(self, k: int, dist: Distribution, key: mx.array) -> Proposal:
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

    # Optional, for the prompt cache: `state_kind` (None: nothing kept), `snapshot()` between
    # rounds (its live state; the prompt cache copies it), and `resume(state, prompt, n, hidden,
    # max_step)`: start() from a state restored to the first n ids, `hidden` for the rest.


def catch_up_time(drafter: object) -> float:
    """Seconds `drafter` spent reading ids it missed (plain steps, copied rounds) since last
    asked: 0 for drafters that never fall behind (n-gram copies, feature drafts)."""
    take = getattr(drafter, "take_catch_up", None)
    return take() if take is not None else 0.0
