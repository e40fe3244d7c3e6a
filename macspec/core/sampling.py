"""Sampling options and the one function that turns logits into a sampling distribution.

The same `distribution` serves the draft (q) and the target (p). Speculative decoding is exact for
whatever distribution this returns, so every option (penalty, temperature, top-k, top-p, min-p) is
applied here, to both models, identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from ..base.errors import OptionError
from . import hooks
from .constraint import Constraint, masked


@dataclass(frozen=True)
class SamplingOptions:
    """How a token is chosen from logits. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64

    def __post_init__(self) -> None:
        def bad(name: str, value: object, rule: str) -> OptionError:
            return OptionError(f"invalid {name}={value!r}: {rule}")

        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise bad("temperature", self.temperature, "must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be an integer >= 0 (0 = off)")
        if not _is_number(self.min_p) or not 0 <= self.min_p < 1:
            raise bad("min_p", self.min_p, "must be in [0, 1)")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", self.repetition_penalty, "must be a number > 0")
        if not _is_int(self.repetition_context) or self.repetition_context < 1:
            raise bad("repetition_context", self.repetition_context, "must be an integer >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def penalty_windows(history: list[int], extra: mx.array | None, rows: int, size: int) -> mx.array:
    """Token windows for the repetition penalty: row r holds the last `size` tokens of
    history + extra[:r]. Short rows repeat their first id (a duplicate changes nothing)."""
    tail = history[-size:]
    tokens = mx.array(tail, dtype=mx.int32)
    if extra is not None and extra.size:
        tokens = mx.concatenate([tokens, extra.astype(mx.int32)])
    width = min(size, len(tail) + rows - 1)
    index = []
    for r in range(rows):
        end = len(tail) + r
        row = list(range(max(0, end - size), end))
        index.append(row + [row[0]] * (width - len(row)))
    return tokens[mx.array(index)]


def apply_repetition_penalty(logits: mx.array, windows: mx.array, penalty: float) -> mx.array:
    """CTRL-style penalty, as mlx-lm and llama.cpp: divide positive logits, multiply negative."""
    seen = mx.take_along_axis(logits, windows, axis=-1)
    seen = mx.where(seen < 0, seen * penalty, seen / penalty)
    return mx.put_along_axis(logits, windows, seen, axis=-1)


def distribution(
    logits: mx.array, opts: SamplingOptions, windows: mx.array | None = None
) -> mx.array:
    """Probabilities (rows, V) to sample from, given logits (rows, V).

    Order: repetition penalty -> temperature -> top-k -> top-p -> min-p -> renormalise.
    Greedy returns the one-hot of the argmax, so the speculative rule reduces to exact greedy.
    """
    vocab = logits.shape[-1]
    if opts.greedy:
        best = greedy_ids(logits, opts, windows)[:, None]
        return (mx.arange(vocab)[None] == best).astype(mx.float32)
    logits = logits.astype(mx.float32)
    if opts.repetition_penalty != 1.0 and windows is not None:
        logits = apply_repetition_penalty(logits, windows, opts.repetition_penalty)

    # Each filter sees the renormalised survivors of the one before (as llama.cpp's sampler chain).
    probs = hooks.softmax(logits, opts.temperature)
    if 0 < opts.top_k < vocab:
        kth = mx.min(mx.topk(probs, opts.top_k, axis=-1), axis=-1, keepdims=True)
        probs = _renormalise(mx.where(probs >= kth, probs, 0.0))
    if opts.top_p < 1.0:
        # Smallest set of most likely tokens whose mass reaches top_p.
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < opts.top_p
        keep = mx.put_along_axis(mx.zeros(probs.shape, mx.bool_), order, keep_sorted, axis=-1)
        probs = _renormalise(mx.where(keep, probs, 0.0))
    if opts.min_p > 0:
        floor = opts.min_p * mx.max(probs, axis=-1, keepdims=True)
        probs = _renormalise(mx.where(probs >= floor, probs, 0.0))
    return probs


def greedy_ids(
    logits: mx.array, opts: SamplingOptions, windows: mx.array | None = None
) -> mx.array:
    """The id (rows,) that greedy `distribution` puts all its mass on, without building it."""
    logits = logits.astype(mx.float32)
    if opts.repetition_penalty != 1.0 and windows is not None:
        logits = apply_repetition_penalty(logits, windows, opts.repetition_penalty)
    return hooks.argmax(logits)


@dataclass(frozen=True, eq=False)
class Distribution:
    """The sampling distribution of a generation's rows, shared by the draft (q) and the target
    (p): row r follows `history` + extra[:first_row + r] (the repetition penalty's windows and
    the constraint's state depend on the ids before a row).

    `columns` (optional) says the logits cover only some ids: it maps every id to its column,
    or to len(columns of logits) for an id they lack (a drafter with its own smaller
    vocabulary); the missing ids then have probability 0, as they would with logits of -inf.
    `constraint`: its mask comes first, so that every transform chooses among allowed ids."""

    options: SamplingOptions
    history: list[int]  # the generation's ids so far (the loop's own list: read, never changed)
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        """Every row is a one-hot: a drafter may take its argmax alone."""
        return self.options.greedy

    @property
    def needs_history(self) -> bool:
        """Whether rows depend on the ids before them (the penalty's windows, the constraint)."""
        return self.options.repetition_penalty != 1.0 or self.constraint is not None

    def probs(
        self,
        logits: mx.array,
        extra: mx.array | None,
        first_row: int,
        columns: mx.array | None = None,
    ) -> mx.array:
        """Probabilities (rows, V) of logits (rows, V or the columns' ids)."""
        if self.constraint is not None:
            logits = masked(logits, self.constraint, extra, first_row, columns)
        windows = self._windows(logits, extra, first_row)
        if windows is None:
            return distribution(logits, self.options)
        if columns is None:
            return distribution(logits, self.options, windows)
        # Ids outside the logits point at one extra column of -inf, dropped afterwards.
        pad = mx.full((logits.shape[0], 1), -mx.inf, dtype=logits.dtype)
        probs = distribution(mx.concatenate([logits, pad], axis=1), self.options, columns[windows])
        return probs[:, :-1]

    def best(self, logits: mx.array, extra: mx.array | None, first_row: int) -> mx.array | None:
        """Greedy: the id (rows,) probs' one-hot rows hold, without building them; else None."""
        if not self.greedy:
            return None
        if self.constraint is not None:
            logits = masked(logits, self.constraint, extra, first_row)
        return greedy_ids(logits, self.options, self._windows(logits, extra, first_row))

    def _windows(self, logits: mx.array, extra: mx.array | None, first_row: int) -> mx.array | None:
        """The repetition penalty's windows of these rows (None: no penalty)."""
        if self.options.repetition_penalty == 1.0:
            return None
        rows = first_row + logits.shape[0]
        windows = penalty_windows(self.history, extra, rows, self.options.repetition_context)
        return windows[first_row:]


def _renormalise(probs: mx.array) -> mx.array:
    return probs / mx.sum(probs, axis=-1, keepdims=True)


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """Draw one id per row from (possibly unnormalised) probabilities; one-hot rows are exact.

    By inverting the cumulative sum (hooks.inverse_cdf): the first id whose running total
    exceeds u * total, which is never an id of probability 0. Written out because
    mx.random.categorical takes logits: a log and two more ops for its Gumbel noise over the
    whole vocabulary, several times the work of this on a CPU."""
    u = mx.random.uniform(shape=(probs.shape[0], 1), key=key)
    return hooks.inverse_cdf(probs.astype(mx.float32), u)
