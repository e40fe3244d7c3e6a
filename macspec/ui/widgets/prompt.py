"""The message box: Enter sends, a paste goes in whole. Textual's one-line Input keeps only a
paste's first line, so a pasted file (the long prompts docs/benchmarks.md measures) lost all but
its first line; a TextArea keeps every line."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea

SHOWN_LINES = 24  # of a long message, the conversation shows this many lines (all are sent)


def shortened(message: str) -> str:
    """A message as the conversation shows it: a pasted file's first SHOWN_LINES lines and how
    many more were sent (drawing thousands of lines slows every later update)."""
    lines = message.splitlines()
    if len(lines) <= SHOWN_LINES:
        return message
    more = len(lines) - SHOWN_LINES
    return "\n".join([*lines[:SHOWN_LINES], f"… {more:,} more line{'s' if more > 1 else ''} sent"])


class PromptBox(TextArea):
    """Several lines of message. Enter sends it (`Submitted`); ctrl+j, or shift+enter where the
    terminal tells it from Enter, starts a new line; a paste keeps its newlines. The box grows
    with its text up to its style's max-height, then scrolls."""

    @dataclass
    class Submitted(Message):
        """Enter in the box: its whole text (the box is left as it is; the app clears it)."""

        box: PromptBox
        value: str

        @property
        def control(self) -> PromptBox:
            return self.box

    def __init__(self, placeholder: str = "", id: str | None = None) -> None:
        super().__init__(
            id=id,
            soft_wrap=True,
            tab_behavior="focus",
            highlight_cursor_line=False,
            placeholder=placeholder,
        )

    async def _on_key(self, event: events.Key) -> None:
        # Here, not in BINDINGS: a binding's action runs after the keys that came with it (a
        # terminal's burst), which would land before the new line.
        if event.key in ("enter", "ctrl+j", "shift+enter"):
            event.stop()
            event.prevent_default()
            if event.key == "enter":  # (TextArea would insert a newline)
                self.post_message(self.Submitted(self, self.text))
            else:
                self.replace("\n", *self.selection, maintain_selection_offset=False)
            return
        await super()._on_key(event)
