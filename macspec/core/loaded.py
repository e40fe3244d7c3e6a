"""What the core needs of a loaded pair (macspec.Pair is one): its target, its sizes, its group,
and a fresh drafter per generation."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from .drafters.base import Drafter
from .loop import Timing


class LoadedPair(Protocol):
    target: nn.Module
    target_path: Path
    draft_path: Path | None
    drafter_kind: str | None  # "model", "ngram", "model+ngram", a feature draft, or None
    vocab_size: int  # ids both models can produce and the tokenizer knows
    draft_vocab: int  # ids a draft model's pruned head scores (drafters/pruned.py); 0: all
    context_length: int
    group: mx.distributed.Group | None  # the target is sharded over it (sharded.py)
    timing: Timing  # plain steps measured across generations
    kernels: bool  # accelerated layers in the target and in drafts made for it (hooks.py)
    draft: nn.Module | None  # a draft model (drafter_kind "model", "model+ngram"), else None
    draft_context: int  # the draft model reads only a prompt's last this many ids (0: all)

    def make_drafter(self, adaptive: bool = True) -> Drafter | None:
        """A fresh drafter for one generation (None: the pair decodes plainly)."""
