"""The side panel's settings for the next answer: K (draft length) and temperature."""

from __future__ import annotations

from typing import Any

from textual.reactive import reactive
from textual.widgets import Static


def settings_line(options: dict[str, Any]) -> str:
    """K, temperature and seed as one line (K 0 is plain decoding)."""
    k, t = options.get("num_draft"), options.get("temperature")
    if k == 0:
        line = "K 0 (plain)"
    elif options.get("adaptive"):
        line = f"K ≤{k} adaptive"
    else:
        line = f"K {k}"
    line += f"   T {float(t or 0):.1f}"
    seed = options.get("seed")
    if seed is not None:
        line += f"   seed {seed}"
    return line


class SettingsPanel(Static):
    """The generation options the next answer will use; assign a new dict to redraw."""

    BORDER_TITLE = "next answer"

    options: reactive[dict[str, Any]] = reactive(dict)

    def watch_options(self, options: dict[str, Any]) -> None:
        self.update(settings_line(options))
