"""The chat front ends: the Textual app (`create_app`) and the plain ANSI stream (`run_plain`)."""

from __future__ import annotations

from typing import Any


def create_app(engine_or_pair: Any, **options: Any) -> Any:
    """Build the `macspec chat` app around a loaded pair; see `macspec.ui.app.create_app`."""
    from .app import create_app as _create_app  # Textual loads only when the app is wanted

    return _create_app(engine_or_pair, **options)


__all__ = ["create_app"]
