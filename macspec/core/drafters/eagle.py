"""A feature-level draft (EAGLE, Li et al. 2024): a decoder layer (or a few: distill --layers)
that reads the target's own final hidden state and the next token's embedding, predicts the next
hidden state, and turns it into tokens through the target's output head (rows cut to the ids the
draft may propose).

Why this kind: reusing the target's features, embeddings and head leaves only "feature + next
token -> next feature" to learn, with one layer's parameters and a step a small fraction of the
target's, where a small draft model must learn language from scratch (the README's distill
section has the measured agreement of both).

Draft position t reads (f_t, e(x_{t+1})), where f_t is the target's hidden state after x_t, and
outputs g_t ~ f_{t+1}, whose logits predict x_{t+2}. While drafting, g feeds the next position in
place of the target's feature; after verification the target's real features replace them.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ...base.errors import CacheError, ModelError
from .. import caches, hooks, tree
from ..caches import DraftState
from ..sampling import sample
from .base import Distribution, Drafter, Proposal

# A value of the draft's config (draft_config): a width or a count, an epsilon, layer ids.
ConfigValue = int | float | list[int]

# Draft confidence (its own probability of the token, temperature 1) below which adaptive drafting
# stops a proposal early: a doubtful token is rarely accepted and every later one depends on it.
STOP_BELOW = 0.3


def draft_config(
    target: nn.Module, feature_layers: tuple[int, ...] = (), layers: int = 1
) -> dict[str, ConfigValue]:
    """The draft's decoder layers mirror one layer of the target (same widths and RoPE);
    `feature_layers`: target layers whose outputs the draft reads besides the final features;
    `layers`: how many decoder layers the draft stacks."""
    a = target.args
    heads = a.num_attention_heads
    return {
        "feature_layers": list(feature_layers),
        "layers": layers,
        "hidden_size": a.hidden_size,
        "num_attention_heads": heads,
        # foreign: mlx-lm's ModelArgs differ by architecture (the fields some lack default)
        "num_key_value_heads": getattr(a, "num_key_value_heads", None) or heads,
        "head_dim": getattr(a, "head_dim", None) or a.hidden_size // heads,  # foreign: as above
        "intermediate_size": a.intermediate_size,
        "rms_norm_eps": float(getattr(a, "rms_norm_eps", 1e-5)),  # foreign: as above
        "rope_theta": float(getattr(a, "rope_theta", 10000.0)),  # foreign: as above
        "vocab_size": int(a.vocab_size),  # the target's rows, for `macspec check`
    }


class EagleDraft(nn.Module):
    """fc([norm(e), s]) -> llama decoder layer(s) -> predicted next feature (standardised).

    s, the state a position reads, is the target's standardised final feature z at positions
    where the target ran; with `feature_layers` (EAGLE-3's multi-layer features) it is a learned
    projection of z joined with the standardised outputs of those target layers. At drafted
    positions s is the draft's own previous output, as EAGLE-3 feeds it forward."""

    def __init__(self, config: dict[str, ConfigValue]):
        super().__init__()
        h = config["hidden_size"]
        args = llama.ModelArgs(
            model_type="llama",
            hidden_size=h,
            num_hidden_layers=1,
            intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=config["rope_theta"],
            vocab_size=1,
        )
        self.hidden_size = h
        self.feature_layers = tuple(config.get("feature_layers") or ())
        width = h * (len(self.feature_layers) + 1)  # tapped layers first, final features last
        # Features are standardised with the target's per-dimension mean and spread (set from
        # the training data by init_from_features) and predicted in that space: the target's
        # features hold a few huge, nearly constant dimensions that an RMS norm would let dominate
        # everything (with RMS norms in and out, training stalled predicting one distribution).
        self.embed_norm = nn.RMSNorm(h, eps=config["rms_norm_eps"])
        if self.feature_layers:
            # Starts as "take the final features", so the draft begins where the one-layer
            # kind does and learns what the other layers add.
            self.proj = nn.Linear(width, h, bias=True)
            self.proj.weight = (
                mx.concatenate([mx.zeros((h, width - h)), mx.eye(h)], axis=1)
                + 0.01 * self.proj.weight
            )
            self.proj.bias = mx.zeros((h,))
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = llama.TransformerBlock(args)
        # Layers after the first (config "layers", 1 in drafts made before it existed).
        self.more = [llama.TransformerBlock(args) for _ in range(config.get("layers", 1) - 1)]
        self.feature_mean = mx.zeros((width,))
        self.feature_std = mx.ones((width,))
        self.freeze(keys=["feature_mean", "feature_std"], recurse=False)

    def init_from_features(self, mean: mx.array, std: mx.array) -> None:
        self.feature_mean = mean.astype(mx.float32)
        self.feature_std = std.astype(mx.float32)

    def state(self, features: mx.array) -> mx.array:
        """The state s of positions where the target ran, from its features."""
        z = (features - self.feature_mean) / self.feature_std
        return self.proj(z) if self.feature_layers else z

    @property
    def blocks(self) -> list[nn.Module]:
        return [self.layer, *self.more]

    def step(
        self, state: mx.array, embeds: mx.array, cache: list[KVCache] | None = None
    ) -> mx.array:
        """Predicted next final feature, standardised: it is also the next position's state.
        `cache`: one KVCache per decoder layer."""
        x = self.fc(mx.concatenate([self.embed_norm(embeds), state], -1))
        cache = cache or [None] * len(self.blocks)
        mask = create_attention_mask(x, cache[0])
        for block, c in zip(self.blocks, cache, strict=True):
            x = block(x, mask, cache=c)
        return x

    def first_input(self, embeds: mx.array, state: mx.array) -> tuple[mx.array, mx.array]:
        """The first decoder layer's residual stream and attention input (distill's unrolled
        training runs the layers by hand)."""
        x = self.fc(mx.concatenate([self.embed_norm(embeds), state], -1))
        return x, self.layer.input_layernorm(x)

    def recycle(self, out: mx.array) -> mx.array:
        """The state the next drafted position reads: the prediction itself."""
        return out

    def decode(self, out: mx.array) -> mx.array:
        """A standardised prediction back in the target's final-feature space (for its head)."""
        h = self.hidden_size
        return self.feature_mean[-h:] + self.feature_std[-h:] * out

    def logits(self, out: mx.array, head: mx.array) -> mx.array:
        """Logits over the draft's ids through `head`, the target's output rows for them."""
        return self.decode(out) @ head.T

    def __call__(
        self, features: mx.array, embeds: mx.array, cache: list[KVCache] | None = None
    ) -> mx.array:
        return self.decode(self.step(self.state(features), embeds, cache))


class TargetParts:
    """What the draft borrows from the target: the input embedding and the output head's rows
    for the draft's vocabulary, in float32 (the fast type on CPUs; MLX casts on GPUs too)."""

    def __init__(self, target: nn.Module, vocab_ids: mx.array, native: bool = False):
        from ..target import output_head

        self.target = target
        self.vocab_ids = vocab_ids  # (Vd,) target ids the draft can propose
        h = target.args.hidden_size
        # The head applied to the identity gives its weight whatever its form (tied, untied,
        # quantized); only the draft's rows are kept.
        rows = output_head(target, mx.eye(h, dtype=mx.float32))  # (H, V)
        # (Vd, H) row-contiguous: the layout of a linear layer's weight, for the native products
        self.head = mx.contiguous(mx.take(rows.astype(mx.float32), vocab_ids, axis=1).T)
        self.native = native  # its product runs the accelerator's (hooks.matmul_t)
        # Target id -> column of the draft's logits, len(vocab_ids) for ids it lacks (for the
        # repetition penalty's windows, see verify.make_dist).
        table = np.full(rows.shape[1], vocab_ids.size, np.int32)
        table[np.array(vocab_ids)] = np.arange(vocab_ids.size, dtype=np.int32)
        self.lookup = mx.array(table)
        mx.eval(self.head)

    def embed(self, ids: mx.array) -> mx.array:
        return self.target.model.embed_tokens(ids).astype(mx.float32)

    def logits(self, features: mx.array) -> mx.array:
        if self.native:
            return hooks.matmul_t(features, self.head)
        return features @ self.head.T


class EagleDrafter(Drafter):
    """Drafter protocol (drafters/base.py) over an EagleDraft.

    The draft cache holds positions whose input pair used a real target feature; `pending` holds
    real (feature, next id) pairs not fed yet. A proposal feeds them, then drafts on its own
    predicted features; commit() rewinds the predicted positions and queues the target's real
    features for the kept ids (EAGLE recomputes them the same way)."""

    name = "eagle"
    summary = "a feature draft reading the target's hidden states (EAGLE)"
    needs_hidden = True

    def __init__(
        self, draft: EagleDraft, parts: TargetParts, vocab_size: int, stop_below: float = 0.0
    ):
        self.draft, self.parts, self.vocab_size = draft, parts, vocab_size
        self.feature_layers = draft.feature_layers  # the target keeps these layers' outputs
        self.stop_below = stop_below
        self.cache = self._fresh()  # one KVCache per draft layer
        self.pending_f: list[mx.array] = []  # (n, H) real features
        self.pending_ids: list[int] = []  # the id that follows each pending feature
        self._offset = 0
        self._fed = 0  # pending pairs fed by the current proposal
        self._proposed = False

    def _fresh(self) -> list[KVCache]:
        return [KVCache() for _ in self.draft.blocks]

    def _queue(self, hidden: mx.array | None, ids: list[int]) -> None:
        if not ids and hidden is None:  # a one-token prompt: the target read nothing yet
            return
        if hidden is None or hidden.shape[0] != len(ids):
            got = None if hidden is None else hidden.shape[0]
            raise ModelError(f"the eagle draft needs {len(ids)} target hidden states, got {got}")
        if ids:
            self.pending_f.append(hidden.astype(mx.float32))
            self.pending_ids += ids

    def start(self, prompt: list[int], hidden: mx.array | None = None, max_step: int = 1) -> None:
        self.resume(None, prompt, 0, hidden, max_step)

    state_kind = "eagle"

    def snapshot(self) -> DraftState:
        """The cache and the pending features (positions cache.offset.. of the context)."""
        features = mx.concatenate(self.pending_f) if self.pending_f else None
        held = self.cache[0].offset + len(self.pending_ids)
        extra = (features, list(self.pending_ids))
        return DraftState(self.state_kind, list(self.cache), held, lookahead=1, extra=extra)

    def resume(
        self,
        state: DraftState | None,
        prompt: list[int],
        n: int,
        hidden: mx.array | None = None,
        max_step: int = 1,
    ) -> None:
        """Start from `state` holding the first n positions; `hidden`: the target's features of
        positions n.. (those it read after them)."""
        self.cache, self.pending_f, self.pending_ids = self._fresh(), [], []
        self._proposed = False
        if state is not None:
            if len(state.cache) != len(self.draft.blocks):  # another draft's state
                raise CacheError(
                    f"a draft state of {len(state.cache)} layers cannot resume a draft of "
                    f"{len(self.draft.blocks)}"
                )
            self.cache = list(state.cache)
            features, ids = state.extra
            kept = n - self.cache[0].offset  # positions past the cache: from its pending features
            if kept > 0:
                self.pending_f, self.pending_ids = [features[:kept]], ids[:kept]
        # Prompt position t pairs the target's feature f_t with the id x_{t+1}.
        self._queue(hidden, prompt[n + 1 :])
        self._catch_up()

    def _catch_up(self, chunk: int = 512) -> None:
        """Feed a long prompt's pending pairs but the last into the cache, `chunk` at a time:
        left to the first proposal, they went through the layer in one pass, its attention
        built whole (drafters.prefill chunks a draft model's prompt alike)."""
        n = len(self.pending_ids) - 1
        if n < chunk:
            return
        features = mx.concatenate(self.pending_f)
        for i in range(0, n, chunk):
            state = self.draft.state(features[i : min(n, i + chunk)][None])
            ids = mx.array(self.pending_ids[i : min(n, i + chunk)], dtype=mx.int32)
            self.draft.step(state, self.parts.embed(ids)[None], self.cache)
            mx.eval([c.state for c in self.cache])
        self.pending_f, self.pending_ids = [features[n:]], self.pending_ids[n:]

    def _full(self, small: mx.array) -> mx.array:
        """(rows, vocab_size) probabilities from rows over the draft's ids (0 elsewhere)."""
        full = mx.zeros((small.shape[0], self.vocab_size), dtype=mx.float32)
        ids = mx.broadcast_to(self.parts.vocab_ids[None], small.shape)
        return mx.put_along_axis(full, ids, small, axis=-1)

    def label(self) -> None:
        return None

    def propose(self, k: int, dist: Distribution, key: mx.array) -> Proposal:
        self._offset, self._proposed = self.cache[0].offset, True
        self._fed = len(self.pending_ids)
        if not self.pending_ids:  # cannot happen after the loop's first plain step
            raise ModelError("the eagle draft has no target feature to draft from")
        state = self.draft.state(mx.concatenate(self.pending_f)[None])
        embeds = self.parts.embed(mx.array(self.pending_ids, dtype=mx.int32))[None]
        tokens, probs = [], []
        for i, subkey in enumerate(mx.random.split(key, k)):
            out = self.draft.step(state, embeds, self.cache)[:, -1:]  # (1, 1, H) standardised
            # q over the draft's own ids only: the other ids have q = 0 whatever the options,
            # and the vocabulary-wide work (softmax, sampling) is the step's biggest cost after
            # the layer on a CPU.
            logits = self.parts.logits(self.draft.decode(out)[0])
            drafted = mx.concatenate(tokens) if tokens else None
            q = dist.probs(logits, drafted, i, self.parts.lookup)
            index = sample(q, subkey)
            token = self.parts.vocab_ids[index]
            tokens.append(token)
            probs.append(q)
            if i + 1 == k:
                break
            if self.stop_below > 0:
                confidence = mx.softmax(logits[0], axis=-1)[index[0]]
                if confidence.item() < self.stop_below:
                    break
            state, embeds = out, self.parts.embed(token)[None]
        return Proposal(mx.concatenate(tokens), self._full(mx.concatenate(probs)))

    def propose_tree(self, shape: tree.TreeShape) -> tree.Tree:
        """Candidates as a tree (tree.grow): each kept node's predicted feature feeds its
        children, a level at a time in one tree pass of the draft layer."""
        self._offset, self._proposed = self.cache[0].offset, True
        self._fed = len(self.pending_ids)
        if not self.pending_ids:
            raise ModelError("the eagle draft has no target feature to draft from")
        state = self.draft.state(mx.concatenate(self.pending_f)[None])
        embeds = self.parts.embed(mx.array(self.pending_ids, dtype=mx.int32))[None]
        outs = {-1: self.draft.step(state, embeds, self.cache)[0, -1:]}  # node -> its output
        context, fed = self.cache[0].offset, []
        vocab = self.parts.vocab_ids.tolist()

        def probs(out: mx.array) -> mx.array:
            return mx.softmax(self.parts.logits(self.draft.decode(out)), axis=-1)

        def expand(t: tree.Tree, nodes: list[int]) -> mx.array:
            mask = tree.attend(t, context, fed + nodes, nodes)
            states = mx.concatenate([outs[t.parents[i]] for i in nodes])[None]
            ids = mx.array([t.tokens[i] for i in nodes], dtype=mx.int32)
            depths = [t.depths[i] for i in nodes]
            with tree.tree_pass(self.draft, self.cache, mask, depths, context - 1):
                out = self.draft.step(states, self.parts.embed(ids)[None], self.cache)[0]
            fed.extend(nodes)
            outs.update({i: out[r : r + 1] for r, i in enumerate(nodes)})
            return probs(out)

        return tree.grow(shape, expand, probs(outs[-1]), vocab)

    def commit_tree(
        self, t: tree.Tree, accepted: list[int], emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        # The drafted rows go; the target's features of the kept ids are queued (as commit).
        self.commit(len(t), len(accepted), emitted, hidden)

    def commit(
        self, k: int, accepted: int, emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        if k > 0 and self._proposed:
            # Keep the positions fed with real features; drop those fed with predicted ones.
            caches.rewind(self.cache, self._offset + self._fed)
            self.pending_f, self.pending_ids = [], []
        self._proposed = False
        # The kept positions (the previous last id and the accepted drafts) and their next ids.
        self._queue(hidden, emitted)

    def abort(self, k: int) -> None:
        if self._proposed:
            caches.rewind(self.cache, self._offset)
        self._proposed = False


def factory(
    draft: EagleDraft, vocab_ids: mx.array, target: nn.Module, vocab_size: int, accelerate: bool
) -> Callable[[bool], EagleDrafter]:
    """A fresh drafter per generation over `draft` (its weights, the target's embedding and head
    shared), proposing the ids of `vocab_ids` below `vocab_size` (those the pair can produce);
    with `accelerate`, the draft's layers are switched as the target's are (hooks.py)."""
    if accelerate:
        hooks.accelerate_layers(draft, draft.blocks)  # as the target's layers, and its products
    vocab_ids = mx.array([i for i in vocab_ids.tolist() if i < vocab_size], dtype=mx.int32)
    parts = TargetParts(target, vocab_ids, native=accelerate)

    def make(adaptive: bool = True) -> EagleDrafter:
        return EagleDrafter(draft, parts, vocab_size, STOP_BELOW if adaptive else 0.0)

    return make
