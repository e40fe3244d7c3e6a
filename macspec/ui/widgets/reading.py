"""A long prompt's reading as a bar: how much is read, and when the answer will start."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.reactive import reactive
from textual.widgets import Label, ProgressBar


class ReadingBar(Horizontal):
    """Shown while a message's prompt is read (`read` of `total` ids, `read < total`), hidden
    otherwise. A pasted file takes tens of seconds to read on a CPU before the first token;
    the bar's estimate of the time left comes from the rate of the turns read so far."""

    DEFAULT_CSS = """
    ReadingBar {
        height: 1;
        display: none;
    }
    """

    read: reactive[int] = reactive(0)
    total: reactive[int] = reactive(0)

    def __init__(self, *, eta: bool = True, id: str | None = None) -> None:
        super().__init__(id=id)
        self.eta = eta  # screenshots leave out the estimate, which depends on time

    def compose(self) -> ComposeResult:
        yield Label("prompt ", id="reading-label")
        # Determinate from the start: an indeterminate bar animates 15 times a second, hidden
        # or not, and every frame drawn shares the cores with the answer.
        yield ProgressBar(total=1, show_eta=self.eta, id="reading-progress")

    def show(self, read: int, total: int) -> None:
        """The reading has reached `read` of `total` ids; the bar hides once all are read."""
        if self.total != total or read < self.read:  # a new prompt: its own rate and estimate
            bar = self.query_one(ProgressBar)
            bar.update(total=None)  # (a new total restarts the estimate; the same one would not)
            bar.update(total=total, progress=0)
        self.total, self.read = total, read

    def hide(self) -> None:
        self.read = self.total = 0

    def watch_read(self, read: int) -> None:
        self.query_one(ProgressBar).update(progress=read)
        self.display = 0 < read < self.total
