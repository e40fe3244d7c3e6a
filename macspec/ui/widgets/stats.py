"""The side panel's figures for the answer being written: the engine's running statistics."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ..transcript import Reply, num, pct

HIDDEN = "·"  # timing numbers change run to run; screenshots hide them


class StatsPanel(Widget):
    """Rounds, tokens, acceptance and speed of `reply` (its latest RoundEvent's statistics).

    A reply grows in place, round by round: `always_update` redraws on every assignment, also
    of the same reply, and the table is built when Textual paints (once a frame, however many
    rounds came). With `timings=False` the numbers that depend on time show as `·`.
    """

    DEFAULT_CSS = """
    StatsPanel {
        height: auto;
    }
    """
    BORDER_TITLE = "this answer"

    # Its rows are fixed: a new round repaints the panel alone (no layout of the screen).
    reply: reactive[Reply | None] = reactive(None, always_update=True)

    def __init__(self, *, timings: bool = True, id: str | None = None) -> None:
        super().__init__(id=id)
        self.timings = timings

    @property
    def content(self) -> Text:
        """The text shown: one row per figure."""
        text = Text()
        rows = self.rows(self.reply)
        for i, (name, value) in enumerate(rows):
            text.append(f"{name:<14}", style="dim")
            text.append(value, style="bold")
            if i < len(rows) - 1:
                text.append("\n")
        return text

    def render(self) -> Text:
        return self.content

    def rows(self, reply: Reply | None) -> list[tuple[str, str]]:
        stats = reply.stats if reply is not None else None

        def timing(text: str) -> str:
            return text if self.timings else HIDDEN

        drafted = bool(stats and stats.drafted)
        plain = 1 / stats.plain_step_time if stats and stats.plain_step_time else None
        return [
            ("rounds", str(stats.rounds if stats else 0)),
            ("tokens", str(stats.generated_tokens if stats else 0)),
            ("round speedup", timing(f"{num(reply and reply.last_speedup)}x")),
            ("acceptance", pct(stats.acceptance_rate if drafted else None)),
            ("accept length", num(stats.mean_accepted_length if drafted else None)),
            ("last round", (reply.last_round if reply is not None else "") or "–"),
            ("tok/s", timing(num(stats.tokens_per_second if stats else None, 1))),
            ("plain tok/s", timing(num(plain, 1))),
            ("overall", timing(f"{num(stats.speedup if stats else None)}x")),
        ]
