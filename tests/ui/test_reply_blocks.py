"""A long reply draws its settled lines once, in blocks, and only its live end each round:
what it shows is still exactly the reply, line for line, with rejected drafts that linger kept
out of the blocks until they go."""

from __future__ import annotations

from support.aio import aio
from textual.app import App, ComposeResult
from textual.widgets import Static

from macspec.ui.transcript import DRAFT, REJECTED, TARGET, Reply, Span
from macspec.ui.widgets.reply import BLOCK_CHARS, ReplyView


class Host(App):
    """The reply beside what one widget would draw of the same text, at the same width."""

    CSS = "ReplyView, #whole { width: 40; height: auto; }"

    def __init__(self, reply: Reply) -> None:
        super().__init__()
        self.view = ReplyView(reply)

    def compose(self) -> ComposeResult:
        yield self.view
        yield Static(id="whole")


def lines(n: int, origin: str = DRAFT) -> list[Span]:
    """n lines of text, each a span ending its line, long enough to wrap."""
    return [Span(f"line {i} " + "words that wrap " * 4 + "\n", origin) for i in range(n)]


def blocks(view: ReplyView) -> list[str]:
    return [str(b.render()) for b in view.query_children(Static)]


async def grow(app: Host, pilot, spans: list[Span]) -> None:
    """Add spans round by round, as the app does, and let the screen settle."""
    for span in spans:
        app.view.reply.spans.append(span)
        app.view.changed()
    app.query_one("#whole", Static).update(app.view.content)
    await pilot.pause()
    await pilot.pause()


@aio
async def test_settled_lines_move_into_blocks_and_the_view_shows_the_same_text():
    app = Host(Reply(linger=None))
    async with app.run_test(size=(80, 200)) as pilot:
        await grow(app, pilot, lines(30) + [Span("the live end", TARGET)])
        view = app.view
        parts = blocks(view)
        assert len(parts) >= 2  # settled text in blocks of about BLOCK_CHARS
        assert all(len(p) + 1 >= BLOCK_CHARS for p in parts)
        tail = str(view._tail.render())  # noqa: SLF001
        assert tail.endswith("the live end")
        assert "\n".join([*parts, tail]) == view.content.plain
        # line for line what one widget draws: the same height at the same width
        whole = app.query_one("#whole", Static)
        assert view.size.height == whole.size.height > 30


@aio
async def test_a_lingering_rejected_draft_keeps_what_follows_out_of_the_blocks():
    reply = Reply(linger=60.0)
    app = Host(reply)
    async with app.run_test(size=(80, 200)) as pilot:
        rejected = Span("gone soon ", REJECTED, expires=1e18)
        await grow(app, pilot, lines(8) + [rejected] + lines(30))
        view = app.view
        assert "gone soon" not in "".join(blocks(view))
        settled = view.settled
        assert settled <= view.reply.spans.index(rejected)  # no block past it
        rejected.expires = 0.0
        view.expire()
        await pilot.pause()
        assert len(blocks(view)) > 1 and view.settled > settled
        assert "gone soon" not in view.content.plain
        tail = str(view._tail.render())  # noqa: SLF001
        assert "\n".join([*blocks(view), tail]) == view.content.plain


@aio
async def test_hiding_rejected_drafts_draws_the_blocks_again():
    spans = lines(10) + [Span("struck ", REJECTED)] + lines(20)
    app = Host(Reply(linger=None))
    async with app.run_test(size=(80, 200)) as pilot:
        await grow(app, pilot, spans)
        view = app.view
        assert "struck" in "".join(blocks(view))
        view.show_rejected = False
        await pilot.pause()
        assert "struck" not in "".join(blocks(view)) and blocks(view)
        tail = str(view._tail.render())  # noqa: SLF001
        assert "\n".join([*blocks(view), tail]) == view.content.plain
        assert "struck" not in view.content.plain


@aio
async def test_a_hidden_rejected_draft_never_ends_a_block():
    """With rejected drafts hidden, a block ends at a shown line's end, never at a hidden one's
    (its crop would take a shown character)."""
    hidden = Span("struck\n", REJECTED)
    spans = [Span("x" * (BLOCK_CHARS + 10), DRAFT), hidden, *lines(3)]
    app = Host(Reply(linger=None))
    app.view.show_rejected = False
    async with app.run_test(size=(80, 200)) as pilot:
        await grow(app, pilot, spans)
        view = app.view
        parts = blocks(view)
        assert parts and parts[0].startswith("x" * (BLOCK_CHARS + 10) + "line 0")
        tail = str(view._tail.render())  # noqa: SLF001
        assert "\n".join([*parts, tail]) == view.content.plain
