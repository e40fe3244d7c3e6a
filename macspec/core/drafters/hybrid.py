"""The n-gram lookup first, a model drafter otherwise."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import tree
from ..caches import DraftState
from .base import DistFn, Drafter, Proposal, catch_up_time
from .ngram import NgramDrafter


class HybridDrafter:
    """The n-gram lookup first, the draft model otherwise: when the context repeats itself
    (a long n-gram match), copying is free and usually right, so the draft model is skipped.

    Which drafter runs depends only on the context, never on the target's answer: still exact."""

    name = "model+ngram"
    summary = "an n-gram copy when the context repeats, else the draft model"

    def __init__(self, model: Drafter, ngram: NgramDrafter, min_match: int = 3):
        self.model, self.ngram, self.min_match = model, ngram, min_match
        self.needs_hidden = model.needs_hidden
        self.feature_layers = getattr(model, "feature_layers", ())
        self.used: Drafter = model

    def start(self, prompt: list[int], hidden: mx.array | None = None, max_step: int = 1) -> None:
        self.model.start(prompt, hidden, max_step)
        self.ngram.start(prompt)

    @property
    def state_kind(self) -> str | None:
        return getattr(self.model, "state_kind", None)

    def snapshot(self) -> DraftState | None:
        return self.model.snapshot() if self.state_kind is not None else None

    def resume(self, state, prompt, n, hidden=None, max_step=1) -> None:
        self.model.resume(state, prompt, n, hidden, max_step)
        self.ngram.start(prompt)

    def label(self) -> int | None:
        """The n-gram match length when the next proposal is a copy, None when the model drafts."""
        n = self.ngram.label()
        return n if n >= self.min_match else None

    def propose(self, k: int, dist: DistFn, key: mx.array) -> Proposal:
        tokens, n = self.ngram.lookup(k)
        if n >= self.min_match:  # the same test as label(): context only
            self.used = self.ngram
            return Proposal(mx.array(tokens, dtype=mx.int32), None)
        self.used = self.model
        return self.model.propose(k, dist, key)

    def commit(
        self, k: int, accepted: int, emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        self.ngram.commit(k, accepted, emitted)
        # The model drafted nothing in an n-gram round: for it, this round was a plain step.
        model_k = k if self.used is self.model else 0
        self.model.commit(model_k, accepted, emitted, hidden)

    def take_catch_up(self) -> float:
        return catch_up_time(self.model)

    def abort(self, k: int) -> None:
        if self.used is self.model:
            self.model.abort(k)

    def propose_tree(self, shape: tree.TreeShape) -> tree.Tree:
        self.used = self.model  # trees come from the model; copies stay chains (label())
        return self.model.propose_tree(shape)

    def commit_tree(
        self, t: tree.Tree, accepted: list[int], emitted: list[int], hidden: Any = None
    ) -> None:
        self.ngram.commit(len(t), len(accepted), emitted)
        self.model.commit_tree(t, accepted, emitted, hidden)
