"""One assistant reply in the conversation, every token in the style of where it came from."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static

from ..transcript import REJECTED, Reply, Span
from .legend import STYLES

# A reply's settled text is moved into a block of its own once this much of it ends a line:
# Textual renders a widget's whole text each time it repaints it, and a round repaints the reply.
BLOCK_CHARS = 400


class ReplyView(Widget):
    """Draws `reply`, which grows in place round by round: `changed()` redraws it.

    What can no longer change (every span up to a line's end, with no rejected draft still
    lingering among them) goes into blocks that are drawn once; a round repaints only the
    live end (`_Tail`), so a long answer costs each frame what its last lines cost. The screen
    is laid out again only when the end's height changes: a layout repaints every widget, and on
    a CPU the drawing shares the cores with the answer (docs/chat.md). Rejected drafts are
    struck through while they linger (`expire()` drops them when their time is up) and hidden
    altogether without `show_rejected`.
    """

    DEFAULT_CSS = """
    ReplyView {
        height: auto;
    }
    ReplyView > Static, ReplyView > _Tail {
        height: auto;
    }
    """

    show_rejected: reactive[bool] = reactive(True)

    def __init__(self, reply: Reply, *, show_rejected: bool = True) -> None:
        super().__init__(classes="message assistant")
        self.reply = reply  # grows in place: changed() redraws what changed
        self.set_reactive(ReplyView.show_rejected, show_rejected)
        self.writing = True  # rounds may still come
        self.fading = reply.linger is not None  # rejected drafts may still expire
        self.settled = 0  # reply.spans[:settled] are drawn in blocks
        self._tail = _Tail(self)

    def compose(self) -> ComposeResult:
        yield self._tail

    @property
    def content(self) -> Text:
        """The text shown: the reply's spans in their styles."""
        return self.text(self.reply.spans)

    def text(self, spans: list[Span]) -> Text:
        text = Text()
        for span in spans:
            if span.origin == REJECTED and not self.show_rejected:
                continue
            text.append(span.text, style=STYLES[span.origin])
        return text

    def changed(self) -> None:
        """The reply grew (or lost rejected drafts): redraw its end."""
        self._settle()
        self._tail.changed()

    def _settle(self) -> None:
        """Move the settled spans past BLOCK_CHARS, up to a line's end, into a block."""
        spans, size, end = self.reply.spans, 0, None
        for i in range(self.settled, len(spans)):
            span = spans[i]
            if span.origin == REJECTED and span.expires is not None:
                break  # it will go: what follows moves back
            if span.origin == REJECTED and not self.show_rejected:
                continue  # not drawn: a block cannot end at its line's end
            size += len(span.text)
            if span.text.endswith("\n") and size >= BLOCK_CHARS:
                end = i + 1
        if end is None or not self.is_mounted:
            return
        block = self.text(spans[self.settled : end])
        block.right_crop(1)  # its line's end: the next block or the tail starts a line anyway
        self.settled = end
        self.mount(Static(block), before=self._tail)

    def watch_show_rejected(self) -> None:
        """Shown or hidden, the rejected drafts change every block: draw them again."""
        if self.is_mounted:
            self.query_children(Static).remove()
            self.settled = 0
            self.changed()

    def done(self) -> None:
        """No more rounds: the last rejected drafts fade like the others, then checks stop."""
        self.writing = False
        self.expire()

    def expire(self) -> None:
        """Drop rejected drafts whose time is up (the conversation calls this a few times a
        second)."""
        if not self.fading:
            return
        if self.reply.expire():
            self.changed()
        if not self.writing and not self.reply.pending_rejected():
            self.fading = False


class _Tail(Widget):
    """The reply's live end: the spans not yet in a block."""

    def __init__(self, view: ReplyView) -> None:
        super().__init__()
        self.view = view
        self._fitting = False  # a height check is queued for after the next paint

    def render(self) -> Text:
        view = self.view
        return view.text(view.reply.spans[view.settled :])

    def changed(self) -> None:
        """Repaint, and check the height once the frame is painted."""
        self.refresh()
        if not self._fitting:
            self._fitting = True
            self.call_after_refresh(self._fit)

    def _fit(self) -> None:
        """Lay the screen out again if the end now wraps to another number of lines (the
        conversation follows it)."""
        self._fitting = False
        width = self.size.width
        if not width or not self.is_mounted:
            return
        if self.get_content_height(self.size, self.screen.size, width) != self.size.height:
            self.refresh(layout=True)
