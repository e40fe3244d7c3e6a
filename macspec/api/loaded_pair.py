"""The Pair: a loaded target, its tokenizer and its drafter, as `load()` (pair.py) returns it.

Apart from load() so that the drafters' table (drafters.py), which builds into a pair, and
load(), which looks the table up, both import it without importing each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..base.errors import OptionError
from ..core import Costs, Drafter, Observations, PromptCache, Timing, caches
from ..models.mtp import summary as mtp_summary


@dataclass
class Pair:
    """A loaded target, its tokenizer, and the draft model (if any)."""

    target: nn.Module
    tokenizer: TokenizerWrapper
    target_path: Path
    draft: nn.Module | None = None
    draft_path: Path | None = None
    drafter_kind: str | None = None  # "model+ngram", "model", "ngram", a feature draft, or None
    vocab_size: int = 0  # ids both models can produce and the tokenizer knows
    context_length: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    timing: Timing = field(default_factory=Timing)
    # Round times per arm (plain, each drafter and K), kept across generations (core/observed.py)
    observations: Observations = field(default_factory=Observations)
    costs: Costs | None = None  # measured at load (distributed, measure=False: at first use)
    calibration_time: float = 0.0  # seconds load() spent measuring them
    group: mx.distributed.Group | None = None  # the target is sharded over it (core/sharded.py)
    # Makes a fresh drafter for one generation; its argument says whether K is adaptive.
    drafter_factory: Callable[[bool], Drafter] | None = None
    # Layers per cache kind (caches.kinds: attention, window, recurrent), checked at load to
    # rewind exactly when the pair speculates.
    cache_kinds: dict[str, int] = field(default_factory=dict)
    kernels: bool = True  # CPU layer kernels on the target and the draft (load(kernels=...))
    draft_cache_kinds: dict[str, int] = field(default_factory=dict)
    draft_vocab: int = 0  # ids a draft model's pruned head scores (drafters/pruned.py); 0: all
    target_rows: int = 0  # the target's output rows (padding rows past the vocabulary included)
    # States kept between generations (core/caches/); None: every prompt is read whole.
    prompt_cache: PromptCache | None = None
    # A draft model reads only a prompt's last this many ids (0: all; load(draft_context=)).
    draft_context: int = 0

    def describe(self) -> str:
        """One line naming the models and how drafts are made (and the target's layer kinds
        when it has more than full attention)."""
        target = self.target_path.name
        if set(self.cache_kinds) - {"attention"}:
            target += f" ({caches.describe_kinds(self.cache_kinds)})"
        if self.drafter_kind is None:
            return f"{target}, plain decoding (no draft)"
        if self.draft_path is None:
            heads = mtp_summary(self.target_path) if self.drafter_kind == "mtp" else None
            how = f" ({heads})" if heads else " (no draft model)"
            return f"{target}, {self.drafter_kind} drafting{how}"
        head = f", its head over {self.draft_vocab:,} ids" if self.draft_vocab else ""
        return f"{target} + draft {self.draft_path.name} ({self.drafter_kind}{head})"

    def check_trees(self) -> None:
        """Token trees need a draft model (or feature draft) and full-attention caches."""
        if self.drafter_kind == "ngram":
            raise OptionError("tree_nodes needs a draft model: this pair drafts by n-gram only")
        if self.drafter_kind == "mtp" and self.make_drafter(False).count > 1:
            raise OptionError(
                "tree_nodes: several MTP heads draft chains only (each head's cache lags the "
                "one before); leave tree_nodes=0"
            )
        for role, found in (("target", self.cache_kinds), ("draft", self.draft_cache_kinds)):
            other = sorted(set(found) - {"attention"})
            if other:
                raise OptionError(
                    f"tree_nodes: the {role}'s {' and '.join(other)} layers cannot verify a "
                    "token tree (a sliding window or a recurrent state holds one branch); "
                    "leave tree_nodes=0 for chains, which are exact on them"
                )

    def calibration_note(self) -> str:
        """What load() measured on this machine, and how long it took."""
        if self.costs is None:
            return "costs not measured yet"
        c = self.costs
        widest = c.verify[-1] if c.verify else None
        note = f"measured this machine in {self.calibration_time:.1f}s: a plain step "
        note += f"{c.plain_step * 1000:.0f} ms"
        if widest:
            note += f", verifying {widest[0]} drafts {widest[1] / c.plain_step:.2f}x that"
        far = c.later
        if far is not None and far.verify:
            note += f"; after {far.position:,} tokens a plain step {far.plain_step * 1000:.0f} ms, "
            note += f"{far.verify[-1][0]} drafts {far.verify[-1][1] / far.plain_step:.2f}x"
            if far.measured < c.measured:  # measured before the short one: an earlier load
                note += time.strftime(" (kept from %Y-%m-%d %H:%M)", time.localtime(far.measured))
        return note

    def make_drafter(self, adaptive: bool = True) -> Drafter | None:
        return self.drafter_factory(adaptive) if self.drafter_factory else None
