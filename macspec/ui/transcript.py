"""What the chat shows, independent of how it is drawn: per-token text with its origin, and stats.

Both the Textual app and the plain ANSI mode feed engine `RoundEvent`s into a `Reply` and draw its
spans; keeping this apart from the widgets lets both agree on colours and numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

DRAFT = "draft"  # a draft token the target accepted
TARGET = "target"  # a token the target sampled itself (correction after a rejection, or bonus)
REJECTED = "rejected"  # draft tokens the target threw away (shown briefly, never part of the text)

ORIGINS = (DRAFT, TARGET, REJECTED)


class TokenTexts:
    """Splits a stream of token ids into per-token text pieces.

    Decodes a short window of earlier tokens with each new one (the prefix/read-offset method), so
    sentencepiece leading spaces and multi-byte characters land on the token that completes them.
    """

    def __init__(self, tokenizer: Any, skip_ids: Iterable[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = set(skip_ids)
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already turned into text

    def _decode(self, ids: Sequence[int]) -> str:
        ids = [i for i in ids if i not in self._skip]
        if not ids:
            return ""
        # special tokens stay visible, as in the engine's own text (EOS never reaches here)
        return self._tok.decode(ids)

    def add(self, token: int) -> str:
        """Append `token`; returns the text it completes ("" while a character is still partial)."""
        self.ids.append(int(token))
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        if not after.endswith("\ufffd") and not after.startswith(before):
            # the window re-decoded differently (rare merges); emit what follows the common part
            self._prefix, self._read = self._read, len(self.ids)
            common = len(_common_prefix(before, after))
            return after[common:]
        return ""

    def peek(self, tokens: Sequence[int]) -> str:
        """Text `tokens` would add after the current ids, without adding them."""
        window = self.ids[self._prefix :]
        before = self._decode(window)
        after = self._decode(window + [int(t) for t in tokens])
        if after.startswith(before):
            return after[len(before) :].rstrip("\ufffd")
        return after[len(_common_prefix(before, after)) :].rstrip("\ufffd")


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


@dataclass
class Span:
    text: str
    origin: str
    expires: float | None = None  # rejected spans disappear at this monotonic time


@dataclass
class Stats:
    """Running numbers for one reply, from the engine's per-round timings."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    round_time: float = 0.0
    plain_step_time: float = 0.0
    last_speedup: float | None = None
    max_num_draft: int = 0
    speculative_rounds: int = 0
    speculative_emitted: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, event: Any) -> None:
        self.rounds += 1
        if event.speculative:
            self.drafted += len(event.accepted) + len(event.rejected)
            self.accepted += len(event.accepted)
            self.speculative_rounds += 1
            self.speculative_emitted += len(event.emitted)
        self.accepted_per_round.append(len(event.accepted))
        self.max_num_draft = max(self.max_num_draft, event.num_draft)
        self.emitted += len(event.emitted)
        self.round_time += event.round_time
        if event.plain_step_time and event.plain_step_time > 0:
            self.plain_step_time = event.plain_step_time
        if event.emitted and event.round_time > 0 and self.plain_step_time > 0:
            # tokens this round x what one plain target step costs, over what the round cost
            self.last_speedup = len(event.emitted) * self.plain_step_time / event.round_time
        if event.finish_reason:
            self.finish_reason = event.finish_reason

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per speculative round (accepted drafts + the target's own), as the
        engine's GenerationStats counts it; plain steps are left out."""
        if not self.speculative_rounds:
            return None
        return self.speculative_emitted / self.speculative_rounds

    @property
    def tokens_per_second(self) -> float | None:
        return self.emitted / self.round_time if self.round_time > 0 else None

    @property
    def plain_tokens_per_second(self) -> float | None:
        return 1.0 / self.plain_step_time if self.plain_step_time > 0 else None

    @property
    def speedup(self) -> float | None:
        tps, base = self.tokens_per_second, self.plain_tokens_per_second
        return tps / base if tps and base else None

    def summary(self, timings: bool = True) -> str:
        """One line for logs and the plain mode."""
        parts = [f"{self.rounds} rounds", f"{self.emitted} tokens"]
        parts.append(f"acceptance {_pct(self.acceptance_rate)}")
        parts.append(f"accept length {_num(self.mean_accepted_length)}")
        if timings:
            parts.append(
                f"{_num(self.tokens_per_second, 1)} tok/s vs plain "
                f"{_num(self.plain_tokens_per_second, 1)} tok/s ({_num(self.speedup)}x)"
            )
        if self.finish_reason:
            parts.append(f"finish: {self.finish_reason}")
        return " · ".join(parts)


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


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _num(x: float | None, digits: int = 2) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.{digits}f}"


class Reply:
    """One assistant reply being built from rounds: coloured spans plus its stats."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int] = (), linger: float | None = 0.8):
        self.texts = TokenTexts(tokenizer, skip_ids=eos_ids)
        self.spans: list[Span] = []
        self.stats = Stats()
        self.linger = linger  # seconds a rejected draft stays visible; None = for good
        self.failed = False  # drawing this reply went wrong; later rounds are ignored
        self.stopped = False  # the user ended it early
        self._engine_text = ""  # what the engine says was emitted (authoritative on stop strings)

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.spans if s.origin != REJECTED)

    def add_round(self, event: Any, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.stats.add(event)
        n_acc = len(event.accepted)
        for i, token in enumerate(event.emitted):
            if i == n_acc and event.rejected:
                self._add_rejected(event.rejected, now)
            piece = self.texts.add(token)
            if piece:
                self.spans.append(Span(piece, DRAFT if i < n_acc else TARGET))
        if event.rejected and len(event.emitted) <= n_acc:
            self._add_rejected(event.rejected, now)
        self._engine_text += event.text or ""
        self._trim_to_engine_text()

    def _add_rejected(self, rejected: Sequence[int], now: float) -> None:
        piece = self.texts.peek(rejected)
        if piece:
            expires = None if self.linger is None else now + self.linger
            self.spans.append(Span(piece, REJECTED, expires))

    def _trim_to_engine_text(self) -> None:
        # a stop string is cut from the engine's text, not from the ids: drop the same tail here
        if self.stats.finish_reason != "stop_string":
            return
        shown = self.text
        if len(shown) <= len(self._engine_text) or not shown.startswith(self._engine_text):
            return
        extra = len(shown) - len(self._engine_text)
        while extra > 0 and self.spans:
            span = self.spans[-1]
            if span.origin == REJECTED:
                self.spans.pop()
                continue
            if len(span.text) <= extra:
                extra -= len(span.text)
                self.spans.pop()
            else:
                span.text = span.text[: len(span.text) - extra]
                extra = 0

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
