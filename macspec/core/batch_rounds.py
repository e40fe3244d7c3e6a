"""Several generations' rounds with one target pass between them (batch.py's shared pass).

`row_rounds` is `generate_rounds` (loop.py) for one generation of a batch: the same rounds, the
same random keys split the same way, the same rewinds, so each answer is what it is alone. It
is a generator the driver runs: it yields `PREFILLING` after each chunk of its prompt (a long
prompt never stalls the other rows by more than a chunk), a `Bid` when its round can share (its
policy's K; the driver sends back the K it drafts), a `Feed` when its round needs the target's
logits (sent back by the driver), and a `Round` when a round is done. A round it
cannot share (a token tree, a target whose layers cannot share) it runs alone, as loop.py does.

`BatchDriver.round` runs one round of every row: the rows' K are chosen for the batch
(batch_k.py), each drafts alone, then one target pass verifies every row's drafts, then each
accepts with its own key and rewinds its own cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import CacheError, OptionError
from . import caches, hooks, memory
from .batch import can_share, shared_pass
from .batch_k import Bid, PassPrices, bid, choose_ks
from .caches import Hit, PromptCache
from .constraint import Constraint
from .drafters.base import Distribution, Drafter
from .loop import (
    Round,
    Timing,
    _close,
    _emit,
    _max_step,
    _next_k,
    _observed_round,
    _round,
    _Verdict,
)
from .policy import FixedK, Policy
from .sampling import SamplingOptions, sample
from .target import Target
from .tree import TreeShape
from .verify import accept, make_dist, one_hot

# Prompt ids prefilled between two rounds of the other rows: a new client's prompt is read in
# chunks, so the clients already answering wait at most one chunk's pass (docs/server.md, batching).
PREFILL_CHUNK = 256

PREFILLING = object()  # a row yielded after a chunk of its prompt: nothing to verify yet


@dataclass
class Feed:
    """A row's ids for the shared pass: `tokens` (w,) fed after the ids `cache` holds;
    `hidden`: the row's target keeps the pass's hidden states (a drafter reads them)."""

    cache: list
    tokens: mx.array
    hidden: bool = False


def row_rounds(
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
    chunk: int = PREFILL_CHUNK,
    company: Callable[[], int] = lambda: 2,
) -> Generator[Any, Any, None]:
    """generate_rounds' rounds for one row of a batch (its arguments, and `chunk`: prompt ids
    prefilled per turn; `company`: the rows in this round, 1 = alone, when its round is
    generate_rounds' own); yields PREFILLING, Bid (send back the K to draft, at most its
    own), Feed (send back its logits and hidden states) or Round. No constraint masks or
    logprobs here: those generations run alone."""
    if constraint is not None or logprobs is not None:
        raise OptionError("a batched row takes no constraint or logprobs: run it alone")
    policy = policy or FixedK(num_draft)
    history, max_step = list(prompt), _max_step(policy, target, prompt_cache)
    kept, prefill_time = yield from _start(target, drafter, prompt, max_step, prompt_cache, chunk)
    opening = (prefill_time, kept.length if kept else 0)
    generated, steady, clearing, ready = 0, True, memory.CacheClearing(), perf_counter()
    try:
        while True:
            room = min(max_tokens - generated, context_length - len(history))
            k = _next_k(policy, drafter, target, generated, room)
            key, subkey = mx.random.split(key)
            dist = make_dist(opts, history)
            steady = False
            if isinstance(k, TreeShape) or not can_share(target) or company() == 1:
                t0 = ready if target.ahead is not None else perf_counter()
                launch = target.takes_lazy_ids and room > 1 and company() == 1
                alone = (target, drafter, policy, timing, history[-1], k, dist, subkey, t0, launch)
                v = _observed_round(*alone)  # as generate_rounds' (may launch the next pass)
            else:
                target.drop_launch()  # a pass launched while it was alone: not shared
                t0 = perf_counter()
                v = yield from _shared_round(target, drafter, policy, history[-1], k, dist, subkey)
            ready = perf_counter()
            limits = (eos_ids, generated, max_tokens, context_length)
            emitted, finish, _ = _emit(v, room, history, limits, None, opts, None, None)
            steady = True
            r = _round(v, emitted, finish, ready - t0, timing, opening if not generated else None)
            generated += len(emitted)
            clearing.after(generated)
            yield r
            if finish:
                return
    finally:
        if steady:
            _close(target, drafter, history, prompt_cache)


def _start(
    target: Target,
    drafter: Drafter | None,
    prompt: list[int],
    max_step: int,
    prompt_cache: PromptCache | None,
    chunk: int,
) -> Generator[Any, Any, tuple[Hit | None, float]]:
    """loop._start with the target's prefill in chunks of `chunk` ids, then a draft model's,
    yielding PREFILLING between them. Returns the kept states used and the seconds this row
    spent."""
    spent, t0 = 0.0, perf_counter()
    kept = prompt_cache.restore(prompt, drafter, max_step) if prompt_cache is not None else None
    cache = kept.target if kept is not None else None
    end = len(prompt) - 1  # the target holds all but the last id
    done = caches.length(cache) if cache is not None else 0
    hidden = []  # a drafter that reads hidden states gets them for every id read, in order
    for stop in [*range(done + chunk, end, chunk), end]:
        target.start(prompt[: stop + 1], max_step, cache)  # reads prompt[done:stop]
        cache = target.cache
        if target.hidden is not None:
            hidden.append(target.hidden)
        if stop < end:
            mx.eval(caches.state_arrays(cache))
            spent += perf_counter() - t0
            yield PREFILLING
            t0 = perf_counter()
    if target.keep_hidden:
        target.hidden = mx.concatenate(hidden) if hidden else None
    if drafter is not None:
        state, n = (kept.draft, kept.draft_length) if kept is not None else (None, 0)
        if state is None and _reads_alone(drafter):  # a draft model: its prompt in chunks too
            for stop in [*range(chunk, end, chunk), end]:
                drafter.resume(state, prompt[: stop + 1], n, None, max_step)
                state, n = drafter.snapshot(), stop
                if stop < end:
                    mx.eval(caches.state_arrays(state.cache))
                    spent += perf_counter() - t0
                    yield PREFILLING
                    t0 = perf_counter()
        elif kept is not None:
            drafter.resume(kept.draft, prompt, kept.draft_length, target.hidden, max_step)
        else:
            drafter.start(prompt, target.hidden, max_step)
    if prompt_cache is not None and prompt_cache.wants_checkpoint(target.cache):
        prompt_cache.save(prompt, target.cache, drafter)
    return kept, spent + perf_counter() - t0


def _reads_alone(drafter: Drafter) -> bool:
    """Whether the drafter reads the prompt from the ids alone: a draft model (its state kind
    "model", alone or in a hybrid), which resumes from its own state (DraftState.catches_up),
    so that it can take the prompt in chunks; EAGLE and MTP read the target's hidden states."""
    return getattr(drafter, "state_kind", None) == "model"


def _shared_round(
    target: Target,
    drafter: Drafter | None,
    policy: Policy,
    last: int,
    k: int,
    dist: Distribution,
    key: mx.array,
) -> Generator[Bid | Feed, Any, _Verdict]:
    """verify.speculative_round (k > 0) or verify.plain_step (k == 0) with the target's pass
    shared: the same keys, acceptance and rewinds (the target keeps `last` and the n accepted
    drafts; a round that fails keeps nothing). Its policy's k is bid first: it drafts the k the
    driver sends back (batch_k.py), never more."""
    label = drafter.label() if drafter is not None and k else None
    k = yield bid(policy, label, k, target.offset)
    start, done, n, drafts, proposed = target.offset, False, 0, [], 0
    draft_key, accept_key = mx.random.split(key) if k else (None, key)
    try:
        t0 = perf_counter()
        tokens = None
        if k:
            proposal = drafter.propose(k, dist, draft_key)
            mx.async_eval(proposal.tokens)
            tokens, proposed = proposal.tokens, proposal.tokens.size
        fed = mx.array([last]) if tokens is None else mx.concatenate([mx.array([last]), tokens])
        t1 = perf_counter()  # drafted (lazily: the ids may still compute within the pass)
        logits, target.hidden = yield Feed(target.cache, fed, target.keep_hidden)
        if tokens is None:  # a plain step: the target samples alone, as plain_step
            token = sample(dist.probs(logits, None, 0), accept_key).item()
        else:
            p = dist.probs(logits, tokens, 0)
            q = proposal.probs if proposal.probs is not None else one_hot(tokens, p.shape[1])
            n_arr, token_arr = accept(p, q, tokens, accept_key)
            mx.eval(n_arr, token_arr)
            drafts, n, token = tokens.tolist(), n_arr.item(), token_arr.item()
        done = True
    finally:
        target.trim_to(start + 1 + n if done else start)  # the padding and rejected drafts go
        if drafter is not None and done:
            kept = target.hidden[: n + 1] if target.hidden is not None else None
            drafter.commit(proposed, n, drafts[:n] + [token], kept)
        elif drafter is not None and k:
            drafter.abort(proposed)
    if k:
        policy.observe(len(drafts), n)
    rows = len(drafts) + 1 if drafts else 1
    return _Verdict(drafts, n, token, t1 - t0, perf_counter() - t1, len(drafts), rows)


class Row:
    """One generation of a batch: its rounds generator, and the Rounds made for it, read (as an
    iterator of Rounds, like generate_rounds) by its GenerationStream."""

    def __init__(self, rounds: Generator) -> None:
        self.rounds = rounds
        self.ready: deque[Round] = deque()

    def __iter__(self) -> Iterator[Round]:
        return self

    def __next__(self) -> Round:
        if not self.ready:
            raise CacheError("a batched generation was read before its round was run")
        return self.ready.popleft()

    def close(self) -> None:
        self.rounds.close()  # its caches rewound and its states kept, as generate_rounds'


class BatchDriver:
    """One round of several rows at a time, their target passes shared; `choose`: the rows'
    K chosen for the batch (batch_k.choose_ks), else each row drafts its own policy's K."""

    def __init__(self, model: nn.Module, vocab_size: int, choose: bool = True) -> None:
        self.model, self.vocab_size, self.choose = model, vocab_size, choose
        self.passes = self.shared_rows = 0  # shared passes run, and the rows they verified
        self.drafts = 0  # drafts the shared passes' rows proposed
        self.prices = PassPrices()
        self.company = 0  # rows in the round being run (row_rounds' `company`)
        self.max_ids = hooks.alike_rows(model)  # ids a pass may hold, rows alike to alone
        self._wired: ExitStack | None = None  # mlx-lm's wired limit, held while rows run

    def round(self, rows: list[Row]) -> list[tuple[Row, Round | Exception | None]]:
        """Each row's next round: its Round appended to `row.ready` (also returned), None for a
        row still reading its prompt, or the exception that ended it. The model's memory stays
        wired (Metal) from the first round until every row has ended (or `release`)."""
        if self._wired is None:
            self._wired = ExitStack()
            self._wired.enter_context(memory.wired_limit(self.model))
        out = self._round(rows)
        if all(isinstance(got, Exception) for got in out.values()):
            self.release()
        return [(row, out[i]) for i, row in enumerate(rows)]

    def release(self) -> None:
        """Unwire the model's memory (the rows ended or were dropped); the next round wires it."""
        if self._wired is not None:
            wired, self._wired = self._wired, None
            wired.close()

    def _round(self, rows: list[Row]) -> dict[int, Any]:
        self.company = len(rows)
        out: dict[int, Any] = {i: _advance(row, None) for i, row in enumerate(rows)}
        bids = [(i, got) for i, got in out.items() if isinstance(got, Bid)]
        ks = self.ks([b for _, b in bids])
        for (i, _), k in zip(bids, ks, strict=True):
            out[i] = _advance(rows[i], k)  # the row drafts k: its Feed
        feeds = [(i, got) for i, got in out.items() if isinstance(got, Feed)]
        if feeds:
            self.drafts += sum(f.tokens.size - 1 for _, f in feeds)
            for group in pass_groups(feeds, self.max_ids):
                self._verify(rows, group, out)
        for i, got in out.items():
            if got is PREFILLING:
                out[i] = None
            elif isinstance(got, Round):
                rows[i].ready.append(got)
        return out

    def ks(self, bids: list[Bid]) -> list[int]:
        """The K of each row sharing the pass: chosen for the batch where the pair's costs are
        measured (priced at the longest row's context), else each row's own."""
        costs = next((b.costs for b in bids if b.costs is not None), None)
        if not self.choose or costs is None:
            return [b.k for b in bids]
        position = max(b.position for b in bids)
        return choose_ks(bids, self.prices.pricing(costs, position, self.max_ids))

    def _verify(self, rows: list[Row], feeds: list[tuple[int, Feed]], out: dict) -> None:
        try:
            hidden = any(f.hidden for _, f in feeds)
            passes = [(f.cache, f.tokens) for _, f in feeds]
            t0 = perf_counter()
            logits = shared_pass(self.model, self.vocab_size, passes, hidden)
            mx.eval([x for row in logits for x in row if x is not None])
            width = max(tokens.size for _, tokens in passes)
            self.prices.observe(len(passes), width, perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 (every row of the pass rewinds and ends)
            for i, _ in feeds:
                out[i] = _thrown(rows[i], e)
            return
        self.passes += 1
        self.shared_rows += len(feeds)
        for (i, f), (row_logits, states) in zip(feeds, logits, strict=True):
            out[i] = _advance(rows[i], (row_logits, states if f.hidden else None))


def pass_groups(feeds: list[tuple[int, Feed]], max_ids: int | None) -> list[list]:
    """The rows' feeds in passes of at most `max_ids` ids each (rows x the widest feed; a feed
    wider than that alone, as it would run alone), narrow feeds together; None: one pass."""
    if max_ids is None:
        return [feeds]
    groups: list[list] = []
    for feed in sorted(feeds, key=lambda f: f[1].tokens.size):
        # sorted by width: the feed is the widest of its group
        if groups and (len(groups[-1]) + 1) * feed[1].tokens.size <= max_ids:
            groups[-1].append(feed)
        else:
            groups.append([feed])
    return groups


def _thrown(row: Row, error: Exception) -> Exception:
    """Raise `error` inside the row (its round rewinds), and return what it ended with."""
    try:
        row.rounds.throw(error)
    except Exception as e:  # noqa: BLE001
        return e
    return CacheError("a row went on after its shared pass failed")


def _advance(row: Row, value: Any) -> Any:
    """What the row yields next when sent `value` (None: its next round begins), or the
    exception that ended it (StopIteration: it finished)."""
    try:
        return row.rounds.send(value)
    except Exception as e:  # noqa: BLE001 (this row's end; the others go on)
        return e
