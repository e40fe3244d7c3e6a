"""What speculation costs on this machine, measured once per loaded pair for the adaptive policy:
a plain step, a draft token, and target passes verifying 1 to 16 drafts, after a short prompt
and after a long one (the policy prices each round at its context between the two)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, replace
from itertools import islice
from pathlib import Path
from statistics import median
from typing import Any

import mlx.core as mx

from ..backend import cache_home
from . import hooks
from .caches import PromptCache
from .drafters import Drafter, HybridDrafter, Proposal
from .loop import Round, decode
from .policy import Costs
from .sampling import SamplingOptions
from .sharded import guard, make_target


def measure(
    pair: Any, k: int = 4, widths: tuple[int, ...] = (1, 2, 4, 8, 16), length: int = 32
) -> Costs:
    """Measure, on this machine, what a plain step, a draft token and wider verifications cost
    after a prompt of `length` ids: a short decode alternating plain steps and passes verifying
    filler ids over each of `widths` drafts (3 of each, after one warm-up cycle), and (with a
    draft model) a short fixed-K speculative decode, all over arbitrary ids."""
    # any ids: only the time is used
    ids = [(7 * i) % pair.vocab_size for i in range(1, length + 1)]
    context = min(pair.context_length, 1 << 20)
    kept = PromptCache() if pair.group is None else None

    def run(drafter: Drafter | None, ks: list[int]) -> list[Round]:
        """The first (plain) step, then one round per entry of ks (0 = plain)."""
        max_tokens = 1 + sum(n + 1 for n in ks)  # room for every round, whatever is accepted
        steps = decode(
            make_target(pair, drafter),
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
            prompt_cache=kept,
        )
        return list(islice(guard(pair, steps), len(ks) + 1))

    # The draft model's rounds first: they leave the prompt's states (its own included) in
    # `kept`, so the other runs skip the prefill (after a long prompt, most of the time).
    drafter = pair.make_drafter(False)
    draft = 0.0
    if pair.drafter_kind != "ngram":
        # The model alone (a hybrid's copies would take over once the target repeats itself);
        # the first rounds of a process run slower and are not counted.
        model = drafter.model if isinstance(drafter, HybridDrafter) else drafter
        rounds = [r for r in run(model, [k] * 6)[3:] if r.num_draft]
        draft = median(r.draft_time / r.num_draft for r in rounds) if rounds else 0.0
    # Plain steps and every width interleaved, on the target as the real drafter runs it: load
    # changes during the measurement then hit all of them alike. The first cycle warms up (the
    # first passes of a process were measured 25% slower) and is not counted.
    cycle = [0, *widths]
    rounds = run(_Filler(drafter), cycle * 4)[1 + len(cycle) :]
    plain = median(r.verify_time for r in rounds if r.num_draft == 0)
    # Plain decoding launches each step's pass before reading its id (engine/round.py): what
    # drafting must beat is a step of a run of them, not one between passes.
    ahead = median(r.verify_time for r in run(_Filler(drafter), [0] * 6)[3:])
    # A pass is priced whole: the filler's "draft time" is the verification graph's build,
    # which only a draft model's computation hides (engine.speculative_round).
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
        position=len(ids),
        measured=time.time(),
    )


class _Schedule:
    """The policy calibrate() decodes with: the given K per round, in order, then plain steps."""

    def __init__(self, ks: list[int]) -> None:
        self.ks = list(ks)
        self.max_k = max(self.ks, default=0)

    def next_k(self, label: Any = None, launched: bool = False, position: int = 0) -> int:
        return self.ks.pop(0) if self.ks else 0

    def observe(self, k: int, accepted: int) -> None:
        pass

    def expects_plain(self) -> bool:
        return bool(self.ks) and self.ks[0] == 0


class _Filler:
    """Proposes k copies of id 0 every round: verification cost alone, for calibrate()."""

    name = "filler"
    state_kind = None  # nothing of its own to keep: a prompt cache restores the target alone

    def __init__(self, drafter: Drafter) -> None:
        # The target runs as it will with the real drafter (hidden states, tapped layers).
        self.needs_hidden = drafter.needs_hidden
        self.feature_layers = getattr(drafter, "feature_layers", ())

    def start(self, prompt: list[int], hidden: Any = None, max_step: int = 1) -> None:
        pass

    def resume(
        self, state: Any, prompt: list[int], n: int, hidden: Any = None, max_step: int = 1
    ) -> None:
        pass

    def label(self) -> None:
        return None

    def propose(self, k: int, dist: Any, key: mx.array) -> Proposal:
        return Proposal(mx.zeros((k,), mx.int32), None)

    def commit(self, k: int, accepted: int, emitted: list[int], hidden: Any = None) -> None:
        pass

    def abort(self, k: int) -> None:
        pass


def calibrate(pair: Any, k: int = 4, long: int = 512) -> Costs:
    """The costs after a short prompt, with the same measured after `long` tokens (capped by
    the pair's context) for the policy to price rounds at the current context (Costs.at).

    The long measurement is mostly its prompt's prefill (seconds on a CPU), so it is kept on
    disk for this machine, pair and setup (KEEP_ENV) and measured again after KEEP_DAYS."""
    short = measure(pair, k)
    room = min(pair.context_length, 1 << 20) - 256  # the measuring decode's own tokens
    # A sharded target keeps no prompt states, so each run would prefill the long prompt again.
    if min(long, room) < 4 * short.position or pair.group is not None:
        return short
    length = min(long, room)
    path = _kept_path(pair, k, length)
    far = _read_kept(path, short)
    if far is None:
        far = measure(pair, k, length=length)
        _keep(path, far, short)
    return replace(short, later=far)


KEEP_ENV = "MACSPEC_KEEP_COSTS"  # 0: measure the long context at every load
KEEP_DAYS = 7
KEEP_SPREAD = 0.25  # how far this load's plain step may be from the kept one's


def _stamp(path: Any) -> list:
    """What identifies a model directory's weights: their names, sizes and times."""
    if path is None:
        return []
    files = sorted(Path(path).glob("*.safetensors"))
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def _kept_path(pair: Any, k: int, length: int) -> Path | None:
    if os.environ.get(KEEP_ENV, "1") == "0":
        return None
    here = Path(__file__).parent
    setup = [
        # This measurement's code and the costs' meaning: changed, measured again.
        hashlib.sha256(
            (here / "measure.py").read_bytes() + (here / "policy.py").read_bytes()
        ).hexdigest(),
        str(pair.target_path),
        _stamp(pair.target_path),
        str(pair.draft_path),
        _stamp(pair.draft_path),
        pair.drafter_kind,
        k,
        length,
        str(mx.default_device()),
        mx.__version__,
        platform.node(),
        platform.machine(),
        os.cpu_count(),
        hooks.setup(),
    ]
    key = hashlib.sha256(json.dumps(setup, default=str).encode()).hexdigest()[:16]
    return cache_home() / "costs" / f"{key}.json"


def _read_kept(path: Path | None, short: Costs) -> Costs | None:
    """The kept costs, or None: none kept, unreadable, older than KEEP_DAYS, or kept while a
    plain step cost other than now (by KEEP_SPREAD: the machine was busier, or idler)."""
    if path is None:
        return None
    try:
        kept = json.loads(path.read_text())
        if time.time() - kept["measured"] > KEEP_DAYS * 86400:
            return None
        if abs(kept["short_plain_step"] / short.plain_step - 1.0) > KEEP_SPREAD:
            return None
        c = kept["costs"]
        verify = tuple((int(n), float(t)) for n, t in c["verify"])
        fields = ("plain_step", "draft_step", "extra")
        return Costs(
            **{f: float(c[f]) for f in fields},
            verify=verify,
            position=c["position"],
            measured=kept["measured"],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _keep(path: Path | None, costs: Costs, short: Costs) -> None:
    if path is None:
        return
    data = {
        "measured": costs.measured,
        "costs": asdict(replace(costs, later=None)),
        "short_plain_step": short.plain_step,  # the state of the machine it was measured in
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)  # whole or not at all
    except OSError:
        pass  # a read-only cache: measured again next time
