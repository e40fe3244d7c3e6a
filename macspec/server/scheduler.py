"""The server's generations, all on one MLX thread: requests wait in a queue, up to `parallel` of
them run at once, one round each in turn, and every round goes to its request's asyncio queue as
soon as it is made (so a stream flushes per round and no client waits for another's answer).

Rounds of different requests are not batched into one target pass: each generation keeps its own
caches and drafter, so interleaving them changes no request's tokens."""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections import deque
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from ..api.mlx_thread import MlxThread
from ..api.options import GenerationOptions
from ..api.pair import Pair
from ..api.stream import GenerationStream, check_length, open_stream, prompt_ids
from ..base.errors import MacspecError

END = object()  # the last item of a job's queue after its final event


class HungUp(Exception):
    """Raised from a job's prompt reading once its client has gone: the reading stops at its
    next turn (512 ids) instead of reading a long prompt nobody waits for."""


@dataclass(frozen=True)
class PromptRead:
    """A job's item while its prompt is read (the client asked for return_progress)."""

    processed: int  # ids held so far, the cached ones included
    total: int  # ids to hold before the first pass (all but the prompt's last)
    cached: int  # ids the prompt cache held
    seconds: float  # since the reading began


@dataclass
class Job:
    ids: list[int]
    options: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # the client went away: stop at the next round
    stopped: bool = False  # the server is shutting down: the answer was cut short
    stream: GenerationStream | None = None
    progress: bool = False  # PromptRead items as the prompt is read
    began: float = 0.0  # when its generation opened (perf_counter)
    read: tuple[int, int] = (0, 0)  # (ids held, ids to hold) of its prompt, as last told

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    def reading(self, read: int, total: int, cached: int) -> None:
        """Told as the prompt is read (on the MLX thread): a hung-up client ends it."""
        if self.cancelled:
            raise HungUp()
        self.read = (read, total)
        if self.progress:
            self.put(PromptRead(read, total, cached, perf_counter() - self.began))


def _reading(job: Job) -> bool:
    """Whether the job's prompt is being read: told part of it, not yet all."""
    return 0 < job.read[0] < job.read[1]


class Scheduler:
    """Jobs for the pair, run on `self.mlx`, the process's one MLX thread."""

    def __init__(self, pair: Pair, parallel: int = 4) -> None:
        self.pair, self.parallel = pair, max(1, parallel)
        self.mlx = MlxThread()
        # Reentrant: close() runs from a signal handler, maybe while this thread holds it.
        self._cond = threading.Condition(threading.RLock())
        self._pending: deque[Job] = deque()
        self._active: list[Job] = []
        self._closing = False
        self._done: asyncio.Future | None = None
        self.served = self.failed = self.generated = 0
        self.drafted = self.accepted = 0

    # -- from the event loop (or a signal handler)

    async def start(self) -> None:
        """Begin taking jobs (awaited by the app before it serves: what it awaits is paid at
        startup, never by the first request)."""
        self._done = self.mlx.run(self._run)

    def submit(self, ids: list[int], options: dict[str, Any], progress: bool = False) -> Job:
        """Queue a generation; `progress`: PromptRead items as its prompt is read."""
        job = Job(ids, options, asyncio.get_running_loop(), progress=progress)
        with self._cond:
            if self._closing:
                job.stopped = True
                job.put(END)
            else:
                self._pending.append(job)
                self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        job.cancelled = True  # read by the MLX thread before the job's next round

    def close(self) -> None:
        """Cut every answer short at its next round and stop taking jobs."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    async def wait_closed(self) -> None:
        self.close()
        if self._done is not None:
            await self._done

    def shutdown(self) -> None:
        """After the event loop: free the MLX thread's state and join it (see MlxThread)."""
        self.mlx.close()

    def status(self) -> dict[str, Any]:
        with self._cond:
            active, queued = list(self._active), len(self._pending)
        # Requests whose long prompts are being read: no token comes until they are.
        reading = [{"processed": j.read[0], "total": j.read[1]} for j in active if _reading(j)]
        return {
            "active": len(active),
            "queued": queued,
            "reading": reading,
            "served": self.served,
            "failed": self.failed,
            "completion_tokens": self.generated,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
        }

    # -- on the MLX thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closing or self._pending or self._active):
                    self._cond.wait()
                if self._closing:
                    jobs = self._active + list(self._pending)
                    self._active, self._pending = [], deque()
                    break
                while self._pending and len(self._active) < self.parallel:
                    self._active.append(self._pending.popleft())
                active = list(self._active)
            finished = self._round(active)
            with self._cond:
                self._active = [j for j in self._active if j not in finished]
        for job in jobs:  # shutting down: end every answer where it is
            if job.stream is not None:
                job.stream.close()
            job.stopped = True
            job.put(END)

    def _round(self, active: list[Job]) -> list[Job]:
        """One round of every active job, each in turn; returns those that are over."""
        return [job for job in active if not self._step(job)]

    def _step(self, job: Job) -> bool:
        """One round of `job`; False once it is over (finished, failed or cancelled)."""
        if self._cancelled(job):
            return False
        try:
            if job.stream is None:
                job.stream = self._generation(job, GenerationOptions.from_kwargs(**job.options))
            event = next(job.stream)
        except StopIteration:
            job.put(END)
            return False
        except Exception as e:  # reported to its client; the server goes on
            self._fail(job, e)
            return False
        return self._deliver(job, event)

    def _generation(
        self, job: Job, opts: GenerationOptions, rounds: Any = None
    ) -> GenerationStream:
        """The job's generation with its checked options (its rounds made by `rounds`, a
        batch's rows, if given), its prompt read in turns told to the job (Job.reading)."""
        ids = prompt_ids(self.pair, job.ids)
        check_length(self.pair, ids)
        more = {} if rounds is None else {"rounds": rounds}
        stream = open_stream(self.pair, ids, opts, progress=job.reading, **more)
        # Its rounds, the reading first, run from here: a grammar's compilation and the
        # drafter's making, done above, are not the prompt's reading.
        job.began = perf_counter()
        return stream

    def _cancelled(self, job: Job) -> bool:
        """Whether the client went away (its generation is then closed)."""
        if job.cancelled and job.stream is not None:
            job.stream.close()
        return job.cancelled

    def _fail(self, job: Job, e: Exception) -> None:
        if isinstance(e, HungUp):  # its client is gone: not a failure, and nobody to tell
            if job.stream is not None:
                job.stream.close()
            return
        if not isinstance(e, MacspecError):
            traceback.print_exception(e)
        if job.stream is not None:
            job.stream.close()
        self.failed += 1
        job.put(e)

    def _deliver(self, job: Job, event: Any) -> bool:
        """Send a round's event to its client; False when it was the last."""
        job.put(event)
        if event.finish_reason is None:
            return True
        stats = event.stats
        self.served += 1
        self.generated += stats.generated_tokens
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        job.put(END)
        return False
