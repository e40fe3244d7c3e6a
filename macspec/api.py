"""Public Python API: load a target/draft pair, stream rounds as events, generate a result."""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import caches, chat_template, kernels
from .compat import check_tokenizers
from .drafters import COPY_PRIORS, Drafter, HybridDrafter, ModelDrafter, NgramDrafter, Proposal
from .engine import Round, Target, Timing, decode
from .errors import MacspecError, ModelError, OptionError, PromptError
from .policy import AdaptiveK, Costs, FixedK
from .sampling import SamplingOptions


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
    costs: Costs | None = None  # measured at load (distributed: at first use; see calibrate)
    calibration_time: float = 0.0  # seconds load() spent measuring them
    group: mx.distributed.Group | None = None  # the target is sharded over it (distributed.py)
    # Makes a fresh drafter for one generation; its argument says whether K is adaptive.
    drafter_factory: Callable[[bool], Drafter] | None = None
    # Layers per cache kind (caches.kinds: attention, window, recurrent), checked at load to
    # rewind exactly when the pair speculates.
    cache_kinds: dict[str, int] = field(default_factory=dict)
    draft_cache_kinds: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        """One line naming the models and how drafts are made (and the target's layer kinds
        when it has more than full attention)."""
        target = self.target_path.name
        if set(self.cache_kinds) - {"attention"}:
            target += f" ({caches.describe_kinds(self.cache_kinds)})"
        if self.drafter_kind is None:
            return f"{target}, plain decoding (no draft)"
        if self.draft_path is None:
            line = f"{target}, {self.drafter_kind} drafting (no draft model)"
        else:
            line = f"{target} + draft {self.draft_path.name} ({self.drafter_kind})"
        if self.costs is not None and self.calibration_time:
            line += (
                f"; measured at load in {self.calibration_time:.1f}s: a plain step "
                f"{self.costs.plain_step * 1000:.0f} ms"
            )
        return line

    def make_drafter(self, adaptive: bool = True) -> Drafter | None:
        return self.drafter_factory(adaptive) if self.drafter_factory else None


# A draft model stops drafting (adaptive K) when its own probability of a token is below this.
DRAFT_CONFIDENCE = 0.3
# Drafter kinds a distilled draft directory can declare in its draft.json -> module with load_draft.
FEATURE_DRAFTS = {"eagle": "macspec.eagle"}


@dataclass(frozen=True)
class RoundEvent:
    """One verification round (or plain step), as streamed to the UI and CLI."""

    accepted: tuple[int, ...]
    rejected: tuple[int, ...]
    emitted: tuple[int, ...]
    target_token: int | None
    text: str
    num_draft: int
    speculative: bool
    draft_time: float  # until the drafts were ready (the verification graph is built meanwhile)
    verify_time: float  # from then until the target's verdict
    round_time: float
    plain_step_time: float
    finish_reason: str | None
    comm_time: float = 0.0  # distributed target: seconds of this round spent communicating


@dataclass(frozen=True)
class GenerationStats:
    rounds: int  # target forward passes after the prompt (speculative rounds + plain steps)
    speculative_rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float  # accepted / drafted (0.0 when nothing was drafted)
    mean_accepted_length: float  # ids emitted per speculative round (1.0 for plain decoding)
    per_position_acceptance: tuple[float, ...]  # P(draft i accepted | i drafted), by position
    prompt_tokens: int
    generated_tokens: int
    prefill_time: float
    draft_time: float
    verify_time: float
    total_time: float  # decoding time after the prompt
    tokens_per_second: float  # generated_tokens / total_time
    plain_step_time: float  # measured seconds of one plain target step
    seed: int


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats


class _StatsCounter:
    """Accumulates rounds into GenerationStats."""

    def __init__(self, prompt_tokens: int, seed: int):
        self.prompt_tokens, self.seed = prompt_tokens, seed
        self.rounds = self.spec_rounds = self.spec_emitted = self.generated = 0
        self.draft_time = self.verify_time = self.total_time = self.prefill_time = 0.0
        self.plain_step_time = 0.0
        self.drafted_at: list[int] = []
        self.accepted_at: list[int] = []

    def add(self, r: Round, emitted: int) -> None:
        self.rounds += 1
        self.generated += emitted
        self.prefill_time += r.prefill_time
        self.draft_time += r.draft_time
        self.verify_time += r.verify_time
        self.total_time += r.round_time
        self.plain_step_time = r.plain_step_time
        if r.num_draft:
            self.spec_rounds += 1
            self.spec_emitted += emitted
            for i in range(r.num_draft):
                if i == len(self.drafted_at):
                    self.drafted_at.append(0)
                    self.accepted_at.append(0)
                self.drafted_at[i] += 1
                self.accepted_at[i] += i < len(r.accepted)

    def stats(self) -> GenerationStats:
        drafted, accepted = sum(self.drafted_at), sum(self.accepted_at)
        return GenerationStats(
            rounds=self.rounds,
            speculative_rounds=self.spec_rounds,
            drafted=drafted,
            accepted=accepted,
            acceptance_rate=accepted / drafted if drafted else 0.0,
            mean_accepted_length=self.spec_emitted / self.spec_rounds if self.spec_rounds else 1.0,
            per_position_acceptance=tuple(
                a / d for a, d in zip(self.accepted_at, self.drafted_at, strict=True)
            ),
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated,
            prefill_time=self.prefill_time,
            draft_time=self.draft_time,
            verify_time=self.verify_time,
            total_time=self.total_time,
            tokens_per_second=self.generated / self.total_time if self.total_time else 0.0,
            plain_step_time=self.plain_step_time,
            seed=self.seed,
        )


# ---------------------------------------------------------------- loading


def _resolve(name_or_path: str | os.PathLike) -> Path:
    """A model directory from a path or a store name (the store knows its names)."""
    try:
        from .store import resolve_model
    except ImportError:  # the store is optional at this layer
        path = Path(name_or_path).expanduser()
        if not path.is_dir():
            raise ModelError(f"model not found: {name_or_path} (no such directory)") from None
        return path
    return resolve_model(str(name_or_path))


def _load_model(path: Path, group=None) -> tuple[nn.Module, TokenizerWrapper, dict]:
    from mlx_lm.utils import load as mlx_load

    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a model directory: config.json is missing")
    if not list(path.glob("model*.safetensors")):
        raise ModelError(f"{path} has no weights (model*.safetensors)")
    if group is not None:  # only this rank's part of the weights (tensor or pipeline parallel)
        from .distributed import load_sharded

        return load_sharded(path, group)
    try:
        # Never trust_remote_code: a model directory must not run its own code.
        model, tokenizer, config = mlx_load(str(path), return_config=True)
    except MacspecError:
        raise
    except Exception as e:  # mlx-lm raises ValueError/KeyError/RuntimeError from deep inside
        raise ModelError(f"cannot load the model in {path}: {type(e).__name__}: {e}") from e
    kernels.accelerate(model)  # CPU backend: table RoPE, attention, SwiGLU (kernels.py)
    return model, tokenizer, config


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
) -> Pair:
    """Load a target and (optionally) a draft: directories or store names.

    With no target, the embedded default pair is used (fetched and converted on first use).
    `drafter`: None (the draft model, trying an n-gram copy from the context first), "model"
    (the draft model only), or "ngram" (no draft model: copy from the prompt and output)."""
    if drafter not in (None, "model", "ngram"):
        raise OptionError(f"unknown drafter={drafter!r}: choose 'model' or 'ngram'")
    if drafter == "ngram" and draft is not None:
        raise OptionError("drafter='ngram' uses no draft model: leave out draft")
    if drafter == "model" and draft is None and target is not None:
        raise OptionError("drafter='model' needs a draft model: give draft=")
    if target is None:
        from .default import default_draft, default_target

        if draft is None and drafter != "ngram":
            # a ModelError if this install lacks it (never a silent n-gram), before any download
            draft = default_draft()
        target_path = default_target()
    else:
        target_path = _resolve(target)
    if group is not None and group.size() == 1:
        group = None
    # Decided before rank > 0 drops the draft: every rank checks the sharded target alike.
    speculates = drafter == "ngram" or draft is not None
    if group is not None and group.rank() > 0:
        draft = None  # the draft runs on rank 0 only (macspec/distributed.py says why)
    model, tokenizer, config = _load_model(target_path, group)
    rows = _embedding_rows(model)
    pair = Pair(
        target=model,
        tokenizer=tokenizer,
        target_path=target_path,
        context_length=_context_length(config),
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
        group=group,
    )
    vocab = len(tokenizer._tokenizer)
    # Ids past the tokenizer's vocabulary are padding rows: never sample them from either model.
    pair.vocab_size = min(rows, vocab)
    pair.cache_kinds = caches.kinds(model)
    if speculates:
        pair.cache_kinds = _checked_caches(model, target_path, "target", pair.vocab_size)
    if drafter == "ngram":
        pair.drafter_kind = "ngram"
        pair.drafter_factory = lambda adaptive: NgramDrafter(stop_ids=_special_ids(pair))
    elif draft is not None:
        pair.draft_path = _resolve(draft)
        kind = _feature_draft_kind(pair.draft_path)
        if kind is not None:
            import importlib

            module = importlib.import_module(FEATURE_DRAFTS[kind])
            make = module.load_draft(pair.draft_path, pair)
        else:
            kind, make = "model", _attach_draft_model(pair, rows, vocab)
        # Every draft tries an n-gram copy from the context first, unless drafter="model".
        if drafter == "model":
            pair.drafter_kind, pair.drafter_factory = kind, make
        else:
            pair.drafter_kind = f"{kind}+ngram"
            pair.drafter_factory = lambda adaptive: HybridDrafter(
                make(adaptive), NgramDrafter(stop_ids=_special_ids(pair))
            )
    if pair.drafter_factory is not None and group is None:
        # Paid here, and said, rather than inside the first answer (issue: a first short
        # answer measured 0.78x plain with the ~3 s of measuring inside it).
        t0 = time.perf_counter()
        pair.costs = calibrate(pair)
        pair.calibration_time = time.perf_counter() - t0
    return pair


def _special_ids(pair: Pair) -> frozenset[int]:
    """Control tokens (BOS, EOS, chat turn markers): never part of a copied n-gram proposal."""
    ids = set(getattr(pair.tokenizer, "all_special_ids", None) or ()) | set(pair.eos_token_ids)
    return frozenset(ids)


def _attach_draft_model(pair: Pair, target_rows: int, vocab: int) -> Callable[[bool], Drafter]:
    """Load an ordinary draft model into `pair` after checking it can draft for the target;
    returns the factory of its drafter."""
    pair.draft, draft_tokenizer, _ = _load_model(pair.draft_path)
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
    return lambda adaptive: ModelDrafter(
        pair.draft, pair.vocab_size, DRAFT_CONFIDENCE if adaptive else 0.0
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
    """The kind a distilled draft declares in draft.json, or None for an ordinary model."""
    meta = path / "draft.json"
    if not meta.is_file():
        return None
    try:
        kind = json.loads(meta.read_text()).get("kind")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(f"cannot read {meta}: {e}") from e
    if kind not in FEATURE_DRAFTS:
        raise ModelError(f"{meta} declares an unknown draft kind {kind!r}")
    return kind


# ---------------------------------------------------------------- generation


def _encode(pair: Pair, prompt: str | Sequence[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("the prompt is empty")
        tok = pair.tokenizer
        # As mlx-lm: add BOS only when the text does not already start with it.
        add_special = tok.bos_token is None or not prompt.startswith(tok.bos_token)
        ids = tok.encode(prompt, add_special_tokens=add_special)
        if not ids:
            raise PromptError(f"the prompt {prompt!r} encodes to no tokens")
        return list(ids)
    ids = list(prompt)
    if not ids:
        raise PromptError("the prompt is empty (no token ids)")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < pair.vocab_size:
            raise PromptError(
                f"token id {i!r} is out of the vocabulary's range [0, {pair.vocab_size})"
            )
    return ids


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"invalid {name}={value!r}: must be an integer >= 1")
    return value


def _stops(stop: str | Sequence[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for s in stops:
        if not isinstance(s, str) or not s:
            raise OptionError(f"invalid stop={s!r}: stop strings must be non-empty strings")
    return stops


def stream_generate(
    pair: Pair,
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[dict[str, str]] | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    num_draft: int = 4,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    speculative: bool = True,
    adaptive: bool = True,
) -> GenerationStream:
    """Generate from `prompt` or `messages`, yielding one RoundEvent per target forward pass.

    `messages` ([{"role": "user", "content": ...}, ...]) go through the target's chat template,
    as `macspec chat` and `macspec generate` do; a string `prompt` is encoded as-is (no chat
    template); a list of ids is used exactly.
    `num_draft` caps K (a copied n-gram continuation, which costs no draft time, may run to
    COPY_FACTOR times that); `adaptive=False` fixes K; `speculative=False` decodes plainly."""
    opts = SamplingOptions(temperature, top_p, top_k, min_p, repetition_penalty)
    _check_positive_int("max_tokens", max_tokens)
    _check_positive_int("num_draft", num_draft)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise OptionError(f"invalid seed={seed!r}: must be an integer")
    stops = _stops(stop)
    if (prompt is None) == (messages is None):
        raise PromptError("give either a prompt or messages, not both or neither")
    text = None if messages is None else chat_template.render(pair.tokenizer, messages)
    ids = _encode(pair, prompt if text is None else text)
    if len(ids) >= pair.context_length:
        raise PromptError(
            f"the prompt has {len(ids)} tokens but the model's context holds "
            f"{pair.context_length}: shorten it"
        )
    return _stream(pair, ids, opts, max_tokens, num_draft, seed, stops, speculative, adaptive)


class GenerationStream:
    """Iterator of RoundEvents; `stats()` gives the running totals at any point."""

    def __init__(
        self, pair: Pair, ids: list[int], steps: Iterator[Round], stops: list[str], seed: int
    ):
        self.prompt_tokens = len(ids)
        self.seed = seed
        self._steps = steps
        self._stops = stops
        self._counter = _StatsCounter(len(ids), seed)
        self._detok = copy.copy(pair.tokenizer.detokenizer)
        self._detok.reset()
        self._shown = 0  # characters of the decoded text already given out
        self._done = False

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> RoundEvent:
        if self._done:
            raise StopIteration
        try:
            r = next(self._steps)
        except BaseException:
            self.close()
            raise
        emitted, finish = self._take_text(r)
        self._counter.add(r, len(emitted))
        if finish:
            self.close()
        return RoundEvent(
            accepted=tuple(r.accepted),
            rejected=tuple(r.rejected),
            emitted=tuple(emitted),
            target_token=r.target_token if len(emitted) == len(r.emitted) else None,
            text=self._new_text(finish is not None),
            num_draft=r.num_draft,
            speculative=r.num_draft > 0,
            draft_time=r.draft_time,
            verify_time=r.verify_time,
            round_time=r.round_time,
            plain_step_time=r.plain_step_time,
            finish_reason=finish,
            comm_time=r.comm_time,
        )

    def _take_text(self, r: Round) -> tuple[list[int], str | None]:
        """Feed the round's ids to the detokenizer one by one, cutting at a stop string."""
        for i, t in enumerate(r.emitted):
            self._detok.add_token(t)
            if self._stops and self._stop_at() is not None:
                return r.emitted[: i + 1], "stop_string"
        if r.finish_reason:
            self._detok.finalize()
        return r.emitted, r.finish_reason

    def _stop_at(self) -> int | None:
        # Text already shown never holds the start of a stop string (see _new_text's hold-back).
        text = self._detok.text
        found = [i for s in self._stops if (i := text.find(s, self._shown)) >= 0]
        return min(found) if found else None

    def _new_text(self, final: bool) -> str:
        text = self._detok.text
        end = len(text)
        if self._stops:
            stop = self._stop_at()
            if stop is not None:
                end = stop
            elif not final:
                # Hold back a tail that may be the beginning of a stop string.
                end -= max(
                    (n for s in self._stops for n in range(1, len(s)) if text.endswith(s[:n])),
                    default=0,
                )
        new = text[self._shown : max(end, self._shown)]
        self._shown += len(new)
        return new

    def stats(self) -> GenerationStats:
        return self._counter.stats()

    def close(self) -> None:
        self._done = True
        self._steps.close()


def _stream(
    pair: Pair,
    ids: list[int],
    opts: SamplingOptions,
    max_tokens: int,
    num_draft: int,
    seed: int | None,
    stops: list[str],
    speculative: bool,
    adaptive: bool,
) -> GenerationStream:
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    drafter = pair.make_drafter(adaptive) if speculative else None
    if drafter is not None and adaptive and pair.costs is None:
        pair.costs = calibrate(pair)
    steps = decode(
        _target(pair, drafter),
        drafter,
        ids,
        opts,
        max_tokens=max_tokens,
        num_draft=num_draft,
        key=mx.random.key(seed),
        eos_ids=set(pair.eos_token_ids),
        context_length=pair.context_length,
        timing=pair.timing,
        policy=_policy(num_draft, pair.costs) if drafter and adaptive else FixedK(num_draft),
    )
    return GenerationStream(pair, ids, _guarded(pair, steps), stops, seed)


# Copied n-gram ids cost no draft time, so a copy may run to this many times num_draft: a long
# match (16+ ids) is followed ~93% of the time, and on a CPU a pass over 17 ids costs ~2 steps.
COPY_FACTOR = 4


def _policy(num_draft: int, costs: Costs) -> AdaptiveK:
    return AdaptiveK(num_draft, costs, copy_max=COPY_FACTOR * num_draft, priors=COPY_PRIORS)


def _target(pair: Pair, drafter: Drafter | None) -> Target:
    keep_hidden = getattr(drafter, "needs_hidden", False)
    taps = tuple(getattr(drafter, "feature_layers", ()))  # layers a feature draft reads
    if pair.group is None:
        return Target(pair.target, pair.vocab_size, keep_hidden, taps, pair.target_path.name)
    from .distributed import leader_target  # a sharded target: rank 0 leads the other ranks

    return leader_target(pair, keep_hidden, taps)


def _guarded(pair: Pair, steps: Iterator[Round]) -> Iterator[Round]:
    if pair.group is None:
        return steps
    from .distributed import guard  # bounded waits, communication time per round

    return guard(pair, steps)


def calibrate(pair: Pair, k: int = 4, widths: tuple[int, ...] = (1, 2, 4, 8, 16)) -> Costs:
    """Measure, on this machine, what a plain step, a draft token and wider verifications cost:
    a short decode alternating plain steps and passes verifying filler ids over each of `widths`
    drafts (3 of each, after one warm-up cycle), and (with a draft model) a short fixed-K
    speculative decode, all over arbitrary ids."""
    from statistics import median

    ids = [(7 * i) % pair.vocab_size for i in range(1, 33)]  # any ids: only the time is used
    context = min(pair.context_length, 1 << 20)

    def run(drafter: Drafter | None, ks: list[int]) -> list[Round]:
        """The first (plain) step, then one round per entry of ks (0 = plain)."""
        max_tokens = 1 + sum(n + 1 for n in ks)  # room for every round, whatever is accepted
        steps = decode(
            _target(pair, drafter),
            drafter,
            ids[: max(2, min(len(ids), context - max_tokens - 1))],
            SamplingOptions(),
            max_tokens=max_tokens,
            num_draft=k,
            key=mx.random.key(0),
            eos_ids=set(),
            context_length=context,
            timing=pair.timing,
            policy=_Schedule(ks),
        )
        return list(islice(_guarded(pair, steps), len(ks) + 1))

    # Plain steps and every width interleaved, on the target as the real drafter runs it: load
    # changes during the measurement then hit all of them alike. The first cycle warms up (the
    # first passes of a process were measured 25% slower) and is not counted.
    drafter = pair.make_drafter(False)
    cycle = [0, *widths]
    rounds = run(_Filler(drafter), cycle * 4)[1 + len(cycle) :]
    plain = median(r.verify_time for r in rounds if r.num_draft == 0)
    # A pass is priced whole: the filler's "draft time" is the verification graph's build,
    # which only a draft model's computation hides (engine.speculative_round).
    passes = tuple(
        (n, median(r.draft_time + r.verify_time for r in rounds if r.num_draft == n))
        for n in widths
        if any(r.num_draft == n for r in rounds)  # a tiny context may cut the widest ones
    )
    at_k = dict(passes).get(k)
    extra = max(0.0, at_k - plain) / k if at_k is not None else 0.0
    draft = 0.0
    if pair.drafter_kind != "ngram":  # arbitrary ids never repeat: the model drafts every round
        rounds = [r for r in run(drafter, [k] * 5) if r.num_draft]
        draft = median(r.draft_time / r.num_draft for r in rounds) if rounds else 0.0
    return Costs(plain_step=plain, draft_step=draft, extra=extra, verify=passes)


class _Schedule:
    """The policy calibrate() decodes with: the given K per round, in order, then plain steps."""

    def __init__(self, ks: list[int]) -> None:
        self.ks = list(ks)
        self.max_k = max(self.ks, default=0)

    def next_k(self, label: Any = None) -> int:
        return self.ks.pop(0) if self.ks else 0

    def observe(self, k: int, accepted: int) -> None:
        pass


class _Filler:
    """Proposes k copies of id 0 every round: verification cost alone, for calibrate()."""

    name = "filler"

    def __init__(self, drafter: Drafter) -> None:
        # The target runs as it will with the real drafter (hidden states, tapped layers).
        self.needs_hidden = drafter.needs_hidden
        self.feature_layers = getattr(drafter, "feature_layers", ())

    def start(self, prompt: list[int], hidden: Any = None, max_step: int = 1) -> None:
        pass

    def label(self) -> None:
        return None

    def propose(self, k: int, dist: Any, key: mx.array) -> Proposal:
        return Proposal(mx.zeros((k,), mx.int32), None)

    def commit(self, k: int, accepted: int, emitted: list[int], hidden: Any = None) -> None:
        pass

    def abort(self, k: int) -> None:
        pass


def generate(
    pair: Pair, prompt: str | Sequence[int] | None = None, **options: Any
) -> GenerationResult:
    """Generate a whole answer; `messages=` and the options as `stream_generate`."""
    stream = stream_generate(pair, prompt, **options)
    tokens: list[int] = []
    parts: list[str] = []
    finish = "length"
    for ev in stream:
        tokens += ev.emitted
        parts.append(ev.text)
        finish = ev.finish_reason or finish
    return GenerationResult(tokens, "".join(parts), finish, stream.stats())


__all__ = [
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "Pair",
    "RoundEvent",
    "generate",
    "load",
    "stream_generate",
]
