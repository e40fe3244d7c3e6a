"""What speculation costs on this machine, measured once per loaded pair for the adaptive policy:
a plain step, a draft token, and target passes verifying 1 to 16 drafts, after a short prompt
and after a long one (the policy prices each round at its context between the two)."""

from __future__ import annotations

import time
from dataclasses import replace
from itertools import islice
from statistics import median
from typing import Protocol

import mlx.core as mx

from .caches import DraftState, PromptCache
from .drafters.base import Drafter, Proposal
from .drafters.hybrid import HybridDrafter
from .loaded import LoadedPair
from .loop import Engine, Limits, Round, Sampling, generate_rounds
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
        engine = Engine(target, drafter, _Schedule(ks), self.pair.timing, self.kept)
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


def calibrate(pair: LoadedPair, k: int = 4, long: int = 512, kept: Kept | None = None) -> Costs:
    """The costs after a short prompt, with the same measured after `long` tokens (capped by
    the pair's context) for the policy to price rounds at the current context (Costs.at).

    The long measurement is mostly its prompt's prefill (seconds on a CPU): `kept` may hold it
    from an earlier load."""
    short = measure(pair, k)
    room = min(pair.context_length, 1 << 20) - 256  # the measuring decode's own tokens
    # A sharded target keeps no prompt states, so each run would prefill the long prompt again.
    if min(long, room) < 4 * short.position or pair.group is not None:
        return short
    length = min(long, room)
    far = kept.read(length, short) if kept is not None else None
    if far is None:
        far = measure(pair, k, length=length)
        if kept is not None:
            kept.keep(length, far, short)
    return replace(short, later=far)
