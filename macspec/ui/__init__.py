"""The chat front ends: the Textual app (`create_app`) and the plain ANSI stream (`run_plain`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..api.pair import Pair
    from .app import ChatApp


def create_app(pair: Pair, **options: Any) -> ChatApp:
    """Build the `macspec chat` app around a loaded pair; see `macspec.ui.app.create_app`."""
    from .app import create_app as _create_app  # Textual loads only when the app is wanted

    return _create_app(pair, **options)


__all__ = ["create_app"]
