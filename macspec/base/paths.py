"""Where macspec keeps what it makes on this machine: everything under one cache directory,
`$MACSPEC_HOME` or the platform's (`~/.cache/macspec` on Linux)."""

from __future__ import annotations

import logging
from pathlib import Path

from . import switches


def cache_home() -> Path:
    """`$MACSPEC_HOME`, else `<platform cache dir>/macspec`."""
    home = switches.HOME.value()
    if home is not None:
        return home
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("macspec", appauthor=False))
    except ImportError:  # platformdirs comes with huggingface-hub; this is a fallback only
        logging.getLogger("macspec").info("no platformdirs: the cache is ~/.cache/macspec")
        return Path.home() / ".cache" / "macspec"


def models_dir() -> Path:
    """The model store (models/store.py)."""
    return cache_home() / "models"


def native_dir() -> Path:
    """The CPU extension built for this machine, one folder per build (cpu/native.py)."""
    return cache_home() / "native"


def costs_dir() -> Path:
    """Long-context costs kept between loads (kept_costs.py)."""
    return cache_home() / "costs"
