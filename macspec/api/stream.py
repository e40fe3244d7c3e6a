"""The streaming API: a generation as RoundEvents (frozen, plain data), its statistics, and
`generate()` for a whole answer. Loading a pair is `macspec.load` (macspec/api/pair.py)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..base.errors import PromptError
from ..core import (
    Engine,
    FixedK,
    FixedTree,
    Limits,
    Observed,
    Round,
    Sampling,
    TreeShape,
    adaptive,
    generate_rounds,
    guard,
    make_target,
)
from ..core.logprobs import TokenLogprob
from ..core.observed import Reasons
from . import chat_template
from .grammar import Grammar
from .kept_costs import calibrate
from .options import GenerationOptions
from .options import signature as options_signature
from .pair import Pair
from .text import DRAFT, REJECTED, TARGET, TextStream


@dataclass(frozen=True)
class RoundEvent:
    """One verification round (or plain step), as streamed to the UI, CLI and server: all they
    show. `pieces` is the round's new text as (text, origin) with origin "draft" (accepted),
    "target" (the target's own token) or "rejected" (drafts thrown away, shown where they were
    proposed; not part of `text`); `stats` are the running totals after this round."""

    accepted: tuple[int, ...]
    rejected: tuple[int, ...]
    emitted: tuple[int, ...]
    target_token: int | None
    text: str
    pieces: tuple[tuple[str, str], ...]
    num_draft: int
    speculative: bool
    draft_time: float  # until the drafts were ready (the verification graph is built meanwhile)
    verify_time: float  # from then until the target's verdict
    round_time: float  # from the last round's readout to this one's
    plain_step_time: float  # plain decoding's seconds a token at this context (0: unknown)
    finish_reason: str | None
    comm_time: float = 0.0  # distributed target: seconds of this round spent communicating
    stats: GenerationStats | None = None
    rows: int = 1  # ids the target's pass verified (drafts + 1; a token tree: its nodes + 1)
    drafter: str = ""  # what drafted this round ("model", "ngram", ...; "": a plain step)
    # per emitted id, with the option top_logprobs (core/logprobs.py); else None
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def speedup(self) -> float | None:
        """This round against plain decoding: its tokens x a plain step here / its time."""
        if not self.emitted or self.round_time <= 0 or self.plain_step_time <= 0:
            return None
        return len(self.emitted) * self.plain_step_time / self.round_time


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
    # Plain decoding's seconds a token over this answer's contexts (the mean of its rounds'
    # plain_step_time, loop.Timing): 0.0 where no plain step is known.
    plain_step_time: float
    seed: int
    cached_tokens: int = (
        0  # prompt ids restored from the prompt cache (core/caches/prompt_cache.py)
    )
    # Rounds and tokens per arm: (drafter, K, rounds, tokens), drafter "plain" (K 0) for plain
    # steps, else the registry name of what drafted ("model", "ngram", ...) and the drafts it
    # proposed; ordered plain first, then by drafter and K.
    arms: tuple[tuple[str, int, int, int], ...] = ()
    # The counts behind per_position_acceptance, to pool several answers: drafts proposed and
    # accepted at each position.
    drafted_at: tuple[int, ...] = ()
    accepted_at: tuple[int, ...] = ()
    # Why the adaptive policy's plain steps were plain: (reason, steps), the most common first
    # (core/tally.py, Decision.reason; empty for a fixed K and for the first token's step).
    plain_reasons: tuple[tuple[str, int], ...] = ()

    def plain_line(self) -> str:
        """Why the plain steps were plain: "priced below plain 30, nothing to propose 2"."""
        return ", ".join(f"{reason} {n}" for reason, n in self.plain_reasons)

    def arms_line(self) -> str:
        """Which drafter and K the rounds used: "plain 40, model K=2 5 (9 tok), ..."."""
        parts = []
        for name, k, rounds, tokens in self.arms:
            if name == "plain":
                parts.append(f"plain {rounds}")
            else:
                parts.append(f"{name} K={k} {rounds} ({tokens} tok)")
        return ", ".join(parts)

    @property
    def speedup(self) -> float | None:
        """Tokens per second against plain decoding's (one token per measured plain step)."""
        if not self.tokens_per_second or not self.plain_step_time:
            return None
        return self.tokens_per_second * self.plain_step_time

    def summary(self, timings: bool = True) -> str:
        """One line a person can read: tokens, speed against plain decoding, acceptance."""
        parts = [f"{self.generated_tokens} tokens in {self.rounds} rounds"]
        if timings and self.total_time:
            speed = f"{self.tokens_per_second:.1f} tok/s"
            if self.speedup and self.speculative_rounds:  # (plain decoding: nothing to compare)
                speed += f" ({self.speedup:.2f}x plain: {1 / self.plain_step_time:.1f} tok/s)"
            parts.append(speed)
        if self.drafted:
            parts.append(f"acceptance {self.acceptance_rate:.0%}")
            parts.append(f"{self.mean_accepted_length:.2f} tokens/round")
            parts.append(f"rounds by arm: {self.arms_line()}")
        return ", ".join(parts)


def acceptance_by_position(
    counts: Iterable[tuple[Sequence[int], Sequence[int]]],
) -> list[float]:
    """P(the draft at position i accepted | drafted), pooled over several answers' counts
    (drafted_at, accepted_at) by summing them, for the positions any answer drafted at."""
    drafted: list[int] = []
    accepted: list[int] = []
    for d_at, a_at in counts:
        for i, (d, a) in enumerate(zip(d_at, a_at, strict=True)):
            if i == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d
            accepted[i] += a
    return [a / d for a, d in zip(accepted, drafted, strict=True) if d]


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats


class _StatsCounter:
    """Accumulates rounds into GenerationStats."""

    def __init__(self, prompt_tokens: int, seed: int, reasons: Reasons | None = None):
        self.prompt_tokens, self.seed = prompt_tokens, seed
        self.reasons = reasons  # the adaptive policy's decisions (None: a fixed K)
        self.rounds = self.spec_rounds = self.spec_emitted = self.generated = 0
        self.draft_time = self.verify_time = self.total_time = self.prefill_time = 0.0
        self.plain_time = 0.0  # plain decoding's seconds for the tokens of rounds that know it
        self.priced = 0  # those tokens
        self.cached_tokens = 0
        self.drafted_at: list[int] = []
        self.accepted_at: list[int] = []
        self.arms: dict[tuple[str, int], list[int]] = {}  # (drafter, K) -> [rounds, tokens]

    def add(self, r: Round, emitted: int) -> None:
        self.rounds += 1
        self.generated += emitted
        self.prefill_time += r.prefill_time
        self.cached_tokens += r.cached_tokens
        self.draft_time += r.draft_time
        self.verify_time += r.verify_time
        self.total_time += r.round_time
        if r.plain_step_time > 0:
            self.plain_time += emitted * r.plain_step_time
            self.priced += emitted
        arm = self.arms.setdefault((r.drafter or "plain", r.num_draft), [0, 0])
        arm[0], arm[1] = arm[0] + 1, arm[1] + emitted
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
            plain_step_time=self.plain_time / self.priced if self.priced else 0.0,
            seed=self.seed,
            cached_tokens=self.cached_tokens,
            arms=tuple(
                (name, k, n, tokens)
                for (name, k), (n, tokens) in sorted(
                    self.arms.items(), key=lambda a: (a[0][0] != "plain", a[0])
                )
            ),
            plain_reasons=() if self.reasons is None else self.reasons.plain_steps(),
            drafted_at=tuple(self.drafted_at),
            accepted_at=tuple(self.accepted_at),
        )


# ---------------------------------------------------------------- generation


def prompt_ids(
    pair: Pair,
    prompt: str | Sequence[int] | None = None,
    messages: Sequence[dict[str, str]] | None = None,
) -> list[int]:
    """The token ids a generation from `prompt` or `messages` starts from (stream_generate's
    rules: messages through the chat template, a string as-is, ids exactly)."""
    if (prompt is None) == (messages is None):
        raise PromptError("give either a prompt or messages, not both or neither")
    if messages is not None:
        prompt = chat_template.render(pair.tokenizer, messages)
    return _encode(pair, prompt)


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


def stream_generate(
    pair: Pair,
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[dict[str, str]] | None = None,
    on_prefill: Callable[[int, int], None] | None = None,
    **options: Any,
) -> GenerationStream:
    """Generate from `prompt` or `messages`, yielding one RoundEvent per target forward pass.

    `messages` ([{"role": "user", "content": ...}, ...]) go through the target's chat template,
    as `macspec chat` and `macspec generate` do; a string `prompt` is encoded as-is (no chat
    template); a list of ids is used exactly. `on_prefill(read, total)` is called, on the
    generating thread, as the prompt's ids are read (every 512, and when all are; ids the
    prompt cache held count as read); an exception it raises ends the generation. The options
    are `GenerationOptions`' fields (macspec/api/options.py: max_tokens, temperature, top_p,
    top_k, min_p, repetition_penalty, num_draft, seed, stop, speculative, adaptive, grammar,
    json_schema, top_logprobs)."""
    opts = GenerationOptions.from_kwargs(**options)
    ids = prompt_ids(pair, prompt, messages)
    check_length(pair, ids)
    told = None if on_prefill is None else lambda read, total, _held: on_prefill(read, total)
    return open_stream(pair, ids, opts, progress=told)


def check_length(pair: Pair, ids: Sequence[int]) -> None:
    """PromptError unless the prompt leaves room in the context for an answer."""
    if len(ids) >= pair.context_length:
        raise PromptError(
            f"the prompt has {len(ids)} tokens but the model's context holds "
            f"{pair.context_length}: shorten it"
        )


class GenerationStream:
    """Iterator of RoundEvents; `stats()` gives the running totals at any point."""

    def __init__(
        self,
        pair: Pair,
        ids: list[int],
        steps: Iterator[Round],
        stops: list[str],
        seed: int,
        reasons: Reasons | None = None,
    ):
        self.prompt_tokens = len(ids)
        self.seed = seed
        self._steps = steps
        self._counter = _StatsCounter(len(ids), seed, reasons)
        self._text = TextStream(pair.tokenizer, stops)
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
        # Accepted drafts, then (where they were proposed) the rejected ones, then the
        # target's token; a stop string cuts the round short.
        n = min(len(r.accepted), len(r.emitted))
        taken, stopped = self._text.add(r.emitted[:n], DRAFT)
        at = len(self._text.text)
        rejected = self._text.peek(r.rejected) if not stopped else ""
        if not stopped:
            more, stopped = self._text.add(r.emitted[n:], TARGET)
            taken += more
        emitted = r.emitted[:taken]
        finish = "stop_string" if stopped else r.finish_reason
        if r.finish_reason and not stopped:
            self._text.finalize()
        pieces = self._text.release(finish is not None, rejected, at)
        self._counter.add(r, len(emitted))
        if finish:
            self.close()
        return RoundEvent(
            accepted=tuple(r.accepted),
            rejected=tuple(r.rejected),
            emitted=tuple(emitted),
            target_token=r.target_token if len(emitted) == len(r.emitted) else None,
            text="".join(t for t, origin in pieces if origin != REJECTED),
            pieces=tuple(pieces),
            num_draft=r.num_draft,
            speculative=r.num_draft > 0,
            draft_time=r.draft_time,
            verify_time=r.verify_time,
            round_time=r.round_time,
            plain_step_time=r.plain_step_time,
            finish_reason=finish,
            comm_time=r.comm_time,
            stats=self._counter.stats(),
            rows=r.rows,
            drafter=r.drafter,
            logprobs=None if r.logprobs is None else tuple(r.logprobs[:taken]),
        )

    def stats(self) -> GenerationStats:
        return self._counter.stats()

    def close(self) -> None:
        self._done = True
        self._steps.close()


def open_stream(
    pair: Pair,
    ids: list[int],
    opts: GenerationOptions,
    rounds: Any = generate_rounds,
    progress: Callable[[int, int, int], None] | None = None,
) -> GenerationStream:
    """The generation's stream; `rounds`: what makes its Rounds, with generate_rounds'
    arguments (the server's batches give core/batch_rounds.py's rows); `progress`: told
    (ids read, ids to read, ids the prompt cache held) as the prompt is read (Engine.progress;
    stream_generate's on_prefill without the third)."""
    constraint = None
    if opts.constraint is not None:
        eos = sorted(pair.eos_token_ids)
        constraint = Grammar.for_pair(opts.constraint, pair.tokenizer, pair.vocab_size, eos)
    seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(4), "little")
    drafter = pair.make_drafter(opts.adaptive) if opts.speculative else None
    adaptive = drafter is not None and opts.adaptive
    if adaptive and pair.costs is None:  # sharded, or loaded with measure=False: measured now
        pair.costs = calibrate(pair)
    if drafter is not None and _trees(opts):
        pair.check_trees()
    policy = _policy(opts, pair) if adaptive else _fixed(opts)
    # Why the adaptive policy's steps were plain, for the statistics.
    reasons = policy.reasons if isinstance(policy, Observed) else None
    engine = Engine(
        make_target(pair, drafter),
        drafter,
        policy,
        pair.timing,
        pair.prompt_cache if pair.group is None else None,
        progress,
        pair.costs,
    )
    sampling = Sampling(opts.sampling, mx.random.key(seed), constraint, opts.top_logprobs)
    limits = Limits(opts.max_tokens, frozenset(pair.eos_token_ids), pair.context_length)
    steps = rounds(engine, ids, sampling, limits)
    return GenerationStream(pair, ids, guard(pair, steps), list(opts.stop), seed, reasons)


def _trees(opts: GenerationOptions) -> int:
    """Tree nodes to draft: none with log probabilities (reported for chains and plain steps)."""
    return opts.tree_nodes if opts.top_logprobs is None else 0


def _policy(opts: GenerationOptions, pair: Pair) -> Observed:
    """The adaptive policy priced by the measured costs, checked against the round times this
    pair observes (its plain steps from now, not the load's: the machine's load moves)."""
    adaptive_k = adaptive(opts.num_draft, pair.costs, _trees(opts), pair.observations.acceptance)
    return Observed(adaptive_k, pair.observations)


def _fixed(opts: GenerationOptions) -> FixedK | FixedTree:
    if _trees(opts):
        return FixedTree(TreeShape(opts.num_draft, 2, _trees(opts)))
    return FixedK(opts.num_draft)


def generate(
    pair: Pair,
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[dict[str, str]] | None = None,
    **options: Any,
) -> GenerationResult:
    """Generate a whole answer; `messages=` and the options as `stream_generate`."""
    stream = stream_generate(pair, prompt, messages=messages, **options)
    tokens: list[int] = []
    parts: list[str] = []
    finish = "length"
    for ev in stream:
        tokens += ev.emitted
        parts.append(ev.text)
        finish = ev.finish_reason or finish
    return GenerationResult(tokens, "".join(parts), finish, stream.stats())


_first = list(inspect.signature(stream_generate).parameters.values())[:4]
stream_generate.__signature__ = options_signature(_first)
generate.__signature__ = options_signature(_first)
