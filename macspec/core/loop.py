"""The generation loop: a step generator that yields one Round per target forward pass, as plain
data (ids and seconds), until a stop. No I/O, no text.

The first token always comes from a plain step, which also measures what a plain step costs now;
with no drafter every step is plain. A policy picks each round's K (0: a plain step) or a token
tree from the drafter's label of its next proposal; verify.py and tree.py run the rounds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from statistics import median
from time import perf_counter

import mlx.core as mx

from ..base.errors import OptionError
from . import memory
from .caches import Hit, PromptCache
from .constraint import Constraint
from .drafters.base import Distribution, Drafter
from .logprobs import TokenLogprob, token_logprobs
from .policy import FixedK, Label, Policy
from .sampling import SamplingOptions
from .target import Target
from .tree import TreeShape, fit, tree_round
from .verify import make_dist, plain_step, speculative_round


@dataclass
class Round:
    """What one round did, as plain data (ids and seconds)."""

    accepted: list[int]  # drafts kept
    rejected: list[int]  # drafts thrown away
    emitted: list[int]  # ids added to the output this round (after stops)
    target_token: int | None  # the id the target sampled (correction or bonus), if emitted
    num_draft: int  # drafts proposed along a path (a tree: its depth; 0 = a plain step)
    draft_time: float
    verify_time: float
    round_time: float
    plain_step_time: float  # current estimate of one plain target step on this machine
    finish_reason: str | None  # "stop", "length", "context" or None
    prefill_time: float = 0.0  # prompt processing, reported with the first round
    rows: int = 1  # ids the target's pass verified (a chain: drafts + 1; a tree: its nodes + 1)
    cached_tokens: int = 0  # prompt ids the prompt cache held (not read again), first round
    comm_time: float = 0.0  # distributed: rank 0's seconds in messages and all-reduces
    drafter: str = ""  # the registry name of what drafted this round ("": a plain step)
    logprobs: list[TokenLogprob] | None = None  # per emitted id, when asked for (logprobs.py)


class Timing:
    """Measured cost of one plain target step, kept across generations of a loaded pair:
    the median of the latest plain steps, so one slow step (a busy machine) does not swing it."""

    def __init__(self, window: int = 16) -> None:
        self.recent: deque[float] = deque(maxlen=window)

    @property
    def plain_step(self) -> float | None:
        return median(self.recent) if self.recent else None

    def observe_plain_step(self, seconds: float) -> None:
        self.recent.append(seconds)


def generate_rounds(
    target: Target,
    drafter: Drafter | None,
    prompt: list[int],
    opts: SamplingOptions,
    *,
    max_tokens: int,
    num_draft: int,
    key: mx.array,
    eos_ids: set[int],
    context_length: int,
    timing: Timing,
    policy: Policy | None = None,
    prompt_cache: PromptCache | None = None,
    constraint: Constraint | None = None,
    logprobs: int | None = None,
) -> Iterator[Round]:
    """Yield one Round per target pass until a stop ("stop", "length", "context"). `policy` picks
    K per round (default: num_draft); `prompt_cache`: start from kept states, keep the final ones;
    `constraint` masks p and q alike (trees: the walk follows masked rows only); `logprobs`: each
    emitted id's log probability and its `logprobs` most likely (chains and plain steps)."""
    policy = policy or FixedK(num_draft)
    with memory.wired_limit(target.model):
        history, max_step = list(prompt), _max_step(policy, target, prompt_cache)
        kept, prefill_time = _start(target, drafter, prompt, max_step, prompt_cache)
        opening = (prefill_time, kept.length if kept else 0)  # reported with the first round
        generated, steady = 0, True  # steady: the states hold `history` (less its last id)
        ready, clearing = perf_counter(), memory.CacheClearing()  # ready: the latest ids read
        try:
            while True:
                room = min(max_tokens - generated, context_length - len(history))
                k = _next_k(policy, drafter, target, generated, room)
                key, subkey = mx.random.split(key)
                dist = make_dist(opts, history, constraint)
                seen: list | None = [] if logprobs is not None else None  # the target's rows
                steady = False
                # A launched pass has run since the last ids were read: its time is this round's.
                t0 = ready if target.ahead is not None else perf_counter()
                launch = target.takes_lazy_ids and room > 1  # a plain step's next pass, early
                v = _observed_round(
                    target, drafter, policy, timing, history[-1], k, dist, subkey, t0, launch, seen
                )
                ready = perf_counter()
                limits = (eos_ids, generated, max_tokens, context_length)
                emitted, finish, lps = _emit(
                    v, room, history, limits, seen, opts, constraint, logprobs
                )
                steady = True
                r = _round(
                    v, emitted, finish, ready - t0, timing, None if generated else opening, lps
                )
                generated += len(emitted)
                clearing.after(generated)
                yield r
                if finish:
                    return
        finally:
            if steady:  # a pass launched past the end is never read; the states may be kept
                _close(target, drafter, history, prompt_cache)


def _emit(
    v: _Verdict,
    room: int,
    history: list[int],
    limits: tuple[set[int], int, int, int],
    seen: list | None,
    opts: SamplingOptions,
    constraint: Constraint | None,
    logprobs: int | None,
) -> tuple[list[int], str | None, list | None]:
    """The round's ids (cut at a stop; `history` takes them all, as the states hold them), why
    the generation finished (None: it goes on), and their log probabilities when asked for.
    `limits`: (eos ids, ids generated so far, max_tokens, context length)."""
    emitted = (v.drafts[: v.n] + [v.token])[:room]
    lps = _logprobs(seen, emitted, opts, history, constraint, logprobs)
    history += emitted
    eos_ids, generated, max_tokens, context_length = limits
    emitted, finish = _stop(emitted, eos_ids, generated, max_tokens, history, context_length)
    if constraint is not None:
        constraint.commit(emitted)  # always allowed: drawn from masked rows
    return emitted, finish, lps


def _observe(policy: Policy, drafter: Drafter | None, k: int, tokens: int, seconds: float) -> None:
    """Tell the policy a round's time, less the drafter's catch-up after plain steps (the
    stretch before the round, not the round's own cost)."""
    policy.observe_time(
        k, tokens, max(0.0, seconds - (drafter.take_catch_up() if drafter else 0.0))
    )


def _close(
    target: Target, drafter: Drafter | None, history: list[int], prompt_cache: PromptCache | None
) -> None:
    """Finished, or closed between rounds: drop a pass launched past the end, and keep the
    states for the next prompt."""
    target.drop_launch()
    if prompt_cache is not None:
        prompt_cache.save(history, target.cache, drafter)


def _max_step(policy: Policy, target: Target, prompt_cache: PromptCache | None) -> int:
    """The widest pass a round may take back (one more: a launched pass, if the round fails)."""
    max_step = policy.max_k + 1 + target.takes_lazy_ids
    if prompt_cache is not None:
        max_step = max(max_step, prompt_cache.min_step)  # window rings that rewind further
    return max_step


def _start(
    target: Target,
    drafter: Drafter | None,
    prompt: list[int],
    max_step: int,
    prompt_cache: PromptCache | None,
) -> tuple[Hit | None, float]:
    """Bring the target and the drafter to the prompt: from kept states where the prompt cache
    has some, else by reading it whole. Returns the kept states used and the seconds taken."""
    t0 = perf_counter()
    kept = prompt_cache.restore(prompt, drafter, max_step) if prompt_cache is not None else None
    if kept is not None:
        target.start(prompt, max_step, kept.target)
        if drafter is not None:
            drafter.resume(kept.draft, prompt, kept.draft_length, target.hidden, max_step)
    else:  # (a sharded target's start takes no cache: it has no prompt cache)
        target.start(prompt, max_step)
        if drafter is not None:
            drafter.start(prompt, target.hidden, max_step)
    if prompt_cache is not None and prompt_cache.wants_checkpoint(target.cache):
        prompt_cache.save(prompt, target.cache, drafter)
    return kept, perf_counter() - t0


def _next_k(
    policy: Policy, drafter: Drafter | None, target: Target, generated: int, room: int
) -> int | TreeShape:
    """The next round's drafts: none for the first token or without a drafter, else the
    policy's, never past max_tokens or the context (a round emits at most k + 1 ids), nor
    wider than the backend computes each row alike to a pass of its own (Target.widest)."""
    if drafter is None or generated == 0:
        return 0
    launched = target.ahead is not None
    k = policy.next_k(_label(policy, drafter, launched, target.offset), launched, target.offset)
    # No wider pass than gives every row a plain step's bits (else a near-tie may go otherwise).
    widest = target.widest
    room = room if widest is None else min(room, widest)
    return fit(k, room - 1, widest) if isinstance(k, TreeShape) else min(k, room - 1)


def _label(policy: Policy, drafter: Drafter, launched: bool, position: int) -> Label:
    """The label of the drafter's next proposal: where it offers several (a hybrid's short
    match: its model or a copy) and the policy can weigh them, the policy's pick, which the
    drafter then drafts (from the context and past rounds only: exact)."""
    labels = drafter.labels()
    label = labels[0] if len(labels) == 1 else policy.pick(labels, launched, position)
    drafter.choose(label)
    return label


@dataclass
class _Verdict:
    """A round before stops: drafts in chain order (the kept ones first), how many were kept,
    the target's token, the seconds spent, drafts along a path and rows verified."""

    drafts: list[int]
    n: int
    token: int
    draft_time: float
    verify_time: float
    num_draft: int
    rows: int
    drafter: str = ""


def _drafter_name(drafter: Drafter) -> str:
    """What drafted the last proposal (a hybrid's copy or its model)."""
    return drafter.drafted_by()


def _observed_round(
    target: Target,
    drafter: Drafter | None,
    policy: Policy,
    timing: Timing,
    last: int,
    k: int | TreeShape,
    dist: Distribution,
    key: mx.array,
    t0: float,
    launch: bool,
    seen: list | None = None,
) -> _Verdict:
    """_verify, its time observed by the policy: generate_rounds' rounds, and a batch row's
    round alone (a shared round's time is not the row's own: batch_rounds)."""
    v = _verify(target, drafter, policy, timing, last, k, dist, key, t0, launch, seen)
    _observe(policy, drafter, k, v.n + 1, perf_counter() - t0)
    return v


def _verify(
    target: Target,
    drafter: Drafter | None,
    policy: Policy,
    timing: Timing,
    last: int,
    k: int | TreeShape,
    dist: Distribution,
    key: mx.array,
    t0: float,
    launch: bool,
    seen: list | None = None,
) -> _Verdict:
    """One round: a token tree, a chain of k drafts, or a plain step (k = 0) that may launch
    the next pass (`launch`) when the policy expects the next round to be plain too. `seen`
    gets the target's rows of a chain or a plain step (speculative_round)."""
    if isinstance(k, TreeShape):
        if seen is not None:
            raise OptionError("log probabilities are reported for chains and plain steps only")
        target.drop_launch()  # a tree's root is in its own pass
        tr, path, token, draft_time, verify_time = tree_round(target, drafter, last, k, dist, key)
        policy.observe_tree(tr, path, perf_counter() - t0)
        # As a chain: the accepted path, then the candidates where the target diverged.
        below = path[-1] if path else -1
        drafts = [tr.tokens[i] for i in path] + [tr.tokens[i] for i in tr.children(below)]
        depth = max(tr.depths, default=0)
        name = _drafter_name(drafter)
        return _Verdict(drafts, len(path), token, draft_time, verify_time, depth, len(tr) + 1, name)
    if k > 0:
        drafts, n, token, draft_time, verify_time = speculative_round(
            target, drafter, last, k, dist, key, seen
        )
        policy.observe(len(drafts), n)
        rows = len(drafts) + 1 if drafts else 1
        name = _drafter_name(drafter) if drafts else ""
        return _Verdict(drafts, n, token, draft_time, verify_time, len(drafts), rows, name)
    ahead = launch and (drafter is None or policy.expects_plain())
    token = plain_step(target, last, dist, key, ahead, seen)
    verify_time = perf_counter() - t0
    timing.observe_plain_step(verify_time)
    if drafter is not None:
        drafter.commit(0, 0, [token], target.hidden)
    return _Verdict([], 0, token, 0.0, verify_time, 0, 1)


def _logprobs(
    seen: list | None,
    emitted: list[int],
    opts: SamplingOptions,
    history: list[int],
    constraint: Constraint | None,
    top: int | None,
) -> list[TokenLogprob] | None:
    """The emitted ids' log probabilities from the rows of the target's pass (row i: the
    distribution emitted[i] was drawn from), before the round is committed. Greedy sampling's
    rows are one-hot: then the model's own distribution at temperature 1 (the penalty and the
    mask applied, no filters), as OpenAI reports logprobs at temperature 0."""
    if seen is None or top is None:
        return None
    logits, drafts, p = seen[-1]
    if opts.greedy:
        own = SamplingOptions(
            1.0,
            repetition_penalty=opts.repetition_penalty,
            repetition_context=opts.repetition_context,
        )
        p = make_dist(own, history, constraint).probs(logits[: len(emitted)], drafts, 0)
    return token_logprobs(p, emitted, top)


def _stop(
    emitted: list[int],
    eos_ids: set[int],
    generated: int,
    max_tokens: int,
    history: list[int],
    context_length: int,
) -> tuple[list[int], str | None]:
    """The round's ids up to a stop, and why it stops (None: it goes on)."""
    hit = next((i for i, t in enumerate(emitted) if t in eos_ids), None)
    if hit is not None:
        return emitted[:hit], "stop"  # the EOS id itself is not output
    if generated + len(emitted) >= max_tokens:
        return emitted, "length"
    if len(history) >= context_length:
        return emitted, "context"
    return emitted, None


def _round(
    v: _Verdict,
    emitted: list[int],
    finish: str | None,
    seconds: float,
    timing: Timing,
    opening: tuple[float, int] | None,
    logprobs: list[TokenLogprob] | None = None,
) -> Round:
    """The Round the loop yields; `opening` (the first round's): prefill seconds, cached ids;
    `logprobs`: of the round's ids before the stop (cut to the emitted ones)."""
    prefill_time, cached = opening or (0.0, 0)
    return Round(
        accepted=v.drafts[: v.n],
        rejected=v.drafts[v.n :],
        emitted=emitted,
        target_token=v.token if len(emitted) == v.n + 1 else None,
        num_draft=v.num_draft,
        rows=v.rows,
        draft_time=v.draft_time,
        verify_time=v.verify_time,
        round_time=seconds,
        plain_step_time=timing.plain_step or seconds,
        finish_reason=finish,
        prefill_time=prefill_time,
        cached_tokens=cached,
        drafter=v.drafter,
        logprobs=None if logprobs is None else logprobs[: len(emitted)],
    )
