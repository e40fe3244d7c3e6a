"""Logging: one logger per layer, and the lines macspec shows on stderr.

Each layer logs under its own name: `macspec.core`, `macspec.cpu`, `macspec.models`,
`macspec.server`, `macspec.ui`, `macspec.tools`, `macspec.cli`, and `macspec` for the modules at
the top (pair.py, api.py). A fallback (a kernel that cannot be built, a kept file that cannot be
read) logs why at INFO; long work (a download, a conversion, a build) logs progress notes, INFO
records marked `progress`.

Nothing is shown unless the program asks: the CLI calls `show()`, which writes progress notes and
warnings to stderr as `macspec: ...` lines, and every INFO record too with `-v`. A Python program
sees them with `logging.basicConfig(level=logging.INFO)` or `macspec.base.logs.show()`.
"""

from __future__ import annotations

import logging
import sys

# The loggers, one per layer: each module logs to logging.getLogger("macspec.<layer>").
LAYERS = ("core", "cpu", "models", "server", "ui", "tools", "cli")


def progress(log: logging.Logger, message: str, *args: object) -> None:
    """A note on long work, shown on stderr even when not verbose."""
    log.info(message, *args, extra={"progress": True})


class _Stderr(logging.Handler):
    """`macspec: ...` lines on stderr, looked up at each record (so a redirected stderr gets
    them): warnings and progress notes, and every INFO record when verbose."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.verbose = False

    def filter(self, record: logging.LogRecord) -> bool:
        return (
            self.verbose or record.levelno >= logging.WARNING or getattr(record, "progress", False)
        )

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            kind = "error: "
        elif record.levelno >= logging.WARNING:
            kind = "warning: "
        else:
            kind = ""
        try:
            sys.stderr.write(f"macspec: {kind}{record.getMessage()}\n")
            sys.stderr.flush()
        except Exception:  # a closed or broken stderr: logging must never raise
            self.handleError(record)


_handler = _Stderr()


def show(verbose: bool = False) -> None:
    """Write macspec's progress notes and warnings to stderr; with `verbose`, every INFO record
    (the reason for each fallback) too. For programs and the CLI: a library never calls it."""
    top = logging.getLogger("macspec")
    if _handler not in top.handlers:
        top.addHandler(_handler)
    top.setLevel(logging.INFO)
    _handler.verbose = verbose
