"""What the core needs of a constraint on the output (a grammar, a JSON schema), and the masks it
puts into the sampling distribution. The core never imports a constraint library:
macspec/api/grammar.py implements `Constraint` with llguidance.

Exactness under a constraint: with m_i the mask after the committed ids and drafts d_1..d_{i-1},
the target's p_i and the draft's q_i are both masked by m_i before any sampling transform; the
acceptance rule applied to the masked pair keeps the output distributed as the target's own
constrained sampling (docs/server.md, tests/core/test_constraint_exactness.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx
import numpy as np


class Constraint(Protocol):
    """ "Committed" ids are part of the output; `prefix` ids (drafts not yet verified) follow
    them. Masks are (vocab_size,) bool arrays."""

    vocab_size: int

    def allowed(self, prefix: Sequence[int] = ()) -> np.ndarray:
        """The ids allowed after the committed ids and `prefix` (which must be valid)."""

    def valid_prefix(self, ids: Sequence[int]) -> int:
        """How many of `ids` (after the committed ids) the constraint allows, in order."""

    def commit(self, ids: Sequence[int]) -> None:
        """`ids` become part of the output; ConstraintError if the constraint forbids one."""

    def rollback(self, n: int) -> None:
        """Take back the last `n` committed ids."""

    def accepting(self) -> bool:
        """The output so far is complete (a stop id is allowed now)."""

    def done(self) -> bool:
        """Nothing but a stop id is allowed now."""


def masked(
    logits: mx.array,
    constraint: Constraint,
    extra: mx.array | None,
    first_row: int,
    columns: mx.array | None = None,
) -> mx.array:
    """`logits` (rows, V) with every id the constraint forbids at -inf: row r follows the
    committed ids + extra[:first_row + r]. `columns` (a drafter's own ids, verify.make_dist):
    the logits' columns are those ids, in the order the map gives them.

    A drafter whose own ids include none the constraint allows at a position cannot draft it:
    that row is left unmasked, and so are the rows after a forbidden draft; such a proposal is
    cut before its first forbidden id (verify.allowed_part), at a point that depends on the
    drafts alone, so the chain's length is a stopping rule and the round stays exact."""
    ids = [] if extra is None else extra.tolist()  # the drafts on the host: one sync
    valid = constraint.valid_prefix(ids[: first_row + logits.shape[0] - 1])
    keep = _column_ids(columns, logits.shape[1]) if columns is not None else None
    rows = []
    for r in range(logits.shape[0]):
        if first_row + r > valid:
            rows.append(np.ones(logits.shape[1], dtype=bool))
            continue
        mask = constraint.allowed(ids[: first_row + r])
        if keep is not None:
            mask = mask[keep]
        rows.append(mask if mask.any() else np.ones_like(mask))
    return mx.where(mx.array(np.stack(rows)), logits, -mx.inf)


_COLUMN_IDS: dict[int, tuple[mx.array, np.ndarray]] = {}


def _column_ids(columns: mx.array, width: int) -> np.ndarray:
    """The id of each logits column, from the map id -> column (`width` for ids it lacks)."""
    kept = _COLUMN_IDS.get(id(columns))
    if kept is None or kept[0] is not columns:
        table = np.array(columns)
        ids = np.flatnonzero(table < width)
        order = np.empty(width, dtype=np.int64)
        order[table[ids]] = ids
        kept = (columns, order)
        _COLUMN_IDS.clear()  # one drafter's map at a time
        _COLUMN_IDS[id(columns)] = kept
    return kept[1]
