"""Loading a pair: the target, the draft (a model or a feature draft), the checks that they
can speculate together exactly (tokenizer, caches), the drafter, and the machine's costs."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import mlx.core as mx

from ..base import switches
from ..base.errors import OptionError
from ..core import (
    Observations,
    PromptCache,
    Timing,
    caches,
)
from ..models.store import resolve_model
from . import drafters
from .drafters import DRAFTERS, OWN_DRAFTERS
from .kept_costs import calibrate
from .loaded_pair import Pair
from .loading import checked_caches, context_length, embedding_rows, load_model, tokenizer_vocab

log = logging.getLogger("macspec")

# The ids of a long prompt a draft model reads by default: its end only (docs/benchmarks.md,
# "Long prompts"). It reads them at its first proposal, after the first token: at ~250 ids/s
# for the real pair's 0.5B draft on a 2-core CPU, 512 ids cost 2-2.7 s of a 64-token answer.
DRAFT_CONTEXT = 128


def load(
    target: str | os.PathLike | None = None,
    draft: str | os.PathLike | None = None,
    *,
    drafter: str | None = None,
    group: mx.distributed.Group | None = None,
    kernels: bool | None = None,
    measure: bool = True,
    draft_context: int = DRAFT_CONTEXT,
) -> Pair:
    """Load a target and (optionally) a draft: directories or store names.

    With no target, the embedded default pair is used (fetched and converted on first use).
    `drafter`: None (the draft model, trying an n-gram copy from the context first), "model"
    (the draft model only), or "ngram" (no draft model: copy from the prompt and output).
    `kernels`: macspec's CPU layer kernels (cpu/kernels.py) instead of mlx-lm's layers; by
    default on, unless the environment sets MACSPEC_KERNELS=0. `measure`: measure this machine's
    costs for the adaptive policy now (else at the first adaptive speculative generation).
    `draft_context`: a draft model reads only a prompt's last this many ids (0: all of it); the
    answer is the same either way, only the time to the first token and the drafts change."""
    if isinstance(draft_context, bool) or not isinstance(draft_context, int) or draft_context < 0:
        raise OptionError(f"invalid draft_context={draft_context!r}: a whole number >= 0 (0: all)")
    if kernels is None:
        kernels = switches.KERNELS.value()
    _check_drafter(target, draft, drafter)
    if target is None:
        from ..models.default import default_draft, default_target

        if draft is None and drafter not in OWN_DRAFTERS:
            # a ModelError if this install lacks it (never a silent n-gram), before any download
            draft = default_draft()
        target_path = default_target()
    else:
        target_path = resolve_model(target)
    if group is not None and group.size() == 1:
        group = None
    # Decided before rank > 0 drops the draft: every rank checks the sharded target alike.
    speculates = drafter in OWN_DRAFTERS or draft is not None
    if group is not None and group.rank() > 0:
        draft = None  # the draft runs on rank 0 only (core/sharded.py says why)
    model, tokenizer, config = load_model(target_path, group, kernels)
    rows = embedding_rows(model)
    pair = Pair(
        target=model,
        tokenizer=tokenizer,
        target_path=target_path,
        context_length=context_length(config),
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
        group=group,
        kernels=kernels,
        draft_context=draft_context,
    )
    # Ids past the tokenizer's vocabulary are padding rows: never sample them from either model.
    pair.target_rows, pair.vocab_size = rows, min(rows, tokenizer_vocab(tokenizer))
    pair.cache_kinds = caches.kinds(model)
    if speculates:
        pair.cache_kinds = checked_caches(model, target_path, "target", pair.vocab_size)
    drafters.attach(pair, draft, drafter)
    if group is None:
        pair.prompt_cache = prompt_cache(switches.PROMPT_CACHE_MB.value())
    if pair.drafter_factory is not None and group is None and measure:
        _measure(pair)
    return pair


def share(pair: Pair, drafter: str | None) -> Pair:
    """Another pair over `pair`'s loaded models, with no second copy of their weights:
    `drafter` None puts an n-gram copy in front of `pair`'s own draft, "ngram" or "mtp"
    drafts without the draft. Its own timing, observed times, costs and prompt cache."""
    _check_drafter(pair.target_path, None, drafter)
    if drafter is None and "+" in (pair.drafter_kind or ""):
        raise OptionError(f"{pair.drafter_kind} already has an n-gram copy in front of its draft")
    new = replace(
        pair,
        timing=Timing(),
        observations=Observations(),
        costs=None,
        calibration_time=0.0,
        prompt_cache=prompt_cache(switches.PROMPT_CACHE_MB.value()) if pair.group is None else None,
    )
    if drafter is None and pair.draft_path is None:
        return new  # as load() without a draft: nothing to draft with
    if drafter is None:
        make = pair.drafter_factory
        new.drafter_kind = f"{pair.drafter_kind}+ngram"
        new.drafter_factory = drafters.with_ngram(new, make)
        return new
    new.draft, new.draft_path, new.draft_cache_kinds = None, None, {}
    new.vocab_size = min(pair.target_rows, tokenizer_vocab(pair.tokenizer))
    drafters.attach(new, None, drafter)
    return new


def _measure(pair: Pair) -> None:
    """The machine's costs, measured at load: paid here, and said, rather than inside the first
    answer (a short one would count the seconds of measuring as its own)."""
    t0 = time.perf_counter()
    pair.costs = calibrate(pair)
    pair.calibration_time = time.perf_counter() - t0


def _check_drafter(target: object, draft: object, drafter: str | None) -> None:
    """OptionError for a drafter= choice that does not fit the models given."""
    if drafter is not None and drafter not in DRAFTERS:
        raise OptionError(f"unknown drafter={drafter!r}: choose {' or '.join(map(repr, DRAFTERS))}")
    if drafter in OWN_DRAFTERS and draft is not None:
        raise OptionError(f"drafter={drafter!r} uses no draft model: leave out draft")
    if drafter == "model" and draft is None and target is not None:
        raise OptionError("drafter='model' needs a draft model: give draft=")


def prompt_cache(mib: str | float | None = None) -> PromptCache | None:
    """A prompt cache of `mib` MiB (None: the default size; 0: none)."""
    if mib is None:
        return PromptCache()
    try:
        size = int(float(mib) * (1 << 20))
    except ValueError:
        raise OptionError(f"the prompt cache size must be a number of MiB, not {mib!r}") from None
    if size < 0:
        raise OptionError(f"the prompt cache size must be >= 0 MiB, not {mib}")
    return PromptCache(max_bytes=size) if size else None
