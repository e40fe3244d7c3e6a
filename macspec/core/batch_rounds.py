"""Several generations' rounds with one target pass between them (batch.py's shared pass).

`row_rounds` is loop.rounds for one generation of a batch: the same rounds, the same random
keys split the same way, the same rewinds, so each answer is what it is alone. It is a
generator the driver runs: it yields `PREFILLING` after each turn of its prompt (a long prompt
never stalls the other rows by more than a turn), a `Bid` when its round can share (its
policy's K; the driver sends back the K it drafts), a `Feed` when its round needs the target's
logits (sent back by the driver), and a `Round` when a round is done. A round it cannot share
(a token tree, a target whose layers cannot share) it runs alone, as loop.py does.

`BatchDriver.round` runs one round of every row: the rows' K are chosen for the batch
(batch_k.py), each drafts alone, then one target pass verifies every row's drafts, then each
accepts with its own key and rewinds its own cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack
from time import perf_counter

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import CacheError, OptionError
from . import hooks, memory
from .batch import shared_pass
from .batch_k import Bid, PassPrices, choose_ks
from .loop import PREFILLING, Engine, Limits, Round, Sampling, Sent, Share, Yielded, rounds
from .round import Feed

# Prompt ids prefilled between two rounds of the other rows: a new client's prompt is read in
# chunks, so the clients already answering wait at most one chunk's pass (docs/server.md, batching).
PREFILL_CHUNK = 256

Got = Yielded | Exception | None  # a row's next yield, the exception that ended it, or nothing


def row_rounds(
    engine: Engine,
    prompt: list[int],
    sampling: Sampling,
    limits: Limits,
    chunk: int = PREFILL_CHUNK,
    company: Callable[[], int] = lambda: 2,
) -> Generator[Yielded, Sent, None]:
    """generate_rounds' rounds for one row of a batch (its arguments, and `chunk`: prompt ids
    prefilled per turn; `company`: the rows in this round, 1 = alone, when its round is
    generate_rounds' own); yields PREFILLING, Bid (send back the K to draft, at most its
    own), Feed (send back its logits and hidden states) or Round. No constraint masks or
    logprobs here: those generations run alone."""
    if sampling.constraint is not None or sampling.logprobs is not None:
        raise OptionError("a batched row takes no constraint or logprobs: run it alone")
    yield from rounds(engine, prompt, sampling, limits, Share(chunk, company))


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

    def _round(self, rows: list[Row]) -> dict[int, Got]:
        self.company = len(rows)
        out: dict[int, Got] = {i: _advance(row, None) for i, row in enumerate(rows)}
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


def _advance(row: Row, value: Sent) -> Got:
    """What the row yields next when sent `value` (None: its next round begins), or the
    exception that ended it (StopIteration: it finished)."""
    try:
        return row.rounds.send(value)
    except Exception as e:  # noqa: BLE001 (this row's end; the others go on)
        return e
