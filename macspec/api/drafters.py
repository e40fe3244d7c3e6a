"""The drafters a pair can be loaded with, in one table, as llama.cpp's common/speculative.cpp
names its types: each entry's name, its class in core/drafters (summary, statistics), what it
needs, and the factory that builds it for a loaded pair. `load(drafter=...)`'s choices, the
commands' --drafter flag and the kinds a draft directory may declare all come from ENTRIES."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..base import switches
from ..base.errors import ModelError
from ..core.drafters import (
    Drafter,
    Eagle3Drafter,
    EagleDrafter,
    HybridDrafter,
    ModelDrafter,
    MtpDrafter,
    NgramDrafter,
)
from ..core.drafters.pruned import chosen_size, prune_head
from ..models import draft_files, eagle3_draft
from ..models.compat import check_tokenizers
from ..models.eagle3_export import is_draft as is_eagle3_draft
from ..models.mtp import drafter_factory as mtp_factory
from ..models.store import resolve_model
from .loaded_pair import Pair
from .loading import checked_caches, embedding_rows, load_model

# A fresh drafter for one generation; its argument says whether K is adaptive.
DrafterFactory = Callable[[bool], Drafter]
# A draft model stops drafting (adaptive K) when its own probability of a token is below this.
DRAFT_CONFIDENCE = 0.3


@dataclass(frozen=True)
class DrafterEntry:
    name: str
    drafter: type[Drafter]
    # "nothing": drafts from the context or the target's own heads; "model": an ordinary draft
    # model; "file": a draft directory that declares this kind (draft.json, EAGLE-3's config).
    needs: Literal["nothing", "model", "file"]
    make: Callable[[Pair, Path | None], DrafterFactory]

    @property
    def summary(self) -> str:
        return self.drafter.summary


def special_ids(pair: Pair) -> frozenset[int]:
    """Control tokens (BOS, EOS, chat turn markers): never part of a copied n-gram proposal."""
    ids = set(getattr(pair.tokenizer, "all_special_ids", None) or ()) | set(pair.eos_token_ids)
    return frozenset(ids)


def _ngram(pair: Pair, _: Path | None) -> DrafterFactory:
    return lambda adaptive: NgramDrafter(stop_ids=special_ids(pair))


def _mtp(pair: Pair, _: Path | None) -> DrafterFactory:
    return mtp_factory(pair.target_path, pair.target, pair.vocab_size, pair.kernels)[1]


def _model(pair: Pair, path: Path | None) -> DrafterFactory:
    """Load an ordinary draft model into `pair` after checking it can draft for the target."""
    pair.draft, draft_tokenizer, _ = load_model(path, use_kernels=pair.kernels)
    draft_rows = embedding_rows(pair.draft)
    # The draft must use the target's ids; refuse another tokenizer before generating anything.
    check_tokenizers(
        pair.tokenizer,
        draft_tokenizer,
        target_rows=pair.target_rows,
        draft_rows=draft_rows,
        target_name=str(pair.target_path),
        draft_name=str(path),
    ).raise_for_errors()
    pair.vocab_size = min(pair.vocab_size, draft_rows)
    pair.draft_cache_kinds = checked_caches(pair.draft, path, "draft", pair.vocab_size)
    size = chosen_size(pair.vocab_size, switches.DRAFT_VOCAB.value())
    head = prune_head(pair.draft, pair.vocab_size, size, special_ids(pair))
    pair.draft_vocab = head.size if head is not None else 0
    return lambda adaptive: ModelDrafter(
        pair.draft,
        pair.vocab_size,
        DRAFT_CONFIDENCE if adaptive else 0.0,
        head,
        context=pair.draft_context,
    )


def _eagle(pair: Pair, path: Path | None) -> DrafterFactory:
    return draft_files.load_draft(path, pair)


def _eagle3(pair: Pair, path: Path | None) -> DrafterFactory:
    return eagle3_draft.load_draft(path, pair)


ENTRIES = (
    DrafterEntry("model", ModelDrafter, "model", _model),
    DrafterEntry("ngram", NgramDrafter, "nothing", _ngram),
    DrafterEntry("mtp", MtpDrafter, "nothing", _mtp),
    DrafterEntry("eagle", EagleDrafter, "file", _eagle),
    DrafterEntry("eagle3", Eagle3Drafter, "file", _eagle3),
)
TABLE = {e.name: e for e in ENTRIES}
# load(drafter=...) choices (None: an n-gram copy when the context repeats, else the draft);
# a draft directory's own kind is read from it.
DRAFTERS = {e.name: e.summary for e in ENTRIES if e.needs != "file"}
OWN_DRAFTERS = tuple(e.name for e in ENTRIES if e.needs == "nothing")


def with_ngram(pair: Pair, make: DrafterFactory) -> DrafterFactory:
    """`make`'s drafter behind an n-gram copy from the context (the hybrid drafter)."""
    return lambda adaptive: HybridDrafter(make(adaptive), NgramDrafter(stop_ids=special_ids(pair)))


def draft_kind(path: Path) -> str:
    """The kind of a draft directory: what its draft.json declares, "eagle3" for a published
    EAGLE-3 draft (its config.json says so), else "model"."""
    meta = path / "draft.json"
    if not meta.is_file():
        return "eagle3" if is_eagle3_draft(path) else "model"
    try:
        kind = json.loads(meta.read_text()).get("kind")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(f"cannot read {meta}: {e}") from e
    if kind not in TABLE or TABLE[kind].needs != "file":
        raise ModelError(f"{meta} declares an unknown draft kind {kind!r}")
    return kind


def attach(pair: Pair, draft: str | os.PathLike | None, drafter: str | None) -> None:
    """The pair's drafter kind and factory: one that needs no draft, or the draft (a model or a
    draft directory of its own kind), behind an n-gram copy unless drafter="model"."""
    if drafter in OWN_DRAFTERS:
        pair.drafter_kind, pair.drafter_factory = drafter, TABLE[drafter].make(pair, None)
        return
    if draft is None:
        return
    pair.draft_path = resolve_model(draft)
    entry = TABLE[draft_kind(pair.draft_path)]
    make = entry.make(pair, pair.draft_path)
    if drafter == "model":
        pair.drafter_kind, pair.drafter_factory = entry.name, make
    else:
        pair.drafter_kind, pair.drafter_factory = f"{entry.name}+ngram", with_ngram(pair, make)
