"""Drafting with a model's own multi-token-prediction (MTP) heads (DeepSeek-V3, GLM-4.5,
Qwen3-Next / Qwen3.5, MiMo; models/mtp.py builds them from what `macspec convert` kept).

Head j at position t reads (s^j_t, x_{t+1+j}): s^0_t is the target's final hidden state after
x_t, s^j_t (j >= 1) the previous head's output at t (recycled: out_norm'd, mtp.json `recycle`).
Its output predicts x_{t+2+j}. Drafting after a context x_0..x_{N-1} (the target has read all
but x_{N-1}): depth d <= count runs head d-1 at position N-2 (chaining the heads, DeepSeek's
MTP); past the last head, head (d-1) mod count continues at the next position with its own
recycled output and the drafted id (vLLM's `spec_step_idx % num_mtp_layers`).

Each head keeps its own KV cache of the positions whose inputs are real (the target's features,
accepted ids). Head j's real positions end j before head 0's (its id runs j further ahead), so
head j's cache lags; `pend[j]` holds the real input states of the positions it has not read.
commit() rewinds every head to its real positions and queues the newly real states; what the
heads compute never touches exactness: the verifier sees q (the distribution each draft was drawn
from) and applies the exact rule (verify.accept).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ...base.errors import CacheError, ModelError
from .. import caches, tree
from ..caches import DraftState
from ..sampling import sample
from ..target import language_model, output_head
from .base import Distribution, Drafter, Proposal

# Draft confidence (its own probability of the token, temperature 1) below which adaptive drafting
# stops a proposal early (as the EAGLE drafter: a doubtful token is rarely accepted).
STOP_BELOW = 0.3
# Pending states of a later head beyond which commit() feeds them (bounded memory and graphs).
PILE = 64


class MtpDrafter(Drafter):
    """Drafter protocol (drafters/base.py) over the target's MTP heads (models/mtp.py MtpHead:
    head(hidden, embeds, mask, cache) -> out; out_norm; optional own embed / head)."""

    name = "mtp"
    summary = "the target's own multi-token-prediction heads"
    needs_hidden = True
    feature_layers: tuple[int, ...] = ()  # the final hidden state only

    def __init__(
        self,
        heads: list[nn.Module],
        target: nn.Module,
        vocab_size: int,
        recycle_normed: bool = True,
        stop_below: float = 0.0,
    ):
        if not heads:
            raise ModelError("the MTP drafter needs at least one head")
        self.heads, self.target, self.vocab_size = heads, target, vocab_size
        self.recycle_normed, self.stop_below = recycle_normed, stop_below
        self.count = len(heads)
        self._reset()

    def _reset(self) -> None:
        self.caches = [KVCache() for _ in self.heads]
        self.pend: list[mx.array | None] = [None] * self.count  # (m_j, H) real input states
        self.ids: list[int] = []  # the context
        self._at: list[int] = []  # each head's cache offset when the proposal began
        self._outs: dict[int, mx.array] = {}  # head j's outputs (n, H) over positions at[j]..N-2
        self._proposed = False

    # ---------------------------------------------------------------- the heads' arithmetic

    def _embed(self, j: int, ids: mx.array) -> mx.array:
        head = self.heads[j]
        table = head.embed if "embed" in head else language_model(self.target).model.embed_tokens
        return table(ids)

    def _recycle(self, j: int, out: mx.array) -> mx.array:
        """What the next head (or depth) reads of head j's output."""
        return self.heads[j].out_norm(out) if self.recycle_normed else out

    def _logits(self, j: int, out: mx.array) -> mx.array:
        """(rows, vocab_size) logits of head j's outputs (rows, H)."""
        head = self.heads[j]
        normed = head.out_norm(out)
        logits = head.head(normed) if "head" in head else output_head(self.target, normed)
        return logits[:, : self.vocab_size].astype(mx.float32)

    def _feed(self, j: int, states: mx.array, ids: mx.array) -> mx.array:
        """Head j over the next rows of its cache: states (n, H), ids (n,) -> outputs (n, H)."""
        x = states[None]
        mask = create_attention_mask(x, self.caches[j], return_array=True)
        return self.heads[j](x, self._embed(j, ids)[None], mask, self.caches[j])[0]

    # ---------------------------------------------------------------- the protocol

    def start(self, prompt: list[int], hidden: mx.array | None = None, max_step: int = 1) -> None:
        self.resume(None, prompt, 0, hidden, max_step)

    def label(self) -> None:
        return None

    def propose(self, k: int, dist: Distribution, key: mx.array) -> Proposal:
        n_ctx = len(self.ids)
        if self.pend[0] is None:  # cannot happen after the loop's first plain step
            raise ModelError("the MTP heads have no target hidden state to draft from")
        self._at, self._outs, self._proposed = [c.offset for c in self.caches], {}, True
        real = mx.array(self.ids, dtype=mx.int32)
        tokens: list[mx.array] = []
        probs: list[mx.array] = []
        last, last_j = None, 0  # (1, H) the latest output, of head last_j
        for d, subkey in enumerate(mx.random.split(key, k), start=1):
            j = (d - 1) % self.count
            if d <= self.count:  # head j reads its real rows up to position N-2 (see _chain)
                out = self._chain(j, real, tokens, n_ctx)
            else:  # past the last head: the next position, on the previous output
                out = self._feed(j, self._recycle(last_j, last), tokens[-1])
            last, last_j = out[-1:], j
            logits = self._logits(j, last)
            drafted = mx.concatenate(tokens) if tokens else None
            q = dist.probs(logits, drafted, d - 1)
            token = sample(q, subkey)
            tokens.append(token)
            probs.append(q)
            if d == k:
                break
            if self.stop_below > 0:
                confidence = mx.softmax(logits[0], axis=-1)[token[0]]
                if confidence.item() < self.stop_below:
                    break
        return Proposal(mx.concatenate(tokens), mx.concatenate(probs))

    def propose_tree(self, shape: tree.TreeShape) -> tree.Tree:
        """One head (Pair.check_trees refuses several): candidates as a tree (tree.grow), each
        kept node's recycled output feeding its children, a level at a time in one tree pass of
        the head's block, as EagleDrafter.propose_tree."""
        if self.count != 1 or self.pend[0] is None:
            raise ModelError("MTP token trees need one head and a target hidden state")
        self._at, self._outs, self._proposed = [self.caches[0].offset], {}, True
        n_ctx = len(self.ids)
        outs = {-1: self._chain(0, mx.array(self.ids, dtype=mx.int32), [], n_ctx)[-1:]}
        context, fed, head, cache = self.caches[0].offset, [], self.heads[0], self.caches[0]

        def probs(out: mx.array) -> mx.array:
            return mx.softmax(self._logits(0, out), axis=-1)

        def expand(t: tree.Tree, nodes: list[int]) -> mx.array:
            mask = tree.attend(t, context, fed + nodes, nodes)
            states = mx.concatenate([self._recycle(0, outs[t.parents[i]]) for i in nodes])
            ids = mx.array([t.tokens[i] for i in nodes], dtype=mx.int32)
            with tree.tree_pass(head, [cache], mask, [t.depths[i] for i in nodes], context - 1):
                out = head(states[None], self._embed(0, ids)[None], mask, cache)[0]
            fed.extend(nodes)
            outs.update({i: out[r : r + 1] for r, i in enumerate(nodes)})
            return probs(out)

        return tree.grow(shape, expand, probs(outs[-1]))

    def commit_tree(
        self, t: tree.Tree, accepted: list[int], emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        # The tree's rows go; the target's states of the kept ids are queued (as commit).
        self.commit(len(t), len(accepted), emitted, hidden)

    def _chain(self, j: int, real: mx.array, tokens: list[mx.array], n_ctx: int) -> mx.array:
        """Head j (first use in a proposal) over positions at[j]..N-2: states from pend[j] then
        head j-1's outputs of this proposal, ids x_{t+1+j} (the last j of them drafted)."""
        at = self._at[j]
        states = self._states(j)
        ids = real[at + 1 + j :]
        if j:
            ids = mx.concatenate([ids, *tokens[:j]])
        if states.shape[0] != n_ctx - 1 - at or ids.size != states.shape[0]:
            raise CacheError(
                f"MTP head {j}: {states.shape[0]} states and {ids.size} ids for positions "
                f"{at}..{n_ctx - 2}"
            )
        out = self._feed(j, states, ids)
        self._outs[j] = out
        return out

    def _states(self, j: int) -> mx.array:
        """Head j's input states for positions at[j]..N-2 (while proposing, after head j-1 ran):
        its pending real states, then head j-1's recycled outputs of this proposal."""
        parts = [p for p in (self.pend[j],) if p is not None]
        if j and j - 1 in self._outs:
            parts.append(self._recycle(j - 1, self._outs[j - 1]))
        if not parts:
            return mx.zeros((0, self.target_width))
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]

    @property
    def target_width(self) -> int:
        return self.heads[0].out_norm.weight.shape[0]

    def commit(
        self, k: int, accepted: int, emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        if k > 0 and self._proposed:
            self._keep_real(accepted)
        self._proposed = False
        self.ids += emitted
        self._queue(hidden, len(emitted))
        # Proposals that stop before a head leave its states piling up: feed them now and then.
        if any(p is not None and p.shape[0] > PILE for p in self.pend[1:]):
            self._catch_up()

    def _keep_real(self, n: int) -> None:
        """After a proposal in which n drafts were accepted: every head back to its real
        positions, and the newly real outputs of head j-1 queued as head j's input states."""
        n_ctx = len(self.ids)
        # Head j's row t read x_{t+1+j}: real while that id is in the context or an accepted
        # draft (t + 1 + j <= N - 1 + n); head 0 ran to N-2, the cycled rows beyond are dropped.
        kept = [
            min(n_ctx - 1, n_ctx - 1 + n - j) if j in self._outs else self._at[j]
            for j in range(self.count)
        ]
        for j in range(self.count):
            caches.rewind([self.caches[j]], kept[j])
        pend = [None] * self.count
        for j in range(1, self.count):
            if j - 1 not in self._outs:  # nothing new upstream: unchanged
                pend[j] = self.pend[j]
                continue
            full = self._states(j)  # positions at[j]..N-2
            lo, hi = kept[j] - self._at[j], kept[j - 1] - self._at[j]
            pend[j] = full[lo:hi] if hi > lo else None
        self.pend = pend  # head 0's pending states were all read (it ran to N-2)

    def _queue(self, hidden: mx.array | None, n: int) -> None:
        """The target's hidden states of the n positions it just kept: head 0's next states."""
        if n == 0 and hidden is None:  # a one-token prompt: the target read nothing yet
            return
        if hidden is None or hidden.shape[0] != n:
            got = None if hidden is None else hidden.shape[0]
            raise ModelError(f"the MTP heads need {n} target hidden states, got {got}")
        if n:
            rows = [p for p in (self.pend[0], hidden) if p is not None]
            self.pend[0] = mx.concatenate(rows) if len(rows) > 1 else rows[0]

    def abort(self, k: int) -> None:
        if self._proposed:
            for c, at in zip(self.caches, self._at, strict=True):
                caches.rewind([c], at)
        self._proposed = False

    # ---------------------------------------------------------------- start and the prompt cache

    @property
    def state_kind(self) -> str | bool:
        """The kind "mtp" for one head; several heads' caches lag each other, which the prompt
        cache's one-length states cannot hold: False keeps none (their prompt is read whole)."""
        return "mtp" if self.count == 1 else False

    def snapshot(self) -> DraftState:
        """One head: its cache and pending states (positions cache.offset.. of the context)."""
        held = self.caches[0].offset + (0 if self.pend[0] is None else self.pend[0].shape[0])
        extra = (self.pend[0], self.ids[: held + 1])
        return DraftState("mtp", list(self.caches), held, lookahead=1, extra=extra)

    def resume(
        self,
        state: DraftState | None,
        prompt: list[int],
        n: int,
        hidden: mx.array | None = None,
        max_step: int = 1,
    ) -> None:
        """Start from `state` holding the first n positions (one head); `hidden`: the target's
        states of positions n.. (those it read after them)."""
        self._reset()
        self.ids = list(prompt)
        if state is not None:
            if len(state.cache) != self.count:
                raise CacheError(
                    f"a state of {len(state.cache)} MTP heads cannot resume {self.count} heads"
                )
            self.caches = list(state.cache)
            features, _ = state.extra
            kept = n - self.caches[0].offset  # positions past the cache: its pending states
            if kept > 0:
                self.pend[0] = features[:kept]
        self._queue(hidden, len(prompt) - 1 - n if hidden is not None else 0)
        self._catch_up()

    def _catch_up(self, chunk: int = 512) -> None:
        """Feed each head its real rows but what a proposal needs (head 0 keeps its last one),
        `chunk` at a time: bounded graphs for a long prompt."""
        n_ctx = len(self.ids)
        real = mx.array(self.ids, dtype=mx.int32)
        for j in range(self.count):
            start = self.caches[j].offset
            states = self.pend[j]
            # rows with real ids (t <= N-2-j) and states; head 0 leaves position N-2 pending
            end = start + (0 if states is None else states.shape[0])
            end = min(end, n_ctx - 2 if j == 0 else n_ctx - 1 - j)
            outs = []
            for lo in range(start, end, chunk):
                hi = min(end, lo + chunk)
                rows = states[lo - start : hi - start]
                outs.append(self._feed(j, rows, real[lo + 1 + j : hi + 1 + j]))
                mx.eval(outs[-1], self.caches[j].state)
            if end > start:
                self.pend[j] = states[end - start :] if states.shape[0] > end - start else None
                if j + 1 < self.count:
                    new = self._recycle(j, mx.concatenate(outs))
                    nxt = self.pend[j + 1]
                    self.pend[j + 1] = new if nxt is None else mx.concatenate([nxt, new])
