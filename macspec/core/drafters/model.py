"""A draft model: a small autoregressive model with its own cache, drafting as chains or trees."""

from __future__ import annotations

from time import perf_counter

import mlx.core as mx
import mlx.nn as nn

from .. import caches, hooks, tree
from ..caches import DraftState
from ..sampling import sample
from ..target import hidden_states
from .base import Distribution, Drafter, Proposal
from .pruned import PrunedHead


class ModelDrafter(Drafter):
    """A small autoregressive model with its own cache.

    The cache always holds the context except `pending`, the ids not yet fed: normally the
    target's last token, or the last draft and the target's token after a full acceptance.
    `head`: a head over the most frequent ids only (pruned.py) for chains; trees use the
    model's own head."""

    name = "model"
    summary = "the draft model only"
    needs_hidden = False

    def __init__(
        self,
        model: nn.Module,
        vocab_size: int,
        stop_below: float = 0.0,
        head: PrunedHead | None = None,
        context: int = 0,
    ):
        self.model = model
        # Read only a prompt's last `context` ids (0: all of it): the draft only proposes, so
        # what it reads changes the speed (its prefill, its attention), never the answer.
        self.context = context
        self._start = 0  # context ids before the draft's cache (a prompt's unread head)
        self.vocab_size = vocab_size
        self.pruned = head  # over the frequent ids; `head` adds the prompt's (start/resume)
        self.head = head
        # Adaptive length: stop drafting once the draft's own probability of its token (at
        # temperature 1, so greedy drafts are judged too) falls below this. 0 = never stop.
        self.stop_below = stop_below
        self.cache: list = []
        self.pending: list[int] = []
        self._base = 0  # cache length before the current proposal
        self._caught_up = 0.0  # seconds spent reading missed ids since take_catch_up()

    def start(self, prompt: list[int], hidden: mx.array | None = None, max_step: int = 1) -> None:
        # Nothing is read yet: the prompt waits as pending ids and the first proposal reads it
        # (_catch_up). The answer's first token is the target's plain step, so the draft's
        # prefill is off the time to the first token (issue 50: 1.34x plain at 512 ids).
        self.cache = caches.make_cache(self.model, max_step + 1)
        self._start = max(0, len(prompt) - 1 - self.context) if self.context else 0
        self.pending = prompt[self._start :]
        if self.pruned is not None:
            self.head = self.pruned.with_context(prompt)

    state_kind = "model"
    rebuilds_from_ids = True  # resume(None, ...) reads the prompt's end afresh

    def snapshot(self) -> DraftState:
        held = self._start + caches.length(self.cache)
        return DraftState(self.state_kind, self.cache, held, catches_up=True, start=self._start)

    def resume(
        self,
        state: DraftState | None,
        prompt: list[int],
        n: int,
        hidden: mx.array | None = None,
        max_step: int = 1,
    ) -> None:
        unread = len(prompt) - 1 - n
        if state is None or (self.context and unread > self.context):  # afresh: the prompt's end
            self.cache = caches.make_cache(self.model, max_step + 1)
            n = max(0, len(prompt) - 1 - self.context) if self.context else 0
            self._start = n
        else:
            self.cache, self._start = state.cache, state.start
        caches.prefill(self.model, self.cache, prompt[n:-1])
        self.pending = prompt[-1:]
        if self.pruned is not None:
            self.head = self.pruned.with_context(prompt)

    def label(self) -> None:
        return None

    def propose(self, k: int, dist: Distribution, key: mx.array) -> Proposal:
        # No host sync between draft steps (but adaptive length's): each token feeds the next.
        self._catch_up()
        self._base = caches.length(self.cache)
        greedy = dist.greedy
        columns = () if self.head is None else (self.head.lookup,)
        tokens, probs = [], []
        inputs = mx.array(self.pending, dtype=mx.int32)
        for i, subkey in enumerate(mx.random.split(key, k)):
            with caches.forward(self.cache, inputs.size, rewindable=True):
                logits = self._logits(inputs)
            drafted = mx.concatenate(tokens) if tokens else None
            q = dist.probs(logits, drafted, i, *columns)
            # Greedy q is the one-hot of its argmax: the draft is that id, q a point mass.
            index = mx.argmax(q, axis=-1).astype(mx.uint32) if greedy else sample(q, subkey)
            token = index if self.head is None else self.head.ids[index]
            tokens.append(token)
            probs.append(q)
            inputs = token
            if i + 1 == k:
                break
            if self.stop_below > 0 and self._confidence(logits, index) < self.stop_below:
                break
        if greedy:
            return Proposal(mx.concatenate(tokens), None)
        q = mx.concatenate(probs)
        return Proposal(mx.concatenate(tokens), q if self.head is None else self.head.full(q))

    def _catch_up(self) -> None:
        """Read the ids missed in plain steps or copied rounds (more than the usual 1-2 pending)
        before drafting, timed apart: a policy judges a round by its own time, not by the
        length of the plain stretch before it (else a long stretch makes every probe lose)."""
        if len(self.pending) <= 2:
            return
        t0 = perf_counter()
        caches.prefill(self.model, self.cache, self.pending[:-1])
        self.pending = self.pending[-1:]
        self._caught_up += perf_counter() - t0

    def take_catch_up(self) -> float:
        """Seconds spent catching up since the last call."""
        seconds, self._caught_up = self._caught_up, 0.0
        return seconds

    def _logits(self, inputs: mx.array) -> mx.array:
        """(1, columns) logits after `inputs` (fed to the cache): over the pruned head's ids,
        else over the vocabulary."""
        if self.head is None:
            return self.model(inputs[None], cache=self.cache)[0, -1:, : self.vocab_size]
        return self.head(hidden_states(self.model, inputs, self.cache)[-1:])

    @staticmethod
    def _confidence(logits: mx.array, index: mx.array) -> float:
        """The draft's own probability of its pick at temperature 1: the one host sync per
        draft token that adaptive length needs."""
        return hooks.softmax(logits.astype(mx.float32))[0, index[0]].item()

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
        self._catch_up()
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
        self, t: tree.Tree, accepted: list[int], emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        # Keep the pending ids and the accepted nodes the draft was fed (a prefix of the path).
        fed = [t.origin[a] for a in accepted if t.origin[a] in self._fed]
        n = len(self.pending)
        rows = [*range(n), *(n + self._fed.index(a) for a in fed)]
        tree.compact(self.cache, self._base, rows)
        self.pending = emitted[len(fed) :]
