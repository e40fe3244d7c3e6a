"""What speculation costs on this machine, measured once per loaded pair for the adaptive policy:
a plain step, a draft token, and target passes verifying 1 to 16 drafts, after a short prompt
and what each grows by after a long one (the policy prices each round at its context, linearly
between the two and past the long one)."""

from __future__ import annotations

import time
from dataclasses import replace
from itertools import islice
from statistics import median
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from . import caches
from .caches import DraftState, PromptCache
from .drafters.base import Drafter, Proposal
from .drafters.hybrid import HybridDrafter
from .loaded import LoadedPair
from .loop import Engine, Limits, Round, Sampling, Timing, generate_rounds
from .policy import Costs, Label, Policy
from .sampling import Distribution, SamplingOptions
from .sharded import guard, make_target


def measure(
    pair: LoadedPair, k: int = 4, widths: tuple[int, ...] = (1, 2, 4, 8, 16), length: int = 32
) -> Costs:
    """Measure, on this machine, what a plain step, a draft token and wider verifications cost
    after a prompt of `length` ids: a short decode alternating plain steps and passes verifying
    filler ids over each of `widths` drafts (3 of each, after one warm-up cycle), and (with a
    draft model) a short fixed-K speculative decode, all over arbitrary ids."""
    runs = _Runs(pair, [(7 * i) % pair.vocab_size for i in range(1, length + 1)], k)
    drafter = pair.make_drafter(False)
    draft = _draft_step(runs, drafter, k) if pair.drafter_kind != "ngram" else 0.0
    # Plain steps and every width interleaved, on the target as the real drafter runs it: load
    # changes during the measurement then hit all of them alike. The first cycle warms up (the
    # first passes of a process were measured 25% slower) and is not counted.
    cycle = [0, *widths]
    rounds = runs(_Filler(drafter), cycle * 4)[1 + len(cycle) :]
    plain = median(r.verify_time for r in rounds if r.num_draft == 0)
    # Plain decoding launches each step's pass before reading its id (Target.launch): what
    # drafting must beat is a step of a run of them, not one between passes.
    ahead = median(r.verify_time for r in runs(_Filler(drafter), [0] * 6)[3:])
    # A pass is priced whole: the filler's "draft time" is the verification graph's build,
    # which only a draft model's computation hides (round.chain_round).
    passes = tuple(
        (n, median(r.draft_time + r.verify_time for r in rounds if r.num_draft == n))
        for n in widths
        if any(r.num_draft == n for r in rounds)  # a tiny context may cut the widest ones
    )
    at_k = dict(passes).get(k)
    extra = max(0.0, at_k - plain) / k if at_k is not None else 0.0
    return Costs(
        plain_step=min(plain, ahead),
        draft_step=draft,
        extra=extra,
        verify=passes,
        position=len(runs.ids),
        measured=time.time(),
    )


class _Runs:
    """Short decodes over `ids` (any ids: only the time is used), sharing one prompt cache: the
    first one leaves the prompt's states (the drafter's included) for the others to skip the
    prefill (after a long prompt, most of the time)."""

    def __init__(self, pair: LoadedPair, ids: list[int], k: int) -> None:
        self.pair, self.ids, self.k = pair, ids, k
        self.context = min(pair.context_length, 1 << 20)
        self.kept = PromptCache() if pair.group is None else None

    def __call__(self, drafter: Drafter | None, ks: list[int]) -> list[Round]:
        """The first (plain) step, then one round per entry of ks (0 = plain)."""
        max_tokens = 1 + sum(n + 1 for n in ks)  # room for every round, whatever is accepted
        target = make_target(self.pair, drafter)
        # Timed apart from the pair's Timing: plain decoding's pace is what its real steps show.
        engine = Engine(target, drafter, _Schedule(ks), Timing(), self.kept)
        prompt = self.ids[: max(2, min(len(self.ids), self.context - max_tokens - 1))]
        limits = Limits(max_tokens, frozenset(), self.context)
        steps = generate_rounds(
            engine, prompt, Sampling(SamplingOptions(), mx.random.key(0)), limits
        )
        return list(islice(guard(self.pair, steps), len(ks) + 1))


def _draft_step(runs: _Runs, drafter: Drafter, k: int) -> float:
    """Seconds of one draft token of the draft model alone (a hybrid's copies would take over
    once the target repeats itself), from fixed-K rounds after the first few (the first rounds
    of a process run slower). Run first: it leaves the prompt's states for the other runs."""
    model = drafter.model if isinstance(drafter, HybridDrafter) else drafter
    rounds = [r for r in runs(model, [k] * 6)[3:] if r.num_draft]
    return median(r.draft_time / r.num_draft for r in rounds) if rounds else 0.0


class _Schedule(Policy):
    """The policy calibrate() decodes with: the given K per round, in order, then plain steps."""

    def __init__(self, ks: list[int]) -> None:
        self.ks = list(ks)
        self.max_k = max(self.ks, default=0)

    def next_k(self, label: Label = None, launched: bool = False, position: int = 0) -> int:
        return self.ks.pop(0) if self.ks else 0

    def observe(self, k: int, accepted: int) -> None:
        pass

    def observe_time(self, k: int, tokens: int, seconds: float) -> None:
        pass

    def expects_plain(self) -> bool:
        return bool(self.ks) and self.ks[0] == 0


class _Filler(Drafter):
    """Proposes k copies of id 0 every round: verification cost alone, for calibrate()."""

    name = "filler"
    summary = "copies of id 0: the verification cost alone"
    state_kind = None  # nothing of its own to keep: a prompt cache restores the target alone

    def __init__(self, drafter: Drafter) -> None:
        # The target runs as it will with the real drafter (hidden states, tapped layers).
        self.needs_hidden = drafter.needs_hidden
        self.feature_layers = drafter.feature_layers

    def start(self, prompt: list[int], hidden: mx.array | None = None, max_step: int = 1) -> None:
        pass

    def resume(
        self,
        state: DraftState | None,
        prompt: list[int],
        n: int,
        hidden: mx.array | None = None,
        max_step: int = 1,
    ) -> None:
        pass

    def label(self) -> None:
        return None

    def propose(self, k: int, dist: Distribution, key: mx.array) -> Proposal:
        return Proposal(mx.zeros((k,), mx.int32), None)

    def commit(
        self, k: int, accepted: int, emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        pass

    def abort(self, k: int) -> None:
        pass


class Kept(Protocol):
    """Costs measured after a long context by an earlier load, kept somewhere (kept_costs.py)."""

    def read(self, length: int, short: Costs) -> Costs | None:
        """The kept costs after `length` tokens, if still good for a load whose short-context
        costs are `short`."""

    def keep(self, length: int, costs: Costs, short: Costs) -> None:
        """Keep `costs`, measured after `length` tokens, with the short ones of the same load."""


# The context the long costs are priced at. Every pass and draft token reads all cached
# positions, so costs grow with the context; at 512 ids that growth was within a step's noise,
# and extrapolated to long prompts it mispriced wide passes (docs/drafting.md).
FAR = 4096
PREFILL_LONG = 512  # the long prompt read where caches cannot be padded (windows, recurrent)


def calibrate(pair: LoadedPair, k: int = 4, long: int = FAR, kept: Kept | None = None) -> Costs:
    """The costs after a short prompt, with the same after `long` tokens (capped by the pair's
    context) for the policy to price rounds at the current context (Costs.at): the short ones
    plus what each pass grows by on caches padded to `long` (`grown`, no prompt read), or,
    where caches cannot be padded, measured after a prompt of PREFILL_LONG ids.

    `kept` may hold the long costs from an earlier load."""
    short = measure(pair, k)
    room = min(pair.context_length, 1 << 20) - 256  # the measuring decode's own tokens
    # A sharded target keeps no prompt states, so each run would prefill the long prompt again.
    if min(long, room) < 4 * short.position or pair.group is not None:
        return short
    length = min(long, room)
    far = kept.read(length, short) if kept is not None else None
    if far is None:
        far = grown(pair, short, length, k)
        if far is None:
            far = measure(pair, k, length=min(length, PREFILL_LONG))
        if kept is not None:
            kept.keep(length, far, short)
    return replace(short, later=far)


def grown(pair: LoadedPair, short: Costs, length: int, k: int = 4) -> Costs | None:
    """`short` after `length` cached tokens: each pass (a plain step, and the verification of
    each measured width) longer by what the target's pass of as many rows grows by from a
    short cache to one of `length` positions (`growth`), the draft token by what the draft
    model's grows by where it reads the whole prompt (else it reads a window: unchanged; a
    feature draft's one layer is left out), `extra` as measure's over k drafts. None where
    the target's caches cannot be padded."""
    ids = [(7 * i) % pair.vocab_size for i in range(1, short.position + 1)]
    widths = (1, *(1 + n for n, _ in short.verify))
    more = growth(pair.target, widths, length, ids)
    if more is None:
        return None
    draft = 0.0
    if pair.draft is not None and pair.draft_context == 0:
        grew = growth(pair.draft, (1,), length, ids)
        draft = grew[1] if grew is not None else 0.0
    extra = short.extra  # as measure's: the k-draft pass beyond a plain step, over k
    if k in dict(short.verify):
        extra += max(0.0, more[k + 1] - more[1]) / k
    return Costs(
        plain_step=short.plain_step + more[1],
        draft_step=short.draft_step + draft,
        extra=extra,
        verify=tuple((n, t + more[n + 1]) for n, t in short.verify),
        position=length,
        measured=time.time(),
    )


def growth(
    model: nn.Module, widths: tuple[int, ...], length: int, ids: list[int], reps: int = 3
) -> dict[int, float] | None:
    """Seconds a pass of each width (rows) takes more after `length` cached positions than
    after `ids`: the same passes on a cache holding `ids` and on one holding them padded with
    zero keys and values to `length`, taking turns (a pass's time depends on how many
    positions it reads, not on what they hold), so no long prompt is read. None where a layer's
    cache is not mlx-lm's KVCache (a window's or a recurrent state's growth is not this)."""
    near, far = (caches.make_cache(model, max(widths)) for _ in range(2))
    if not all(type(c) is KVCache for cache in (near, far) for _, c in caches.layers(cache)):
        return None
    for cache in (near, far):
        caches.prefill(model, cache, ids)
    for _, c in caches.layers(far):
        keys, values = c.keys, c.values  # (1, kv heads, room, head dim)
        pad = length - c.offset
        c.update_and_fetch(
            mx.zeros((*keys.shape[:2], pad, keys.shape[3]), keys.dtype),
            mx.zeros((*values.shape[:2], pad, values.shape[3]), values.dtype),
        )
    mx.eval(caches.state_arrays(far))
    seconds = {(w, c): [] for w in widths for c in (0, 1)}
    for rep in range(reps + 1):  # the first cycle warms up
        for w in widths:
            for c, cache in enumerate((near, far)):
                t = _pass_time(model, cache, w)
                if rep:
                    seconds[w, c].append(t)
    return {w: max(0.0, median(seconds[w, 1]) - median(seconds[w, 0])) for w in widths}


def _pass_time(model: nn.Module, cache: list, width: int) -> float:
    """Seconds of one pass of `width` ids over `cache`, which is then rewound."""
    start = caches.length(cache)
    t = time.perf_counter()
    with caches.forward(cache, width, rewindable=True):
        mx.eval(model(mx.array([[1] * width]), cache=cache))
    seconds = time.perf_counter() - t
    caches.rewind(cache, start)
    return seconds
