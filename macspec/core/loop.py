"""The generation loop: a step generator that yields one Round per target forward pass, as plain
data (ids and seconds), until a stop. No I/O, no text.

The first token always comes from a plain step, which also measures what a plain step costs now;
with no drafter every step is plain. A policy picks each round's K (0: a plain step) or a token
tree from the drafter's label of its next proposal; round.py runs the rounds.

`rounds` is the one loop: a lone generation's (generate_rounds) and a batched row's
(batch_rounds.row_rounds, `Share`), which reads its prompt in turns and whose rounds yield their
target pass to be shared (a `Bid`, then a `Feed`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from statistics import fmean
from time import perf_counter

import mlx.core as mx

from ..base.errors import OptionError
from . import caches, memory
from .batch import can_share
from .batch_k import Bid, bid
from .caches import Hit, PromptCache
from .constraint import Constraint
from .drafters.base import Drafter
from .logprobs import TokenLogprob, token_logprobs
from .policy import Costs, Label, Policy
from .round import Feed, Step, Verdict, Verified, chain_round, tree_round
from .sampling import SamplingOptions
from .target import Target
from .tree import TreeShape, fit
from .verify import make_dist

PREFILLING = object()  # a batched row yielded after a turn of its prompt: nothing to verify yet


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
    plain_step_time: float  # plain decoding's seconds a token at this context (0: unknown)
    finish_reason: str | None  # "stop", "length", "context" or None
    prefill_time: float = 0.0  # prompt processing, reported with the first round
    rows: int = 1  # ids the target's pass verified (a chain: drafts + 1; a tree: its nodes + 1)
    cached_tokens: int = 0  # prompt ids the prompt cache held (not read again), first round
    comm_time: float = 0.0  # distributed: rank 0's seconds in messages and all-reduces
    drafter: str = ""  # the registry name of what drafted this round ("": a plain step)
    logprobs: list[TokenLogprob] | None = None  # per emitted id, when asked for (logprobs.py)


# A rounds generator yields Rounds, and a batched row's also PREFILLING, Bids and Feeds; it is
# sent None, a Bid's K to draft, or a Feed's logits and hidden states.
Yielded = Round | Bid | Feed | object
Sent = int | Verified | None


class Timing:
    """Plain decoding's seconds a token on this machine, kept across a loaded pair's
    generations: the latest plain steps that ran as plain decoding runs (their pass launched
    before the last id was read), each timed from one readout to the next, so what the caller
    did with a round is in it, as it is in every round's time. Each is kept with the context
    it read: `plain_step` carries them to another context by the pair's measured costs."""

    def __init__(self, window: int = 64) -> None:
        self.recent: deque[tuple[int, float]] = deque(maxlen=window)  # (position, seconds)

    def plain_step(self, position: int, costs: Costs | None = None) -> float | None:
        """A plain step's seconds after `position` cached ids: the mean of the latest ones, each
        grown (or shrunk) as `costs` price a step from its context to this one; with none
        observed yet, the costs' own step there; None without either. The mean, as a wall
        clock adds them: plain steps amid drafting come in pairs of short and long ones (a
        launched pass runs on while a round is read), whose median is neither."""
        if not self.recent:
            return costs.plain_at(position) if costs is not None else None
        if costs is None:
            return fmean(s for _, s in self.recent)
        here = costs.plain_at(position)
        return fmean(s * here / costs.plain_at(p) for p, s in self.recent)

    def observe_plain_step(self, seconds: float, position: int) -> None:
        self.recent.append((position, seconds))


@dataclass(frozen=True)
class Engine:
    """What runs a generation's rounds: the target, the drafter (None: plain decoding), the
    policy choosing each round's drafts, the plain steps' timing kept across generations, and
    the prompt cache (None: none)."""

    target: Target
    drafter: Drafter | None
    policy: Policy
    timing: Timing
    prompt_cache: PromptCache | None = None
    # Told (ids read, ids to read, ids of them the prompt cache held) as a long prompt is read:
    # a chat says how far it is, a server streams it (llama.cpp's prompt_progress).
    progress: Callable[[int, int, int], None] | None = None
    costs: Costs | None = None  # the pair's measured costs: a plain step at another context


@dataclass(frozen=True)
class Sampling:
    """How a generation samples: its options and random key; `constraint` masks p and q alike
    (trees: the walk follows masked rows only); `logprobs`: each emitted id's log probability
    and its `logprobs` most likely (chains and plain steps)."""

    options: SamplingOptions
    key: mx.array
    constraint: Constraint | None = None
    logprobs: int | None = None


@dataclass(frozen=True)
class Limits:
    """Where a generation stops: after max_tokens ids, at an end-of-text id (not output), or
    when the context is full."""

    max_tokens: int
    eos_ids: frozenset[int]
    context_length: int


@dataclass(frozen=True)
class Share:
    """A batched row's rounds (batch_rounds.py): its prompt read `chunk` ids a turn, and
    `company()`: the rows in this round (1 = alone: its round is then generate_rounds' own)."""

    chunk: int
    company: Callable[[], int]


def generate_rounds(
    engine: Engine, prompt: list[int], sampling: Sampling, limits: Limits
) -> Iterator[Round]:
    """Yield one Round per target pass until a stop ("stop", "length", "context"); the prompt
    cache, if any: start from kept states, keep the final ones."""
    with memory.wired_limit(engine.target.model):
        yield from rounds(engine, prompt, sampling, limits)


def rounds(
    engine: Engine,
    prompt: list[int],
    sampling: Sampling,
    limits: Limits,
    share: Share | None = None,
) -> Generator[Yielded, Sent, None]:
    """generate_rounds' Rounds; with `share` (a batched row) also PREFILLING after each turn
    of its prompt, a Bid (send back the K to draft) and a Feed (send back its logits and
    hidden states) where its round shares the target's pass."""
    e, key = engine, sampling.key
    history, max_step = list(prompt), _max_step(e)
    if share is not None:
        turns = _Turns(share.chunk, pausing=True)
    else:
        turns = _Turns(READ_CHUNK if e.progress is not None else None)
    kept, prefill_time = yield from _start(e, prompt, max_step, turns)
    opening = (prefill_time, kept.length if kept else 0)  # reported with the first round
    generated, steady = 0, True  # steady: the states hold `history` (less its last id)
    ready, clearing = perf_counter(), memory.CacheClearing()  # ready: the latest ids read
    try:
        while True:
            room = min(limits.max_tokens - generated, limits.context_length - len(history))
            k = _next_k(e, generated, room)
            key, subkey = mx.random.split(key)
            dist = make_dist(sampling.options, history, sampling.constraint)
            seen: list | None = [] if sampling.logprobs is not None else None  # target rows
            steady = False
            shared = share is not None and _shares(e.target, k, share)
            alone = share is None or share.company() == 1  # (may launch the next pass)
            # A round alone is timed from the last readout, as a plain step run ahead must be
            # (its pass began before): what the caller did in between counts alike for both.
            t0 = ready if alone and not shared else perf_counter()
            launch = alone and e.target.takes_lazy_ids and room > 1  # a plain step's next pass
            step = Step(history[-1], k, dist, subkey, t0, launch, seen)
            v = yield from _verify(e, step, shared)
            ready = perf_counter()
            ids, lps = _emit(v, room, history, sampling, seen)
            emitted, finish = _stop(ids, limits, generated, len(history))
            if sampling.constraint is not None:
                sampling.constraint.commit(emitted)  # always allowed: drawn from masked rows
            steady = True
            plain = e.timing.plain_step(len(history) - len(ids) - 1, e.costs)
            r = _round(v, emitted, finish, ready - t0, plain or 0.0)
            if not generated:
                r.prefill_time, r.cached_tokens = opening
            r.logprobs = None if lps is None else lps[: len(emitted)]
            generated += len(emitted)
            clearing.after(generated)
            yield r
            if finish:
                return
    finally:
        if steady:  # a pass launched past the end is never read; the states may be kept
            _close(e, history)


def _shares(target: Target, k: int | TreeShape, share: Share) -> bool:
    """Whether a batched row's round goes into the shared pass: a chain or a plain step, of a
    target whose layers can share, with company (a token tree runs alone)."""
    return not isinstance(k, TreeShape) and can_share(target) and share.company() != 1


def _verify(e: Engine, step: Step, shared: bool) -> Generator[Bid | Feed, Sent, Verdict]:
    """One round: a token tree, a chain of k drafts, or a plain step (k = 0) that may launch
    the next pass when the policy expects the next round to be plain too. `shared`: its K is
    bid first (the driver sends back the K it drafts, batch_k.py), then its pass is yielded;
    a round alone is timed for the policy (a shared round's time is not the row's own)."""
    if isinstance(step.k, TreeShape):
        if step.seen is not None:
            raise OptionError("log probabilities are reported for chains and plain steps only")
        tree, path, v = tree_round(e.target, e.drafter, step)
        e.policy.observe_tree(tree, path, perf_counter() - step.t0)
    elif shared:
        e.target.drop_launch()  # a pass launched while it was alone: not shared
        label = e.drafter.label() if e.drafter is not None and step.k else None
        step = replace(step, k=(yield bid(e.policy, label, step.k, e.target.offset)))
        v = yield from chain_round(e.target, e.drafter, step, shared=True)
    else:
        ahead = step.launch and (e.drafter is None or e.policy.expects_plain())
        # A step whose pass the last one launched runs as plain decoding does: its pace.
        running, position = e.target.ahead is not None, e.target.offset
        v = yield from chain_round(e.target, e.drafter, replace(step, launch=ahead))
        if not step.k and running:
            e.timing.observe_plain_step(v.verify_time, position)
    if not isinstance(step.k, TreeShape) and step.k:
        e.policy.observe(len(v.drafts), v.n)
    if not shared:  # less the drafter's catch-up after plain steps (the stretch before it)
        seconds = perf_counter() - step.t0
        caught_up = e.drafter.take_catch_up() if e.drafter is not None else 0.0
        e.policy.observe_time(step.k, v.n + 1, max(0.0, seconds - caught_up))
    return v


def _emit(
    v: Verdict, room: int, history: list[int], sampling: Sampling, seen: list | None
) -> tuple[list[int], list[TokenLogprob] | None]:
    """The round's ids (at most `room`; `history` takes them all, as the states hold them) and
    their log probabilities when asked for."""
    ids = (v.drafts[: v.n] + [v.token])[:room]
    lps = _logprobs(seen, ids, sampling, history)
    history += ids
    return ids, lps


def _close(e: Engine, history: list[int]) -> None:
    """Finished, or closed between rounds: drop a pass launched past the end, and keep the
    states for the next prompt."""
    e.target.drop_launch()
    if e.prompt_cache is not None:
        e.prompt_cache.save(history, e.target.cache, e.drafter)


def _max_step(e: Engine) -> int:
    """The widest pass a round may take back (one more: a launched pass, if the round fails)."""
    max_step = e.policy.max_k + 1 + e.target.takes_lazy_ids
    if e.prompt_cache is not None:
        max_step = max(max_step, e.prompt_cache.min_step)  # window rings that rewind further
    return max_step


# A generation whose reading is reported (Engine.progress) reads its target's prompt in turns of
# this many ids from the same first id, each turn in hooks.prefill_chunk's chunks (which divide
# it): the chunks, and so the bits, of a reading at once.
READ_CHUNK = 512


class _Turns:
    """A prompt read in turns of `chunk` ids (None or 0: at once); `pausing` (a batched row):
    PREFILLING yielded between them (a long prompt never stalls a batch's other rows by more
    than a turn); `seconds`: the time spent reading, less the time between turns."""

    def __init__(self, chunk: int | None, pausing: bool = False) -> None:
        self.chunk, self.pausing, self.spent, self.t0 = chunk or None, pausing, 0.0, perf_counter()

    def stops(self, done: int, end: int) -> list[int]:
        """Where each turn ends, reading from `done` to `end`."""
        return [end] if self.chunk is None else [*range(done + self.chunk, end, self.chunk), end]

    def pause(self, arrays: list) -> Generator[object, Sent, None]:
        if not self.pausing:
            return
        mx.eval(arrays)
        self.spent += perf_counter() - self.t0
        yield PREFILLING
        self.t0 = perf_counter()

    @property
    def seconds(self) -> float:
        return self.spent + perf_counter() - self.t0


def _start(
    e: Engine, prompt: list[int], max_step: int, turns: _Turns
) -> Generator[object, Sent, tuple[Hit | None, float]]:
    """Bring the target and the drafter to the prompt: from kept states where the prompt cache
    has some, else by reading it (in turns: _Turns). Returns the kept states used and the
    seconds taken."""
    cache = e.prompt_cache
    kept = cache.restore(prompt, e.drafter, max_step) if cache is not None else None
    yield from _read_target(e.target, prompt, max_step, kept, turns, e.progress)
    if e.drafter is not None:
        yield from _read_draft(e, prompt, max_step, kept, turns)
    if e.prompt_cache is not None and e.prompt_cache.wants_checkpoint(e.target.cache):
        e.prompt_cache.save(prompt, e.target.cache, e.drafter)
    return kept, turns.seconds


def _read_target(
    target: Target,
    prompt: list[int],
    max_step: int,
    kept: Hit | None,
    turns: _Turns,
    progress: Callable[[int, int, int], None] | None = None,
) -> Generator[object, Sent, None]:
    """The target reads all but the prompt's last id (after the kept ones), a turn at a time
    (each evaluated as it is read: caches.prefill), `progress` told after each; a drafter
    that reads hidden states gets them for every id read, in order."""
    cache = kept.target if kept is not None else None
    end = len(prompt) - 1  # the target holds all but the last id
    done = caches.length(cache) if cache is not None else 0  # ids the prompt cache held
    hidden = []
    for stop in turns.stops(done, end):
        target.start(prompt[: stop + 1], max_step, cache)  # reads prompt[done:stop]
        cache = target.cache
        if target.hidden is not None:
            hidden.append(target.hidden)
        if progress is not None:
            progress(stop, end, done)
        if stop < end:
            yield from turns.pause(caches.state_arrays(cache))
    if target.keep_hidden and len(hidden) != 1:  # (one turn: its own already)
        target.hidden = mx.concatenate(hidden) if hidden else None


def _read_draft(
    e: Engine, prompt: list[int], max_step: int, kept: Hit | None, turns: _Turns
) -> Generator[object, Sent, None]:
    """The drafter's start: from its kept state, or afresh. A draft model (state kind "model",
    alone or in a hybrid) resumes from its own state (DraftState.catches_up), so it may read
    the prompt in turns too; EAGLE and MTP read the target's hidden states."""
    drafter = e.drafter
    state, n = (kept.draft, kept.draft_length) if kept is not None else (None, 0)
    # (A generation alone leaves a draft model's reading to its first proposal: start().)
    if state is None and turns.pausing and drafter.state_kind == "model":
        end = len(prompt) - 1
        for stop in turns.stops(0, end):
            drafter.resume(state, prompt[: stop + 1], n, None, max_step)
            state, n = drafter.snapshot(), stop
            if stop < end:
                yield from turns.pause(caches.state_arrays(state.cache))
    elif kept is not None:
        drafter.resume(kept.draft, prompt, kept.draft_length, e.target.hidden, max_step)
    else:
        drafter.start(prompt, e.target.hidden, max_step)


def _next_k(e: Engine, generated: int, room: int) -> int | TreeShape:
    """The next round's drafts: none for the first token or without a drafter, else the
    policy's, never past max_tokens or the context (a round emits at most k + 1 ids), nor
    wider than the backend computes each row alike to a pass of its own (Target.widest)."""
    target = e.target
    if e.drafter is None or generated == 0:
        return 0
    launched = target.ahead is not None
    label = _label(e.policy, e.drafter, launched, target.offset)
    k = e.policy.next_k(label, launched, target.offset)
    # No wider pass than gives every row a plain step's bits (else a near-tie may go otherwise).
    widest = target.widest
    room = room if widest is None else min(room, widest)
    return fit(k, room - 1, widest) if isinstance(k, TreeShape) else min(k, room - 1)


def _label(policy: Policy, drafter: Drafter, launched: bool, position: int) -> Label:
    """The label of the drafter's next proposal: where it offers several (a hybrid's short
    match: its model or a copy), the policy's pick, which the drafter then drafts (from the
    context and past rounds only: exact)."""
    labels = drafter.labels()
    label = labels[0] if len(labels) == 1 else policy.pick(labels, launched, position)
    drafter.choose(label)
    return label


def _logprobs(
    seen: list | None, emitted: list[int], sampling: Sampling, history: list[int]
) -> list[TokenLogprob] | None:
    """The emitted ids' log probabilities from the rows of the target's pass (row i: the
    distribution emitted[i] was drawn from), before the round is committed. Greedy sampling's
    rows are one-hot: then the model's own distribution at temperature 1 (the penalty and the
    mask applied, no filters), as OpenAI reports logprobs at temperature 0."""
    if seen is None or sampling.logprobs is None:
        return None
    logits, drafts, p = seen[-1]
    opts = sampling.options
    if opts.greedy:
        own = SamplingOptions(
            1.0,
            repetition_penalty=opts.repetition_penalty,
            repetition_context=opts.repetition_context,
        )
        p = make_dist(own, history, sampling.constraint).probs(logits[: len(emitted)], drafts, 0)
    return token_logprobs(p, emitted, sampling.logprobs)


def _stop(
    emitted: list[int], limits: Limits, generated: int, held: int
) -> tuple[list[int], str | None]:
    """The round's ids up to a stop, and why it stops (None: it goes on); `held`: the ids the
    context holds with them."""
    hit = next((i for i, t in enumerate(emitted) if t in limits.eos_ids), None)
    if hit is not None:
        return emitted[:hit], "stop"  # the EOS id itself is not output
    if generated + len(emitted) >= limits.max_tokens:
        return emitted, "length"
    if held >= limits.context_length:
        return emitted, "context"
    return emitted, None


def _round(
    v: Verdict, emitted: list[int], finish: str | None, seconds: float, plain: float
) -> Round:
    """The Round the loop yields (the first round's prefill and cached ids, and the log
    probabilities, are filled in by the loop)."""
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
        plain_step_time=plain,
        finish_reason=finish,
        drafter=v.drafter,
    )
