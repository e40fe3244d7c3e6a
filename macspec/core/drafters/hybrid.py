"""The n-gram lookup first, a model drafter otherwise."""

from __future__ import annotations

import mlx.core as mx

from ...base.errors import OptionError
from .. import tree
from ..caches import DraftState
from .base import Distribution, Drafter, Proposal
from .ngram import NgramDrafter


class HybridDrafter(Drafter):
    """The n-gram lookup first, the draft model otherwise: when the context repeats itself
    (a long n-gram match), copying is free and usually right, so the draft model is skipped.
    A short match (1 to min_match - 1 ids) may go either way: labels() offers both and the
    policy may choose() one by what each paid so far (a weak draft model loses to short
    copies on one answer and beats them on another); without a choice the model drafts.

    Which drafter runs depends only on the context and past rounds, never on the target's
    answer for the round: still exact."""

    name = "model+ngram"
    summary = "an n-gram copy when the context repeats, else the draft model"

    def __init__(self, model: Drafter, ngram: NgramDrafter, min_match: int = 3):
        self.model, self.ngram, self.min_match = model, ngram, min_match
        self.needs_hidden = model.needs_hidden
        self.feature_layers = model.feature_layers
        self.used: Drafter = model
        self._choice: tuple[int, int | None] | None = None  # (context length, label) chosen

    def start(self, prompt: list[int], hidden: mx.array | None = None, max_step: int = 1) -> None:
        self.model.start(prompt, hidden, max_step)
        self.ngram.start(prompt)
        self._choice = None

    @property
    def state_kind(self) -> str | None | bool:
        return self.model.state_kind

    @property
    def rebuilds_from_ids(self) -> bool:
        return self.model.rebuilds_from_ids

    def snapshot(self) -> DraftState | None:
        return self.model.snapshot() if self.state_kind is not None else None

    def resume(self, state, prompt, n, hidden=None, max_step=1) -> None:
        self.model.resume(state, prompt, n, hidden, max_step)
        self.ngram.start(prompt)
        self._choice = None

    def labels(self) -> tuple[int | None, ...]:
        """The labels the next proposal may take, the default first: a long match's copy
        alone; for a short one the model (None), then the copy (its match bucket)."""
        n = self.ngram.label()
        if n >= self.min_match:
            return (n,)
        return (None, n) if n > 0 else (None,)

    def choose(self, label: int | None) -> None:
        """Draft the next proposal as `label` (one of labels()) says; the choice holds for
        this context only (the next round's is longer)."""
        if label not in self.labels():
            raise OptionError(f"the hybrid drafter cannot propose label {label!r} here")
        self._choice = (len(self.ngram.history), label)

    def label(self) -> int | None:
        """The n-gram match bucket when the next proposal is a copy, None when the model drafts:
        the one chosen for this context, else the default."""
        if self._choice is not None and self._choice[0] == len(self.ngram.history):
            return self._choice[1]
        return self.labels()[0]

    def propose(self, k: int, dist: Distribution, key: mx.array) -> Proposal:
        if self.label() is not None:  # context and past rounds only (choose())
            self.used = self.ngram
            return Proposal(mx.array(self.ngram.lookup(k)[0], dtype=mx.int32), None)
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
        return self.model.take_catch_up()

    def drafted_by(self) -> str:
        return self.used.name

    def abort(self, k: int) -> None:
        if self.used is self.model:
            self.model.abort(k)

    def propose_tree(self, shape: tree.TreeShape) -> tree.Tree:
        self.used = self.model  # trees come from the model; copies stay chains (label())
        return self.model.propose_tree(shape)

    def commit_tree(
        self, t: tree.Tree, accepted: list[int], emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        self.ngram.commit(len(t), len(accepted), emitted)
        self.model.commit_tree(t, accepted, emitted, hidden)
