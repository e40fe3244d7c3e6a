"""A draft model's output head over the most frequent ids only (FR-Spec, Zhao et al. 2025).

A big vocabulary's head is a large part of a small draft's pass (Qwen2.5's 151,936 rows are a
fifth of a 0.5B draft's step on a CPU). The pruned head scores a subset S of the ids, so the
draft's q is 0 outside S. Exactness does not depend on q: the acceptance rule min(1, p/q) and
the residual norm(max(0, p - q)) over the whole vocabulary (verify.accept) give the target's
distribution for any q, so the ids outside S still come, from the residual, as often as the
target samples them; only the acceptance rate depends on S.

S is the `size` lowest ids plus the special ids (end of turn, end of text): a byte-level BPE
vocabulary lists its tokens in merge order, most frequent first (docs/drafting.md measures how
much of a target's output S covers).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import hooks
from ..target import head_module, hidden_states

log = logging.getLogger("macspec.core")

# Ids a pruned head scores by default, and the smallest vocabulary pruned by default: below
# twice this size the head is too small a part of the pass to pay for the acceptance it costs.
DEFAULT_SIZE = 32768
# Heads whose rows are rows of their arrays (and the switched classes of the CPU products).
HEADS = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)


def chosen_size(vocab_size: int, asked: int | None) -> int:
    """How many low ids a draft of `vocab_size` ids scores: `asked` (0: the whole vocabulary),
    or by default DEFAULT_SIZE when the vocabulary is over twice that. 0 = no pruning."""
    size = (DEFAULT_SIZE if vocab_size > 2 * DEFAULT_SIZE else 0) if asked is None else asked
    return size if 0 < size < vocab_size else 0


def frequent_ids(size: int, vocab_size: int, keep: Iterable[int] = ()) -> mx.array:
    """S: the `size` lowest ids and the ids of `keep` (special ids) below `vocab_size`, sorted."""
    ids = set(range(min(size, vocab_size))) | {int(i) for i in keep if 0 <= int(i) < vocab_size}
    return mx.array(sorted(ids), dtype=mx.int32)


def _rows(source: nn.Module, ids: mx.array) -> nn.Module:
    """A copy of the head module `source` holding the rows of `ids` alone."""
    module = copy.copy(source)
    for name in ("weight", "scales", "biases", "bias"):
        if name in source:  # in mlx's layout, whatever the accelerator holds (hooks.take_rows)
            module[name] = mx.contiguous(hooks.take_rows(source, name, ids))
    mx.eval(module.parameters())
    return module


class PrunedHead:
    """The draft's own head (tied or not, quantized or not) with only the rows of `ids`.

    Copies of the head module with its rows taken, so that it runs the same product (an
    accelerated one included) on fewer rows; a tied input embedding stays whole."""

    def __init__(self, model: nn.Module, ids: mx.array, vocab_size: int):
        self.source, self.tied = head_module(model)
        self.vocab_size = vocab_size
        self.parts = [_rows(self.source, ids)]
        self._index(ids)

    def _index(self, ids: mx.array) -> None:
        self.ids = ids  # the id of each logits column
        # Id -> column of the pruned logits, len(ids) for the ids outside S (verify.make_dist).
        table = np.full(self.vocab_size, ids.size, np.int32)
        table[np.array(ids)] = np.arange(ids.size, dtype=np.int32)
        self.lookup = mx.array(table)

    def with_context(self, context: Iterable[int]) -> PrunedHead:
        """This head and the rows of the ids of `context` (a prompt) it lacks: the names and
        words a prompt holds tend to recur in its answer. S then depends on the context alone,
        which keeps the round exact."""
        table = np.array(self.lookup)
        lacking = {int(i) for i in context if 0 <= int(i) < self.vocab_size}
        more = sorted(i for i in lacking if table[i] == self.size)
        if not more:
            return self
        head = copy.copy(self)
        extra = mx.array(more, dtype=mx.int32)
        head.parts = [*self.parts, _rows(self.source, extra)]
        head._index(mx.concatenate([self.ids, extra]))
        return head

    @property
    def size(self) -> int:
        return self.ids.size

    def __call__(self, hidden: mx.array) -> mx.array:
        """Logits (rows, |S|) from final hidden states (rows, H)."""
        out = [m.as_linear(hidden) if self.tied else m(hidden) for m in self.parts]
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)

    def full(self, small: mx.array) -> mx.array:
        """(rows, vocab_size) probabilities from rows over S (0 elsewhere)."""
        out = mx.zeros((small.shape[0], self.vocab_size), dtype=small.dtype)
        ids = mx.broadcast_to(self.ids[None], small.shape)
        return mx.put_along_axis(out, ids, small, axis=-1)

    def matches(self, model: nn.Module, probe: list[int]) -> bool:
        """Whether the model's own logits at S are this head's (False for a model that changes
        its logits after the head, e.g. a soft cap or a scale: then the head is not used)."""
        tokens = mx.array(probe, dtype=mx.int32)
        own = model(tokens[None])[0, -1:, : self.vocab_size][:, self.ids]
        mine = self(hidden_states(model, tokens, None)[-1:])
        if own.shape != mine.shape:
            return False
        return bool(mx.allclose(own, mine, rtol=1e-3, atol=1e-3).item())


def prune_head(
    model: nn.Module, vocab_size: int, size: int, keep: Iterable[int] = ()
) -> PrunedHead | None:
    """The model's head over the `size` most frequent ids and `keep`, or None when `size` is 0
    or the model's logits are not its head's output alone."""
    if size <= 0:
        return None
    source, _ = head_module(model)
    if not isinstance(source, HEADS):
        log.info("the draft's head is a %s: its whole head is used", type(source).__name__)
        return None
    head = PrunedHead(model, frequent_ids(size, vocab_size, keep), vocab_size)
    probe = [(7 * i) % max(vocab_size - 1, 1) + 1 for i in range(4)]
    if not head.matches(model, probe):
        log.info("the draft's logits are not its head's alone: its whole head is used")
        return None
    return head
