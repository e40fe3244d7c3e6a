"""One assistant reply in the conversation, every token in the style of where it came from."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ..transcript import REJECTED, Reply
from .legend import STYLES


class ReplyView(Widget):
    """Draws `reply`, which grows in place round by round: `changed()` redraws it.

    The text is built when Textual paints, at most once a frame however many rounds arrived
    in between, so a long reply costs one pass over its spans per frame, not one per round.
    Rejected drafts are struck through while they linger (`expire()` drops them when their time
    is up) and hidden altogether without `show_rejected`.
    """

    DEFAULT_CSS = """
    ReplyView {
        height: auto;
    }
    """

    reply: reactive[Reply] = reactive(Reply, layout=True)
    show_rejected: reactive[bool] = reactive(True, layout=True)

    def __init__(self, reply: Reply, *, show_rejected: bool = True) -> None:
        super().__init__(classes="message assistant")
        self.set_reactive(ReplyView.reply, reply)
        self.set_reactive(ReplyView.show_rejected, show_rejected)
        self.writing = True  # rounds may still come
        self.fading = reply.linger is not None  # rejected drafts may still expire

    @property
    def content(self) -> Text:
        """The text shown: the reply's spans in their styles."""
        text = Text()
        for span in self.reply.spans:
            if span.origin == REJECTED and not self.show_rejected:
                continue
            text.append(span.text, style=STYLES[span.origin])
        return text

    def render(self) -> Text:
        return self.content

    def changed(self) -> None:
        """The reply grew (or lost rejected drafts): redraw it."""
        self.mutate_reactive(ReplyView.reply)

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
