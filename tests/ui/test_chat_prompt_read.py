"""`macspec chat` with a long message: the status says how far the prompt is read, and Esc stops
the reading itself; `macspec generate` and the plain chat count it on a terminal (the real
engine on tiny random models with a 2,048-id context)."""

from __future__ import annotations

import io
import re

import pytest
from support.aio import aio
from support.tinymodels import make_tiny_model
from textual.widgets import ProgressBar

import macspec
from macspec.api.chat_template import render as chat_prompt
from macspec.cli import main
from macspec.cli.common import reading_line
from macspec.ui import create_app
from macspec.ui.plain import run_plain
from macspec.ui.widgets import ReadingBar

SIZE = (120, 36)
LONG = "the quick brown fox jumps over the lazy dog. " * 30  # ~1,350 ids: three turns


@pytest.fixture(scope="module")
def long_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    target = make_tiny_model(root / "target", seed=0, context=2048)
    draft = make_tiny_model(root / "draft", seed=1, context=2048)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def long_pair(long_dirs):
    return macspec.load(*long_dirs)


def recording(app, bars: list | None = None) -> list[str]:
    """Every status line the app shows, in order; `bars`: with each, the reading bar's
    (shown, progress, total)."""
    shown, show = [], app._status

    def status(message: str) -> None:
        shown.append(message)
        show(message)
        if bars is not None:
            bar = app.query_one("#reading-progress", ProgressBar)
            bars.append((app.query_one(ReadingBar).display, bar.progress, bar.total))

    app._status = status
    return shown


async def answered(app, pilot, message: str) -> None:
    app.send(message)
    await pilot.pause()
    await app.workers.wait_for_complete()
    await pilot.pause()


@aio
async def test_the_status_counts_the_prompt_read_then_the_answer_comes(long_pair):
    app = create_app(long_pair, max_tokens=8, seed=0)
    async with app.run_test(size=SIZE) as pilot:
        bars = []
        shown = recording(app, bars)
        await answered(app, pilot, LONG)
        ids = chat_prompt(long_pair.tokenizer, [{"role": "user", "content": LONG}])
        total = len(ids) - 1
        assert total > 1024
        reading = [s for s in shown if s.startswith("reading the prompt")]
        assert reading == [
            f"reading the prompt: 512 of {total:,} ids (Esc stops)",
            f"reading the prompt: 1,024 of {total:,} ids (Esc stops)",
        ]
        answering = shown.index("answering… (Esc stops)", 1)
        assert shown.index(reading[-1]) < answering
        # The bar shows each turn while the prompt is read, and hides when the answer begins.
        at = [shown.index(line) for line in reading]
        assert [bars[i] for i in at] == [(True, 512, total), (True, 1024, total)]
        assert bars[answering][0] is False and not app.query_one(ReadingBar).display
        assert (
            app.history[-1]["content"]
            == macspec.generate(long_pair, ids, max_tokens=8, seed=0).text
        )
        assert "max tokens reached" in shown[-1]


@aio
async def test_escape_while_reading_stops_before_the_answer_and_the_next_message_works(
    long_pair, monkeypatch
):
    app = create_app(long_pair, max_tokens=8, seed=0)
    real = macspec.stream_generate

    def escape_after_the_first_turn(*args, on_prefill, **kwargs):
        def told(read, total):
            on_prefill(read, total)
            app._stop.set()  # Esc, as the first 512 ids are read

        return real(*args, on_prefill=told, **kwargs)

    monkeypatch.setattr(macspec, "stream_generate", escape_after_the_first_turn)
    async with app.run_test(size=SIZE) as pilot:
        shown = recording(app)
        await answered(app, pilot, LONG)
        assert not app.busy and app.history == []  # the unanswered message is not kept
        assert shown[-1] == "stopped (Esc) before the answer began"
        assert not list(app.query(".assistant"))
        monkeypatch.undo()
        await answered(app, pilot, "hi")
        history = [{"role": "user", "content": "hi"}]
        expected = macspec.generate(
            long_pair, chat_prompt(long_pair.tokenizer, history), max_tokens=8, seed=0
        )
        assert app.history == [*history, {"role": "assistant", "content": expected.text}]


def test_snapshot_while_a_long_prompt_is_read(long_dirs, snap_compare):
    """The reading bar under the conversation, a quarter through (its estimate hidden with
    the other timings)."""
    app = create_app(macspec.load(*long_dirs), max_tokens=8, timings=False)

    async def run_before(pilot):
        app._reading_bar.show(1024, 3870)
        app._status("reading the prompt: 1,024 of 3,870 ids (Esc stops)")
        app.query_one("#prompt").cursor_blink = False  # a blinking cursor differs shot to shot
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_generate_counts_a_long_prompt_on_a_terminal_only(long_dirs, capsys, monkeypatch):
    argv = ["generate", LONG, "--target", long_dirs[0], "--draft", long_dirs[1], "--raw-prompt"]
    argv += ["--max-tokens", "4", "--temperature", "0"]
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(argv) == 0
    total = len(macspec.load(long_dirs[0]).tokenizer.encode(LONG)) - 1
    err = terminal.getvalue()
    # Each count with its share and the time left at the rate so far, then the line erased.
    count = r"\r\[macspec\] reading the prompt: {} of {} ids \({}%, about \d+ s left\)\033\[K"
    first = count.format("512", f"{total:,}", round(100 * 512 / total))
    last = count.format("1,024", f"{total:,}", round(100 * 1024 / total)) + r"\r\033\[K"
    assert re.search(first, err) and re.search(last, err), repr(err)
    monkeypatch.undo()
    assert main(argv) == 0
    assert "reading the prompt" not in capsys.readouterr().err  # a pipe: no counting line
    assert reading_line(io.StringIO()) is None


def test_the_plain_chat_counts_a_long_prompt_on_a_terminal(long_pair):
    out, err = io.StringIO(), Terminal()
    options = {"max_tokens": 4, "temperature": 0}
    long_pair.prompt_cache.clear()  # (the tests above read the same message: read it afresh)
    assert run_plain(long_pair, options, prompt=LONG, out=out, err=err, color=False) == 0
    assert "\r[macspec] reading the prompt: 512 of " in err.getvalue()
    expected = macspec.generate(long_pair, messages=[{"role": "user", "content": LONG}], **options)
    assert expected.text in out.getvalue()
