"""The target model's passes: the context it holds, logits for new ids (a pass may be launched
ahead of its id), its hidden states for drafters that read them, and exact rewinds."""

from __future__ import annotations

from functools import cached_property

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import CacheError
from . import caches, hooks
from .memory import clear_on_gpu


class Target:
    """The target model and its cache; logits are cut to the ids both models share.

    With `keep_hidden`, every forward pass also leaves the last hidden states of the positions
    it read in `self.hidden` (for drafters that build on the target's features, as EAGLE does);
    with `taps`, the outputs of those decoder layers come first, the final features last."""

    # launch() can feed an id still being computed, so plain steps run one pass ahead.
    takes_lazy_ids = True

    def __init__(
        self,
        model: nn.Module,
        vocab_size: int,
        keep_hidden: bool = False,
        taps: tuple[int, ...] = (),
        name: str = "the target",
    ):
        self.model = model
        self.vocab_size = vocab_size
        self.cache: list = []
        self.keep_hidden = keep_hidden
        self.taps = tuple(taps)
        self.name = name  # for errors
        # (positions, (len(taps) + 1) * hidden_size) of the last forward pass
        self.hidden: mx.array | None = None
        # A pass launched ahead: (its logits, its hidden states, the id it fed).
        self.ahead: tuple[mx.array, mx.array | None, mx.array] | None = None

    def start(self, prompt: list[int], max_step: int = 1, cache: list | None = None) -> None:
        """Prefill all but the prompt's last id; later passes of up to `max_step` ids can be
        taken back (caches.make_cache). `cache`: one already holding the prompt's first ids
        (the prompt cache's); only the rest is read, and `hidden` covers only them."""
        self.cache = cache if cache is not None else caches.make_cache(self.model, max_step)
        done = caches.length(self.cache) if cache is not None else 0
        if self.keep_hidden:
            body, chunks = prompt[done:-1], []
            step = hooks.prefill_chunk()  # chunked, as prefill(): bounded graphs
            for i in range(0, len(body), step):
                ids = mx.array(body[i : i + step])
                with caches.forward(self.cache, ids.size):
                    chunks.append(hidden_states(self.model, ids, self.cache, self.taps))
                mx.eval(chunks[-1])
                clear_on_gpu()
            self.hidden = mx.concatenate(chunks) if chunks else None
        else:
            caches.prefill(self.model, self.cache, prompt[done:-1])

    @cached_property
    def widest(self) -> int | None:
        """The most ids a pass may hold for each row to get the bits of a pass of its own
        (hooks.alike_rows; None: any): asked once, a target is made for each generation."""
        return hooks.alike_rows(self.model)

    @property
    def offset(self) -> int:
        """Ids the context holds (an id launched ahead is not yet part of it)."""
        try:
            return caches.length(self.cache) - (self.ahead is not None)
        except CacheError as e:
            raise CacheError(f"{self.name}: {e}") from None

    def launch(self, last: mx.array) -> None:
        """Start the pass over `last` (one id, possibly still being computed) now: the next
        logits() whose first id it is uses this pass for its first row (rows are computed
        alone, so the logits are those of one pass). Taken back by trim_to()."""
        kept, self.hidden = self.hidden, None
        logits = self._pass(last, rewindable=True)
        self.ahead, self.hidden = (logits, self.hidden, last), kept
        mx.async_eval(logits)

    def logits(self, tokens: mx.array, rewindable: bool = False) -> mx.array:
        """Logits for `tokens` fed after the context; a `rewindable` pass can be taken back."""
        if self.ahead is None:
            return self._pass(tokens, rewindable)
        head, hidden, fed = self.ahead
        self.ahead = None
        rest = self._pass(tokens[1:], rewindable) if tokens.size > 1 else None
        # Read once the rest is built: the ids may be drafts still computing.
        if fed.item() != tokens[0].item():
            raise CacheError(
                f"{self.name}: a pass launched ahead fed id {fed.item()}, not {tokens[0].item()}"
            )
        if rest is None:
            self.hidden = hidden
            return head
        if self.keep_hidden:
            self.hidden = mx.concatenate([hidden, self.hidden])
        return mx.concatenate([head, rest])

    def _pass(self, tokens: mx.array, rewindable: bool) -> mx.array:
        with caches.forward(self.cache, tokens.size, rewindable):
            if not self.keep_hidden:
                return self.model(tokens[None], cache=self.cache)[0, :, : self.vocab_size]
            self.hidden = hidden_states(self.model, tokens, self.cache, self.taps)
        final = self.hidden[:, -hidden_size(self.model) :] if self.taps else self.hidden
        return output_head(self.model, final)[:, : self.vocab_size]

    def drop_launch(self) -> None:
        """Take back a pass launched ahead, if any: the layers hold the context again."""
        if self.ahead is not None:
            self.trim_to(self.offset)

    def trim_to(self, length: int) -> None:
        """Every layer back to exactly `length` tokens (a pass launched ahead dropped), or
        CacheError naming the model."""
        self.ahead = None
        try:
            caches.rewind(self.cache, length)
        except CacheError as e:
            raise CacheError(f"{self.name}: {e}") from None


def hidden_states(
    model: nn.Module, tokens: mx.array, cache: list, taps: tuple[int, ...] = ()
) -> mx.array:
    """Final (normed) hidden states (n, hidden) of an mlx-lm decoder: `model.model` is the trunk.

    With `taps`, the outputs of those decoder layers are joined before them: (n, (len(taps) + 1)
    * hidden). The layers are wrapped for the call rather than re-implementing the trunk, so any
    mlx-lm architecture whose trunk runs `model.model.layers` in order is tapped exactly."""
    width = hidden_size(model) * (len(taps) + 1)
    if tokens.size == 0:
        return mx.zeros((0, width))
    if not taps:
        return model.model(tokens[None], cache=cache)[0]
    layers, tapped = model.model.layers, []
    originals = {i: layers[i] for i in taps}
    try:
        for i, layer in originals.items():
            layers[i] = _Tap(layer, tapped)
        final = model.model(tokens[None], cache=cache)[0]
    finally:
        for i, layer in originals.items():
            layers[i] = layer
    return mx.concatenate([*(t[0] for t in tapped), final], axis=-1)


class _Tap:
    """Calls a decoder layer and keeps its output (hidden_states' taps)."""

    def __init__(self, layer: nn.Module, out: list) -> None:
        self.layer, self.out = layer, out

    def __getattr__(self, name: str) -> object:
        # foreign: the trunk may read its mlx-lm layer's own attributes (use_sliding)
        return getattr(self.layer, name)

    def __call__(self, *args, **kwargs) -> mx.array:
        h = self.layer(*args, **kwargs)
        self.out.append(h)
        return h


def language_model(model: nn.Module) -> nn.Module:
    """The text model of a model that wraps one (Qwen3.5 keeps its lm_head and ModelArgs on
    `language_model`; its `model` property is that trunk already)."""
    return getattr(model, "language_model", model)  # foreign: mlx-lm's wrappers hold it


def hidden_size(model: nn.Module) -> int:
    return language_model(model).args.hidden_size


def head_module(model: nn.Module) -> tuple[nn.Module, bool]:
    """The module that gives a model's logits (as output_head), and whether it is the tied
    input embedding."""
    lm = language_model(model)
    if getattr(lm, "lm_head", None) is not None:  # foreign: mlx-lm's untied heads only
        return lm.lm_head, False
    return lm.model.embed_tokens, True


def output_head(model: nn.Module, hidden: mx.array) -> mx.array:
    """Logits from hidden states: the untied lm_head, or the tied input embedding."""
    model = language_model(model)
    if getattr(model, "lm_head", None) is not None:  # foreign: mlx-lm's untied heads only
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)
