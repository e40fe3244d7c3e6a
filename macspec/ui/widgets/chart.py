"""A Sparkline of accepted drafts per round: one column per round, on a fixed 0..K scale.

Textual's Sparkline stretches few points over the width and scales to the data's own min/max, so
a run of fully accepted rounds would draw as a flat floor; here full bars mean all K accepted.
"""

from __future__ import annotations

from rich.color import Color
from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.style import Style
from textual.app import RenderResult as TextualRenderResult
from textual.reactive import reactive
from textual.widgets import Sparkline

BARS = " ▁▂▃▄▅▆▇█"


def _blend(a: Color, b: Color, t: float) -> Style:
    ra, rb = a.get_truecolor(), b.get_truecolor()
    mix = tuple(int(x + (y - x) * t) for x, y in zip(ra, rb, strict=True))
    return Style(color=Color.from_rgb(*mix))


class _Columns:
    def __init__(self, data: list[float], ceiling: float, height: int, low: Color, high: Color):
        self.data, self.ceiling, self.height = data, ceiling, height
        self.low, self.high = low, high

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        data = self.data[-width:]
        levels = self.height * (len(BARS) - 1)  # eighths of a cell, over all rows
        for row in reversed(range(self.height)):
            pad = width - len(data)
            yield Segment(" " * pad if row else "▁" * pad, Style(color=self.low))
            for value in data:
                ratio = max(0.0, min(1.0, value / self.ceiling)) if self.ceiling else 0.0
                filled = round(ratio * levels) - row * (len(BARS) - 1)
                if row == 0 and filled <= 0:
                    yield Segment("▁", Style(color=self.low))  # a visible floor for 0 accepted
                    continue
                bar = BARS[max(0, min(len(BARS) - 1, filled))]
                yield Segment(bar, _blend(self.low, self.high, ratio))
            if row:
                yield Segment.line()


class AcceptChart(Sparkline):
    """Accepted drafts per round (`data`); `ceiling` (the largest K used) is a full-height bar."""

    ceiling: reactive[float] = reactive(4.0)

    def __init__(self, *, ceiling: float = 4, id: str | None = None) -> None:
        super().__init__([], id=id)
        self.set_reactive(AcceptChart.ceiling, ceiling)

    def render(self) -> TextualRenderResult:
        _, base = self.background_colors
        low = base + self.get_component_styles("sparkline--min-color").color
        high = base + self.get_component_styles("sparkline--max-color").color
        data = list(self.data or [])
        return _Columns(data, self.ceiling, self.size.height, low.rich_color, high.rich_color)
