"""`macspec chat --plain`: the conversation as ANSI-coloured text on stdout, for scripts and logs.

Reads one user message per line from stdin (or answers `--prompt` once), streams each answer with
every token coloured by origin, then prints a one-line stats summary.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

from ..base.errors import MacspecError
from ..cli.common import reading_line
from .transcript import DRAFT, REJECTED, TARGET, Reply, Span, finish_label

if TYPE_CHECKING:
    from ..api.pair import Pair

# 256-colour codes close to the app's Okabe-Ito blue/orange; the target's tokens are also bold
ANSI = {DRAFT: "\x1b[38;5;74m", TARGET: "\x1b[1;38;5;214m", REJECTED: "\x1b[9;38;5;175m"}
RESET = "\x1b[0m"
DIM = "\x1b[2m"


def _paint(spans: list[Span], color: bool) -> str:
    """Spans as text, one colour sequence per run of tokens with the same origin."""
    runs: list[tuple[str, str]] = []
    for span in spans:
        if span.origin == REJECTED:
            continue
        if runs and runs[-1][0] == span.origin:
            runs[-1] = (span.origin, runs[-1][1] + span.text)
        else:
            runs.append((span.origin, span.text))
    if not color:
        return "".join(text for _, text in runs)
    return "".join(f"{ANSI[origin]}{text}{RESET}" for origin, text in runs)


def legend(color: bool) -> str:
    if not color:
        return ""
    return (
        f"{DIM}legend:{RESET} {ANSI[DRAFT]}draft accepted{RESET} "
        f"{ANSI[TARGET]}target (correction/bonus){RESET}\n"
    )


def answer(
    pair: Pair,
    messages: list[dict[str, str]],
    options: dict[str, Any],
    out: TextIO,
    color: bool = True,
    interruptible: bool = False,
    err: TextIO | None = None,
) -> Reply:
    """Stream one answer to `out`; returns the finished Reply (text + stats).

    With `interruptible`, Ctrl+C ends this answer only (`reply.stopped`), as Esc does in the app.
    `err`: where a long prompt's reading is counted, if it is a terminal.
    """
    import macspec

    reply = Reply(linger=0.0)
    told = reading_line(err) if err is not None else None
    stream = macspec.stream_generate(pair, messages=messages, on_prefill=told, **options)
    try:
        for event in stream:
            # a stream cannot take text back, so rejected drafts are left out here
            out.write(_paint(reply.add_round(event), color))
            out.flush()
    except KeyboardInterrupt:
        if not interruptible:
            raise
        reply.stopped = True
    finally:
        stream.close()
    reply.expire(everything=True)
    return reply


def run_plain(
    pair: Pair,
    options: dict[str, Any],
    *,
    system: str | None = None,
    prompt: str | None = None,
    lines: Iterable[str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    color: bool | None = None,
) -> int:
    """The plain chat loop. With `prompt`: one answer, and an error ends it (the CLI reports it).
    Reading lines: an error about one message goes to `err` and the loop goes on."""
    out = out or sys.stdout
    err = err or sys.stderr
    if color is None:
        color = "NO_COLOR" not in os.environ
    history = [{"role": "system", "content": system}] if system else []
    messages = [prompt] if prompt is not None else (lines if lines is not None else sys.stdin)
    interactive = prompt is None and lines is None and sys.stdin.isatty()
    out.write(legend(color))
    for line in _prompted(messages, out if interactive else None):
        message = line.rstrip("\n")
        if not message.strip():
            continue
        history.append({"role": "user", "content": message})
        try:
            reply = answer(pair, history, options, out, color, interactive, err)
        except MacspecError as e:
            history.pop()  # unanswered: the next message must not follow it
            if prompt is not None:
                raise
            out.flush()
            err.write(f"macspec: error: {e}\n")
            err.flush()
            continue
        history.append({"role": "assistant", "content": reply.text})
        summary = reply.stats.summary() if reply.stats is not None else "no tokens"
        summary += "; " + (
            "stopped (Ctrl+C)" if reply.stopped else finish_label(reply.finish_reason)
        )
        out.write(f"\n{DIM}[{summary}]{RESET}\n" if color else f"\n[{summary}]\n")
        out.flush()
    return 0


def _prompted(messages: Iterable[str], prompt_to: TextIO | None) -> Iterator[str]:
    """The messages, showing a "> " prompt before each when a person is typing them."""
    pending = iter(messages)
    while True:
        if prompt_to is not None:
            prompt_to.write("> ")
            prompt_to.flush()
        try:
            yield next(pending)
        except StopIteration:
            return
