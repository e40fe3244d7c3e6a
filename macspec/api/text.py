"""Token ids become text in one place: a round's ids in, the text it adds out, in pieces by
origin (an accepted draft, the target's own token, a rejected draft shown where it was proposed)
and with stop strings applied. Front ends render the pieces; they never decode ids themselves."""

from __future__ import annotations

import copy
from typing import Any

DRAFT = "draft"  # text of draft tokens the target accepted
TARGET = "target"  # text of the token the target sampled itself (a correction or the bonus)
REJECTED = "rejected"  # what rejected drafts would have added: shown, never part of the text
ORIGINS = (DRAFT, TARGET, REJECTED)


class TextStream:
    """The streaming detokenizer of one generation, remembering which token made each
    character appear, and holding back text that may be the start of a stop string."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self._tokenizer = tokenizer
        self._detok = copy.copy(tokenizer.detokenizer)
        self._detok.reset()
        self._stops = stops
        self._ids: list[int] = []
        self._ends: list[tuple[int, str]] = []  # text length after each token, and its origin
        self._shown = 0  # characters already released
        self._cut: int | None = None  # where a stop string starts, once found

    @property
    def text(self) -> str:
        return self._detok.text

    def add(self, ids: list[int], origin: str) -> tuple[int, bool]:
        """Feed ids one by one; returns (ids taken, whether a stop string was completed)."""
        for i, t in enumerate(ids):
            self._detok.add_token(t)
            self._ids.append(t)
            self._ends.append((len(self._detok.text), origin))
            if self._stops and self._stop_at() is not None:
                self._cut = self._stop_at()
                return i + 1, True
        return len(ids), False

    def finalize(self) -> None:
        self._detok.finalize()
        if self._ends:
            self._ends.append((len(self._detok.text), self._ends[-1][1]))

    def peek(self, ids: list[int]) -> str:
        """The text `ids` would add after the current ones, without adding them."""
        if not ids:
            return ""
        window = self._ids[-4:]  # enough context for leading spaces and merged characters
        before = self._tokenizer.decode(window) if window else ""
        after = self._tokenizer.decode(window + list(ids))
        common = 0
        while common < min(len(before), len(after)) and before[common] == after[common]:
            common += 1
        return after[common:].replace("\ufffd", "")

    def release(self, final: bool, rejected: str = "", at: int = 0) -> list[tuple[str, str]]:
        """The text not released yet, as (text, origin) pieces. A stop string and what follows
        it are never released; without `final`, a tail that may begin one is held back.
        `rejected` is placed at text position `at` (or last, if that is held back)."""
        text = self._detok.text
        end = len(text) if self._cut is None else self._cut
        if self._cut is None and not final and self._stops:
            end -= max(
                (n for s in self._stops for n in range(1, len(s)) if text.endswith(s[:n])),
                default=0,
            )
        spans, prev = [], 0  # (start, end, origin) of the released characters
        for stop, origin in self._ends:
            lo, hi = max(prev, self._shown), min(stop, end)
            if lo < hi:
                spans.append((lo, hi, origin))
            prev = stop
        self._shown = max(self._shown, end)
        pieces = [(text[lo:hi], origin) for lo, hi, origin in spans]
        if rejected:  # before the first released character at or after `at`
            index = next((k for k, (lo, _, _) in enumerate(spans) if lo >= at), len(spans))
            for k, (lo, hi, origin) in enumerate(spans):
                if lo < at < hi:  # `at` falls inside a piece: split it there
                    pieces[k : k + 1] = [(text[lo:at], origin), (text[at:hi], origin)]
                    index = k + 1
            pieces.insert(index, (rejected, REJECTED))
        merged: list[tuple[str, str]] = []  # one piece per run of one origin
        for text_, origin in pieces:
            if merged and merged[-1][1] == origin:
                merged[-1] = (merged[-1][0] + text_, origin)
            elif text_:
                merged.append((text_, origin))
        return merged

    def _stop_at(self) -> int | None:
        # Released text never holds the start of a stop string (release() holds it back).
        text = self._detok.text
        found = [i for s in self._stops if (i := text.find(s, self._shown)) >= 0]
        return min(found) if found else None
