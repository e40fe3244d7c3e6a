"""The scheduler with several clients verified in one target pass (core/batch_rounds.py).

Each round, every active request whose generation can share drafts alone and then all of them
are verified in one target pass; the others (constrained requests, and every request where the
pair cannot share: see `reason`) take their round in turn after it, as Scheduler does. A new
request reads its prompt in chunks between the batch's rounds.
"""

from __future__ import annotations

from typing import Any

from ..api.options import GenerationOptions
from ..api.pair import Pair
from ..core.batch import shared_reason
from ..core.batch_rounds import BatchDriver, Row, row_rounds
from .scheduler import END, Job, Scheduler


def alone_reason(opts: GenerationOptions) -> str:
    """Why a request takes its rounds in turn even where the pair shares passes, or "":
    the batch's rows (core/batch_rounds.py) apply no constraint masks and report no logprobs."""
    if opts.constraint is not None:
        return "constrained decoding takes turns"
    if opts.top_logprobs is not None:
        return "log probabilities take turns"
    return ""


class BatchScheduler(Scheduler):
    """Scheduler whose requests share target passes where the pair allows (`batch=False`: they
    take turns; `choose=False`: each row drafts its own policy's K; both for comparison)."""

    def __init__(
        self, pair: Pair, parallel: int = 4, batch: bool = True, choose: bool = True
    ) -> None:
        super().__init__(pair, parallel)
        self.batch = batch
        self.reason: str | None = None if batch else "turned off (--no-batch)"
        self._driver = BatchDriver(pair.target, pair.vocab_size, choose)
        self._rows: dict[int, Row] = {}  # id(job) -> its row, for jobs in the batch
        self.turns = 0  # requests that took turns although batching was on

    async def start(self) -> None:
        # The check runs model passes: at startup, so that no request waits behind it.
        if self.reason is None:
            self.reason = await self.mlx.run(self._check)
        await super().start()

    def _check(self) -> str:
        """Why this pair's requests take turns, or "" (on MLX's thread, as its passes are)."""
        pair = self.pair
        return shared_reason(pair.target, pair.vocab_size, pair.cache_kinds, pair.group is not None)

    def status(self) -> dict[str, Any]:
        out = super().status()
        batched = self.reason == ""
        out["batched"] = batched
        if not batched:
            out["batch_reason"] = self.reason or "checking the model"
        out["shared_passes"] = self._driver.passes
        out["rows_per_shared_pass"] = (
            round(self._driver.shared_rows / self._driver.passes, 2)
            if self._driver.passes
            else None
        )
        out["drafts_per_shared_row"] = (
            round(self._driver.drafts / self._driver.shared_rows, 2)
            if self._driver.shared_rows
            else None
        )
        out["requests_taking_turns"] = self.turns
        return out

    def _round(self, active: list[Job]) -> list[Job]:
        """The batch's round (one shared pass), then each other job's round in turn."""
        finished, rows, jobs = [], [], []
        for job in active:
            if self._cancelled(job):
                finished.append(job)
            elif job.stream is None and not self._open(job):
                finished.append(job)
            elif id(job) in self._rows:
                rows.append(self._rows[id(job)])
                jobs.append(job)
            elif not self._step(job):
                finished.append(job)
        for job, (_, got) in zip(jobs, self._driver.round(rows) if rows else [], strict=True):
            if not self._take(job, got):
                finished.append(job)
        for job in finished:
            self._rows.pop(id(job), None)
        if not self._rows:
            self._driver.release()  # no row left: the model's memory unwired until the next
        return finished

    def _open(self, job: Job) -> bool:
        """Start `job`'s generation: a row of the batch where it can be, else on its own."""
        try:
            opts = GenerationOptions.from_kwargs(**job.options)
            if self.reason != "" or alone_reason(opts):  # None: not checked, so not shared
                self.turns += bool(self.batch)
                return True  # _step starts it alone

            def rounds(*args: Any, **kwargs: Any) -> Row:
                # Alone in a round, a row's round is generate_rounds' own (a pass launched ahead).
                company = lambda: self._driver.company  # noqa: E731
                row = Row(row_rounds(*args, company=company, **kwargs))
                self._rows[id(job)] = row
                return row

            job.stream = self._generation(job, opts, rounds)
        except Exception as e:  # bad options: reported to its client; the server goes on
            self._fail(job, e)
            return False
        return True

    def _take(self, job: Job, got: Any) -> bool:
        """A row's round to its client; False once the job is over."""
        if got is None:  # still reading its prompt
            return True
        if isinstance(got, StopIteration):
            job.put(END)
            return False
        if isinstance(got, Exception):
            self._fail(job, got)
            return False
        try:
            event = next(job.stream)
        except Exception as e:  # noqa: BLE001 (text or stop handling failed)
            self._fail(job, e)
            return False
        return self._deliver(job, event)
