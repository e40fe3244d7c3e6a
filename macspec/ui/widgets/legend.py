"""The legend: what each token style means, and whether rejected drafts are shown."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from ..transcript import DRAFT, REJECTED, TARGET

# Okabe-Ito colours (safe for common colour-blindness) plus a style: origin never hangs on hue
STYLES = {
    DRAFT: "#56b4e9",
    TARGET: "bold #e69f00",
    REJECTED: "strike #cc79a7",
}
LABELS = {
    DRAFT: "draft, accepted",
    TARGET: "target's own token",
    REJECTED: "draft, rejected",
}


class Legend(Static):
    """A sample word in each origin's style, and ctrl+r's state."""

    BORDER_TITLE = "tokens"

    show_rejected: reactive[bool] = reactive(True)

    def watch_show_rejected(self, shown: bool) -> None:
        text = Text()
        for origin, label in LABELS.items():
            text.append("word", style=STYLES[origin])
            text.append(f" {label}\n")
        text.append("(ctrl+r: " + ("shown" if shown else "hidden") + ")", style="dim")
        self.update(text)
