"""What `macspec bench` reports while it runs (small frozen events the library yields) and the
front end's way of showing them on stderr."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO


@dataclass(frozen=True)
class Note:
    """A stage begins ("loading models ...") or a method or prompt is left out, and why."""

    text: str


@dataclass(frozen=True)
class RunUpdate:
    """One run in progress (after each round) or done: warm-up runs, then the measured ones."""

    phase: str  # "warm-up" or "run"
    run: int  # 1-based within the phase
    runs: int
    label: str
    prompt: str
    temperature: float
    repeat: int  # 0-based; -1 for a warm-up
    tokens: int  # emitted so far
    tok_s: float  # tokens after the first target pass over the time since it, so far
    done: bool


@dataclass(frozen=True)
class Finished:
    """The last event: the result `bench` returns and writes to bench.json."""

    result: dict[str, Any]


class StderrProgress:
    """Prints notes and finished runs as lines; a run in progress is redrawn in place on a
    terminal (at most every `every` seconds), and otherwise printed every `every_log` seconds."""

    def __init__(self, stream: TextIO | None = None, every: float = 0.5, every_log: float = 15.0):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every if self.tty else every_log
        self.last = time.monotonic()

    def __call__(self, event: Note | RunUpdate | Finished) -> None:
        if isinstance(event, Note):
            self._line(event.text, end=True)
        elif isinstance(event, RunUpdate):
            now = time.monotonic()
            if event.done or now - self.last >= self.every:
                self.last = now
                self._line(self.describe(event), end=event.done or not self.tty)

    @staticmethod
    def describe(e: RunUpdate) -> str:
        where = "warm-up" if e.phase == "warm-up" else f"T={e.temperature} rep {e.repeat + 1}"
        state = "" if e.done else " ..."
        return (
            f"[{e.run}/{e.runs}] {where} {e.label:<22} {e.prompt:<12}: {e.tokens} tokens, "
            f"{e.tok_s:.1f} tok/s{state}"
        )

    def _line(self, text: str, end: bool) -> None:
        if self.tty:  # \r and clear-to-end-of-line: redraw the line in place
            self.stream.write("\r\x1b[K" + text + ("\n" if end else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
