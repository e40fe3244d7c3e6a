"""Batched generations driven the way the server's scheduler drives them (core/batch_rounds.py's
BatchDriver), for tests/core/test_batch.py and scripts/reference_tokens.py."""

from __future__ import annotations

import copy

from macspec.api import stream as api
from macspec.api.options import GenerationOptions
from macspec.core import NgramDrafter
from macspec.core.batch_rounds import PREFILL_CHUNK, Row, row_rounds


def variants(pair):
    """The pair as loaded (draft model + n-gram), with an n-gram copy only, and with none:
    every variant shares the target model, as one server's requests do."""
    ngram = copy.copy(pair)
    ngram.drafter_factory = lambda adaptive: NgramDrafter()
    plain = copy.copy(pair)
    plain.drafter_factory = None
    return {"model": pair, "ngram": ngram, "plain": plain}


def open_row(pair, prompt, chunk=PREFILL_CHUNK, **options):
    """A generation whose rounds a BatchDriver runs, reading its prompt `chunk` ids at a time:
    (its stream, its row)."""
    made = {}

    def rounds(*args, **kwargs):
        made["row"] = Row(row_rounds(*args, chunk=chunk, **kwargs))
        return made["row"]

    ids = api.prompt_ids(pair, prompt)
    stream = api.open_stream(pair, ids, GenerationOptions.from_kwargs(**options), rounds)
    return stream, made["row"]


def run_batch(driver, requests, join_after=None):
    """Run `requests` [(pair, prompt, options)] as one batch; `join_after` {i: rounds}: request
    i joins once the batch has run that many rounds. Returns each answer's ids, and per round
    how many rows the driver ran."""
    join_after = join_after or {}
    waiting = dict(enumerate(requests))
    active, out, sizes, rounds = {}, {}, [], 0
    while waiting or active:
        for i in [i for i in waiting if join_after.get(i, 0) <= rounds]:
            p, prompt, opts = waiting.pop(i)
            active[i] = open_row(p, prompt, **opts)
            out[i] = []
        keys = list(active)
        sizes.append(len(keys))
        results = driver.round([active[i][1] for i in keys])
        for i, (_, got) in zip(keys, results, strict=True):
            if isinstance(got, Exception):
                raise got
            if got is None:
                continue
            ev = next(active[i][0])
            out[i] += ev.emitted
            if ev.finish_reason:
                del active[i]
        rounds += 1
    return [out[i] for i in range(len(requests))], sizes
