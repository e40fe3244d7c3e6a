"""The chat app's widgets, one a module: each holds reactive state and draws itself from it."""

from __future__ import annotations

from .chart import AcceptChart
from .conversation import Conversation
from .legend import STYLES, Legend
from .prompt import PromptBox, shortened
from .reading import ReadingBar
from .reply import ReplyView
from .settings import SettingsPanel
from .stats import StatsPanel

__all__ = [
    "STYLES",
    "AcceptChart",
    "Conversation",
    "Legend",
    "PromptBox",
    "ReadingBar",
    "ReplyView",
    "SettingsPanel",
    "StatsPanel",
    "shortened",
]
