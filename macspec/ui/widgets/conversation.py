"""The conversation: the user's messages, the replies, errors; it follows the end as it grows."""

from __future__ import annotations

from rich.text import Text
from textual.containers import VerticalScroll
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static

from ..transcript import Reply
from .reply import ReplyView

EXPIRE_INTERVAL = 0.2  # seconds between checks for rejected drafts whose time is up


class Conversation(VerticalScroll):
    """Messages (`add`) and replies (`add_reply`), each a widget; `show_rejected` reaches every
    reply. Anchored: it follows the answer unless the user scrolled up to read."""

    show_rejected: reactive[bool] = reactive(True)

    def on_mount(self) -> None:
        self.set_interval(EXPIRE_INTERVAL, self._expire)

    @property
    def replies(self) -> list[ReplyView]:
        return list(self.query_children(ReplyView))

    def add(self, content: Text, kind: str) -> Static:
        """A message of `kind` (a class in chat.tcss: user, system, error)."""
        view = Static(content, classes=f"message {kind}")
        self._append(view)
        return view

    def add_reply(self, reply: Reply) -> ReplyView:
        view = ReplyView(reply, show_rejected=self.show_rejected)
        self._append(view)
        return view

    def clear(self) -> None:
        self.remove_children()

    def _append(self, view: Widget) -> None:
        self.mount(view)
        self.anchor()  # to the end, and follow

    def watch_show_rejected(self, shown: bool) -> None:
        for view in self.replies:
            view.show_rejected = shown

    def _expire(self) -> None:
        for view in self.replies:
            view.expire()
