"""What the chat shows, independent of how it is drawn: the reply's text pieces by origin and the
engine's running statistics, both taken from `RoundEvent`s as they come.

Both the Textual app and the plain ANSI mode feed events into a `Reply` and draw its spans; the
engine decodes the ids and counts the statistics (macspec/api/text.py, macspec/api/stream.py),
not the UI.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..api.text import DRAFT, ORIGINS, REJECTED, TARGET

if TYPE_CHECKING:
    from ..api.stream import GenerationStats, RoundEvent

__all__ = ["DRAFT", "ORIGINS", "REJECTED", "TARGET", "Reply", "Span", "finish_label"]


@dataclass
class Span:
    text: str
    origin: str
    expires: float | None = None  # rejected spans disappear at this monotonic time


FINISH = {
    "stop": "end of answer",
    "length": "max tokens reached",
    "stop_string": "stop string",
    "context": "context full",
}


def finish_label(reason: str | None, stopped: bool = False) -> str:
    if stopped:
        return "stopped (Esc)"
    return FINISH.get(reason or "", reason or "done")


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def num(x: float | None, digits: int = 2) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.{digits}f}"


class Reply:
    """One assistant reply being built from rounds: coloured spans plus the latest stats."""

    def __init__(self, linger: float | None = 0.8):
        self.spans: list[Span] = []
        self.stats: GenerationStats | None = None  # the engine's, after the latest round
        self.last_speedup: float | None = None  # the latest round against a plain step
        self.accepted_per_round: list[int] = []
        self.max_num_draft = 0
        self.last_round = ""  # what the latest speculative round verified and kept
        self.finish_reason: str | None = None
        self.linger = linger  # seconds a rejected draft stays visible; None = for good
        self.failed = False  # drawing this reply went wrong; later rounds are ignored
        self.stopped = False  # the user ended it early

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.spans if s.origin != REJECTED)

    def add_round(self, event: RoundEvent, now: float | None = None) -> list[Span]:
        """The event's pieces as spans (returned too, for streams that print as they go)."""
        now = time.monotonic() if now is None else now
        new = [
            Span(
                text,
                origin,
                None if origin != REJECTED or self.linger is None else now + self.linger,
            )
            for text, origin in event.pieces
        ]
        self.spans += new
        self.stats = event.stats
        self.last_speedup = event.speedup or self.last_speedup
        self.accepted_per_round.append(len(event.accepted))
        self.max_num_draft = max(self.max_num_draft, event.num_draft)
        drafts, kept = event.rows - 1, len(event.accepted)
        by = event.drafter  # what drafted: the model, a copy (n-gram), ...
        if drafts > event.num_draft:  # a token tree: its nodes, and the accepted path's depth
            self.last_round = f"{by} tree {drafts}: depth {kept}"
        elif drafts:
            self.last_round = f"{by} {kept} of {drafts} kept"
        else:
            self.last_round = "plain step"
        self.finish_reason = event.finish_reason or self.finish_reason
        return new

    def expire(self, now: float | None = None, everything: bool = False) -> bool:
        """Drop rejected spans whose time is up; returns True when something changed."""
        now = time.monotonic() if now is None else now
        keep = [
            s
            for s in self.spans
            if s.origin != REJECTED or (not everything and (s.expires is None or s.expires > now))
        ]
        changed = len(keep) != len(self.spans)
        self.spans = keep
        return changed

    def pending_rejected(self) -> bool:
        return any(s.origin == REJECTED for s in self.spans)
