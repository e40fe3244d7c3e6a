"""Turning a conversation into the target's prompt string, shared by the app and the plain mode."""

from __future__ import annotations

import inspect
from typing import Any

from ..chat_template import render as chat_prompt  # noqa: F401 (the app and plain mode use it)

# options the engine's generate()/stream_generate() take; the chat passes only these through
GENERATION_OPTIONS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "num_draft",
    "seed",
    "adaptive",
)


def engine_defaults() -> dict[str, Any]:
    """The engine's own defaults for the generation options (shown in the UI before any change)."""
    import macspec

    params = inspect.signature(macspec.stream_generate).parameters
    if not any(name in params for name in GENERATION_OPTIONS):  # **kwargs wrapper: ask generate()
        params = inspect.signature(macspec.generate).parameters
    return {
        name: p.default
        for name, p in params.items()
        if name in GENERATION_OPTIONS and p.default is not inspect.Parameter.empty
    }
