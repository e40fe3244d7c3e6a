"""Async tests (Textual's Pilot) run on a fresh event loop, with no pytest async plugin."""

from __future__ import annotations

import asyncio
import functools


def aio(test):
    """Run an async test on a fresh event loop."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run
