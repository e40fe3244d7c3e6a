"""`macspec chat`'s message box (ui/widgets/prompt.py): a pasted file goes in whole, newlines and
all, Enter sends it, ctrl+j starts a new line, and the conversation shows a long message's
start and how many lines more were sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from support.aio import aio
from textual import events

from macspec.ui import create_app
from macspec.ui.widgets import PromptBox, shortened
from macspec.ui.widgets.prompt import SHOWN_LINES

SIZE = (120, 36)
OPTIONS = {"max_tokens": 8, "seed": 0, "adaptive": False}
FILE = "Summarize this code:\n" + "\n".join(f"def f{i}(x):\n    return x * {i}" for i in range(40))


@asynccontextmanager
async def chatting(pair) -> AsyncIterator[tuple]:
    """The app running with its message box focused: (app, pilot, box)."""
    app = create_app(pair, **OPTIONS, timings=False)
    async with app.run_test(size=SIZE) as pilot:
        box = app.query_one("#prompt", PromptBox)
        box.focus()
        await pilot.pause()
        yield app, pilot, box


async def settled(app, pilot) -> None:
    await pilot.pause()
    await app.workers.wait_for_complete()
    await pilot.pause()


@aio
async def test_a_pasted_file_is_sent_whole_and_shown_shortened(chat_pair):
    async with chatting(chat_pair) as (app, pilot, box):
        app.post_message(events.Paste(FILE))  # as the terminal driver sends it
        await pilot.pause()
        assert box.text == FILE  # a one-line Input kept "Summarize this code:" only
        await pilot.press("enter")
        await settled(app, pilot)
        assert app.history[0] == {"role": "user", "content": FILE}
        assert box.text == ""
        (user,) = app.query(".user")
        shown = str(user.render())
        assert shown.splitlines()[:SHOWN_LINES] == FILE.splitlines()[:SHOWN_LINES]
        assert shown.splitlines()[-1] == f"… {81 - SHOWN_LINES} more lines sent"
        assert app.history[1]["role"] == "assistant"


@aio
async def test_enter_sends_and_ctrl_j_starts_a_new_line(chat_pair):
    async with chatting(chat_pair) as (app, pilot, box):
        await pilot.press("enter")  # nothing to send
        await settled(app, pilot)
        assert app.history == []
        await pilot.press(*"first", "ctrl+j", *"second")
        assert box.text == "first\nsecond"
        await pilot.press("enter")
        await settled(app, pilot)
        assert app.history[0] == {"role": "user", "content": "first\nsecond"}


@aio
async def test_a_new_line_keeps_its_place_among_keys_that_come_at_once(chat_pair):
    """A terminal's burst (keys typed fast, or sent together): the new line lands between the
    keys before and after it, not after them all."""
    async with chatting(chat_pair) as (app, pilot, box):
        await pilot.pause()
        keys = [*"ab", "ctrl+j", *"cd"]
        for key in keys:  # posted together, as the driver posts a burst
            app.post_message(events.Key(key, key if len(key) == 1 else None))
        await pilot.pause()
        assert box.text == "ab\ncd"


def test_a_short_message_is_shown_as_it_is():
    text = "\n".join(str(i) for i in range(SHOWN_LINES))
    assert shortened(text) == text
    longer = text + "\nlast"
    assert shortened(longer) == text + "\n… 1 more line sent"
