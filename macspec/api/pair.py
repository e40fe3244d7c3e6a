"""Loading a pair: the target, the draft (a model or a feature draft), the checks that they
can speculate together exactly (tokenizer, caches), the drafter, and the machine's costs."""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..base import switches
from ..base.errors import MacspecError, ModelError, OptionError
from ..core import (
    Costs,
    Drafter,
    HybridDrafter,
    ModelDrafter,
    NgramDrafter,
    Observations,
    PromptCache,
    Timing,
    caches,
    drafter_class,
    hooks,
)
from ..core.drafters.pruned import chosen_size, prune_head
from ..models.compat import check_tokenizers
from ..models.mtp import summary as mtp_summary
from ..models.store import resolve_model
from .kept_costs import calibrate


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
            note += f" ({far.plain_step * 1000:.0f} ms and "
            note += f"{far.verify[-1][1] / far.plain_step:.2f}x after {far.position} tokens"
            if far.measured < c.measured:  # measured before the short one: an earlier load
                note += time.strftime(", kept from %Y-%m-%d %H:%M", time.localtime(far.measured))
            note += ")"
        return note

    def make_drafter(self, adaptive: bool = True) -> Drafter | None:
        return self.drafter_factory(adaptive) if self.drafter_factory else None


log = logging.getLogger("macspec")

# A draft model stops drafting (adaptive K) when its own probability of a token is below this.
DRAFT_CONFIDENCE = 0.3
# The ids of a long prompt a draft model reads by default: its end only (docs/benchmarks.md,
# "Long prompts": reading it all added 38-43% to the time to the first token at 2-4k ids).
DRAFT_CONTEXT = 512
# Drafter kinds a distilled draft directory can declare in its draft.json -> module with load_draft.
FEATURE_DRAFTS = {"eagle": "macspec.models.draft_files", "eagle3": "macspec.models.eagle3_draft"}
# load(drafter=...) choices (None: an n-gram copy when the context repeats, else the draft).
DRAFTERS = {name: drafter_class(name).summary for name in ("model", "ngram", "mtp")}
# Drafters that need no draft model (the context, the target's own heads).
OWN_DRAFTERS = ("ngram", "mtp")


def _load_model(
    path: Path, group=None, use_kernels: bool = True
) -> tuple[nn.Module, TokenizerWrapper, dict]:
    from mlx_lm.utils import load as mlx_load

    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a model directory: config.json is missing")
    if not list(path.glob("model*.safetensors")):
        raise ModelError(f"{path} has no weights (model*.safetensors)")
    if group is not None:  # only this rank's part of the weights (tensor or pipeline parallel)
        from ..core import load_sharded

        return load_sharded(path, group)
    try:
        # Never trust_remote_code: a model directory must not run its own code.
        model, tokenizer, config = mlx_load(str(path), return_config=True)
    except MacspecError:
        raise
    except Exception as e:  # mlx-lm raises ValueError/KeyError/RuntimeError from deep inside
        raise ModelError(f"cannot load the model in {path}: {type(e).__name__}: {e}") from e
    if use_kernels:
        changed = hooks.accelerate_model(model)  # the CPU package's layers, where installed
        log.info("%s: %d decoder layers switched by the %r hooks", path.name, changed, _hooks())
    return model, tokenizer, config


def _hooks() -> str:
    return hooks.installed().name


def _embedding_rows(model: nn.Module) -> int:
    # The logits width is the only architecture-independent way to count output rows.
    return int(model(mx.array([[0]])).shape[-1])


def _context_length(config: dict) -> int:
    for cfg in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_ctx", "max_seq_len", "seq_length"):
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return cfg[key]
    return 1 << 20  # unknown: do not invent a limit


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
    model, tokenizer, config = _load_model(target_path, group, kernels)
    rows = _embedding_rows(model)
    pair = Pair(
        target=model,
        tokenizer=tokenizer,
        target_path=target_path,
        context_length=_context_length(config),
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
        group=group,
        kernels=kernels,
        draft_context=draft_context,
    )
    vocab = len(tokenizer._tokenizer)
    # Ids past the tokenizer's vocabulary are padding rows: never sample them from either model.
    pair.vocab_size = min(rows, vocab)
    pair.cache_kinds = caches.kinds(model)
    if speculates:
        pair.cache_kinds = _checked_caches(model, target_path, "target", pair.vocab_size)
    _attach_drafter(pair, draft, drafter, rows, vocab)
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
        new.drafter_factory = lambda adaptive: HybridDrafter(
            make(adaptive), NgramDrafter(stop_ids=_special_ids(new))
        )
        return new
    new.draft, new.draft_path, new.draft_cache_kinds = None, None, {}
    rows = _embedding_rows(pair.target)
    vocab = len(pair.tokenizer._tokenizer)
    new.vocab_size = min(rows, vocab)
    _attach_drafter(new, None, drafter, rows, vocab)
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


def _attach_drafter(
    pair: Pair, draft: str | os.PathLike | None, drafter: str | None, rows: int, vocab: int
) -> None:
    """The pair's drafter kind and factory: an n-gram copy, or the draft (a model or a feature
    draft), behind an n-gram copy from the context unless drafter="model"."""
    if drafter == "ngram":
        pair.drafter_kind = "ngram"
        pair.drafter_factory = lambda adaptive: NgramDrafter(stop_ids=_special_ids(pair))
        return
    if drafter == "mtp":
        from ..models.mtp import drafter_factory

        _, pair.drafter_factory = drafter_factory(
            pair.target_path, pair.target, pair.vocab_size, pair.kernels
        )
        pair.drafter_kind = "mtp"
        return
    if draft is None:
        return
    pair.draft_path = resolve_model(draft)
    kind = _feature_draft_kind(pair.draft_path)
    if kind is not None:
        module = importlib.import_module(FEATURE_DRAFTS[kind])
        make = module.load_draft(pair.draft_path, pair)
    else:
        kind, make = "model", _attach_draft_model(pair, rows, vocab)
    if drafter == "model":
        pair.drafter_kind, pair.drafter_factory = kind, make
    else:
        pair.drafter_kind = f"{kind}+ngram"
        pair.drafter_factory = lambda adaptive: HybridDrafter(
            make(adaptive), NgramDrafter(stop_ids=_special_ids(pair))
        )


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


def _special_ids(pair: Pair) -> frozenset[int]:
    """Control tokens (BOS, EOS, chat turn markers): never part of a copied n-gram proposal."""
    ids = set(getattr(pair.tokenizer, "all_special_ids", None) or ()) | set(pair.eos_token_ids)
    return frozenset(ids)


def _attach_draft_model(pair: Pair, target_rows: int, vocab: int) -> Callable[[bool], Drafter]:
    """Load an ordinary draft model into `pair` after checking it can draft for the target;
    returns the factory of its drafter."""
    pair.draft, draft_tokenizer, _ = _load_model(pair.draft_path, use_kernels=pair.kernels)
    draft_rows = _embedding_rows(pair.draft)
    # The draft must use the target's ids; refuse another tokenizer before generating anything.
    check_tokenizers(
        pair.tokenizer,
        draft_tokenizer,
        target_rows=target_rows,
        draft_rows=draft_rows,
        target_name=str(pair.target_path),
        draft_name=str(pair.draft_path),
    ).raise_for_errors()
    pair.vocab_size = min(target_rows, draft_rows, vocab)
    pair.draft_cache_kinds = _checked_caches(pair.draft, pair.draft_path, "draft", pair.vocab_size)
    size = chosen_size(pair.vocab_size, switches.DRAFT_VOCAB.value())
    head = prune_head(pair.draft, pair.vocab_size, size, _special_ids(pair))
    pair.draft_vocab = head.size if head is not None else 0
    return lambda adaptive: ModelDrafter(
        pair.draft,
        pair.vocab_size,
        DRAFT_CONFIDENCE if adaptive else 0.0,
        head,
        context=pair.draft_context,
    )


def _checked_caches(model: nn.Module, where: Path, role: str, vocab: int) -> dict[str, int]:
    """The model's cache kinds; refuses, before any output, one speculation cannot rewind."""
    try:
        return caches.check(model, vocab)
    except ModelError as e:
        raise ModelError(
            f"the {role} model ({where}) cannot speculate exactly: {e}; "
            "decode it plainly (speculative=False, or no draft)"
        ) from None


def _feature_draft_kind(path: Path) -> str | None:
    """The kind a distilled draft declares in draft.json, "eagle3" for a published EAGLE-3
    draft (its config.json says so), or None for an ordinary model."""
    from ..models.eagle3_export import is_draft

    meta = path / "draft.json"
    if not meta.is_file():
        return "eagle3" if is_draft(path) else None
    try:
        kind = json.loads(meta.read_text()).get("kind")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(f"cannot read {meta}: {e}") from e
    if kind not in FEATURE_DRAFTS:
        raise ModelError(f"{meta} declares an unknown draft kind {kind!r}")
    return kind
