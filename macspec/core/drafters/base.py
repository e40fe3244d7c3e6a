"""Drafters propose tokens for the target to verify.

A drafter returns its proposal and the distribution q each token was drawn from; a deterministic
drafter returns q = None (a point mass), which the acceptance rule handles as a one-hot q.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from .. import caches, tree
from ..caches import DraftState
from ..sampling import sample

# probs = dist(logits_rows, extra_tokens, first_row[, columns]): the shared sampling
# distribution (engine.make_dist; `columns` when the logits cover only some ids).
DistFn = Callable[..., mx.array]


@dataclass
class Proposal:
    tokens: mx.array  # (k,) int32 proposed ids
    probs: mx.array | None  # (k, V) distributions they were drawn from; None = point masses


class Drafter(Protocol):
    name: str
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

    # Optional, for the prompt cache: `state_kind` (None: nothing kept), `snapshot()` between
    # rounds (its live state; prefix.py copies it), and `resume(state, prompt, n, hidden,
    # max_step)`: start() from a state restored to the first n ids, `hidden` for the rest.


def prefill(model: nn.Module, cache: list, tokens: list[int], step: int = 512) -> None:
    """Feed `tokens` into `cache` in chunks, so long prompts do not build one huge graph."""
    for i in range(0, len(tokens), step):
        chunk = tokens[i : i + step]
        with caches.forward(cache, len(chunk)):
            model(mx.array(chunk)[None], cache=cache)
        mx.eval(caches.state_arrays(cache))


class ModelDrafter:
    """A small autoregressive model with its own cache.

    The cache always holds the context except `pending`, the ids not yet fed: normally the
    target's last token, or the last draft and the target's token after a full acceptance."""

    name = "model"
    needs_hidden = False

    def __init__(self, model: nn.Module, vocab_size: int, stop_below: float = 0.0):
        self.model = model
        self.vocab_size = vocab_size
        # Adaptive length: stop drafting once the draft's own probability of its token (at
        # temperature 1, so greedy drafts are judged too) falls below this. 0 = never stop.
        self.stop_below = stop_below
        self.cache: list = []
        self.pending: list[int] = []
        self._base = 0  # cache length before the current proposal

    def start(self, prompt: list[int], hidden: mx.array | None = None, max_step: int = 1) -> None:
        # A proposal feeds the pending ids (up to 2) and then its drafts one by one.
        self.resume(None, prompt, 0, hidden, max_step)

    state_kind = "model"

    def snapshot(self) -> DraftState:
        return DraftState(self.state_kind, self.cache, caches.length(self.cache), catches_up=True)

    def resume(
        self,
        state: DraftState | None,
        prompt: list[int],
        n: int,
        hidden: mx.array | None = None,
        max_step: int = 1,
    ) -> None:
        if state is None:  # nothing kept: the whole prompt
            self.cache, n = caches.make_cache(self.model, max_step + 1), 0
        else:
            self.cache = state.cache
        prefill(self.model, self.cache, prompt[n:-1])
        self.pending = prompt[-1:]

    def label(self) -> None:
        return None

    def propose(self, k: int, dist: DistFn, key: mx.array) -> Proposal:
        # No host sync between draft steps: each token feeds the next lazily.
        self._base = caches.length(self.cache)
        tokens, probs = [], []
        inputs = mx.array(self.pending, dtype=mx.int32)
        for i, subkey in enumerate(mx.random.split(key, k)):
            with caches.forward(self.cache, inputs.size, rewindable=True):
                logits = self.model(inputs[None], cache=self.cache)[0, -1:, : self.vocab_size]
            drafted = mx.concatenate(tokens) if tokens else None
            q = dist(logits, drafted, i)
            token = sample(q, subkey)
            tokens.append(token)
            probs.append(q)
            inputs = token
            if self.stop_below > 0 and i + 1 < k:
                # The one host sync per draft token that adaptive length needs.
                confidence = mx.softmax(logits[0], axis=-1)[token[0]]
                if confidence.item() < self.stop_below:
                    break
        return Proposal(mx.concatenate(tokens), mx.concatenate(probs))

    def commit(
        self, k: int, accepted: int, emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        if k == 0:
            self.pending += emitted
            return
        # The pending ids and d_1..d_{k-1} went in (d_k never did); keep the accepted ones.
        kept = min(accepted, k - 1)
        caches.rewind(self.cache, self._base + len(self.pending) + kept)
        self.pending = emitted[kept:]

    def abort(self, k: int) -> None:
        # Back to the state before propose(); the pending ids stay pending.
        caches.rewind(self.cache, self._base)

    def propose_tree(self, shape: tree.TreeShape) -> tree.Tree:
        """Candidates as a tree (tree.grow): the pending ids, then each level's kept nodes fed
        in one tree pass; candidates are ranked by the draft's own probabilities."""
        self._base = caches.length(self.cache)
        n = len(self.pending)
        with caches.forward(self.cache, n, rewindable=True):
            logits = self.model(mx.array(self.pending)[None], cache=self.cache)[0, -1:]
        self._fed: list[int] = []  # tree nodes in the order their entries follow the pending

        def expand(t: tree.Tree, nodes: list[int]) -> mx.array:
            mask = tree.attend(t, self._base + n, self._fed + nodes, nodes)
            root = self._base + n - 1  # the position of the last pending id
            depths = [t.depths[i] for i in nodes]
            with tree.tree_pass(self.model, self.cache, mask, depths, root):
                with caches.forward(self.cache, len(nodes), rewindable=True):
                    ids = mx.array([t.tokens[i] for i in nodes])[None]
                    out = self.model(ids, cache=self.cache)[0, :, : self.vocab_size]
            self._fed += nodes
            return mx.softmax(out, axis=-1)

        return tree.grow(shape, expand, mx.softmax(logits[:, : self.vocab_size], axis=-1))

    def commit_tree(
        self, t: tree.Tree, accepted: list[int], emitted: list[int], hidden: Any = None
    ) -> None:
        # Keep the pending ids and the accepted nodes the draft was fed (a prefix of the path).
        fed = [t.origin[a] for a in accepted if t.origin[a] in self._fed]
        n = len(self.pending)
        rows = [*range(n), *(n + self._fed.index(a) for a in fed)]
        tree.compact(self.cache, self._base, rows)
        self.pending = emitted[len(fed) :]


# Labels of copied proposals: the length of the context's match, in these buckets (a bucket
# is named by its shortest length). Longer matches are followed far more often, so each bucket
# keeps its own acceptance estimate, starting from COPY_PRIORS: how often the target's next id
# was the copied one (SmolLM2-135M-Instruct, greedy, 128 tokens for 52 of distill's training
# prompts, 3,373 matches; the benchmark prompts gave .16 / .45 / .60 / .69 / .86 / .96 / .97).
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 16)
COPY_PRIORS = {1: 0.18, 2: 0.45, 3: 0.53, 4: 0.8, 6: 0.83, 8: 0.87, 16: 0.93}


def match_label(length: int) -> int:
    """The bucket of a match length (0 = no match)."""
    return max((b for b in MATCH_BUCKETS if b <= length), default=0)


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the last n ids (longest n
    first) in the context and propose what followed it. Proposals are point masses (q = None).

    An index maps each n-gram to the position after its latest occurrence; an n-gram is indexed
    only once the id after it exists, so the current suffix never matches itself. The match is
    then measured backwards beyond n (up to `max_match` ids): its length grades the proposal."""

    name = "ngram"
    needs_hidden = False

    def __init__(
        self,
        max_n: int = 4,
        min_n: int = 1,
        max_match: int = 32,
        stop_ids: frozenset[int] = frozenset(),
    ):
        self.max_n, self.min_n, self.max_match = max_n, min_n, max_match
        # Copies end before these ids (the chat template's turn markers, EOS): an answer that
        # restates the question matches it, but the question's end-of-turn never follows.
        self.stop_ids = stop_ids
        self.history: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}

    def start(self, prompt: list[int], hidden: mx.array | None = None, max_step: int = 1) -> None:
        self.history, self.index = [], {}
        self._extend(prompt)

    state_kind = None  # the index is rebuilt from the ids: cheap next to any model's prefill

    def resume(self, state, prompt, n, hidden=None, max_step=1) -> None:
        self.start(prompt)

    def _extend(self, ids: list[int]) -> None:
        h = self.history
        for t in ids:
            i = len(h)  # position of t: every n-gram ending just before it now has a successor
            for n in range(self.min_n, self.max_n + 1):
                if i >= n:
                    self.index[tuple(h[i - n : i])] = i
            h.append(t)

    def lookup(self, k: int) -> tuple[list[int], int]:
        """(continuation of up to k ids, length of the match); ([], 0) if none."""
        h = self.history
        for n in range(min(self.max_n, len(h)), self.min_n - 1, -1):
            at = self.index.get(tuple(h[len(h) - n :]))
            if at is not None:
                # Copy with overlap (as LZ77): past the end of the history, keep copying the
                # proposal itself, so a repeating cycle is proposed for the full k.
                out: list[int] = []
                for j in range(at, at + k):
                    t = h[j] if j < len(h) else out[j - len(h)]
                    if t in self.stop_ids:
                        break
                    out.append(t)
                if not out:
                    return [], 0
                length = n
                while length < min(self.max_match, at) and h[at - 1 - length] == h[-1 - length]:
                    length += 1
                return out, length
        return [], 0

    def label(self) -> int:
        return match_label(self.lookup(1)[1])

    def propose(self, k: int, dist: DistFn, key: mx.array) -> Proposal:
        tokens, _ = self.lookup(k)
        return Proposal(mx.array(tokens, dtype=mx.int32), None)

    def commit(
        self, k: int, accepted: int, emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        self._extend(emitted)

    def abort(self, k: int) -> None:
        pass


class HybridDrafter:
    """The n-gram lookup first, the draft model otherwise: when the context repeats itself
    (a long n-gram match), copying is free and usually right, so the draft model is skipped.

    Which drafter runs depends only on the context, never on the target's answer: still exact."""

    name = "model+ngram"

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
