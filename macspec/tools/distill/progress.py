"""Progress on stderr for the long stages: a message, and a bar with a note (rate, ETA)."""

from __future__ import annotations

import math
import sys


def say(msg: str) -> None:
    print(f"macspec: {msg}", file=sys.stderr, flush=True)


def hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--"
    s = int(seconds)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


def bar(label: str, done: float, total: float, extra: str) -> None:
    width = 24
    filled = int(width * done / total) if total else width
    pct = 100 * done / total if total else 100
    line = f"\r{label:5s} [{'#' * filled}{'.' * (width - filled)}] {pct:5.1f}%  {extra}"
    print(line, end="", file=sys.stderr, flush=True)


def end_bar() -> None:
    print(file=sys.stderr)
