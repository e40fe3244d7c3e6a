"""Model caches that rewind exactly (rewind.py; window.py and recurrent.py for the layers mlx-lm's
own caches cannot take back), and the prompt cache that keeps them between prompts."""

from .prompt_cache import DraftState, Hit, PromptCache
from .recurrent import RecurrentCache
from .rewind import (
    EXACT_KINDS,
    TRIMMABLE,
    check,
    describe_kinds,
    forward,
    kinds,
    layers,
    length,
    make_cache,
    prefill,
    rewind,
    state_arrays,
    verify,
)
from .window import WindowKVCache

__all__ = [
    "EXACT_KINDS",
    "TRIMMABLE",
    "DraftState",
    "Hit",
    "PromptCache",
    "RecurrentCache",
    "WindowKVCache",
    "check",
    "describe_kinds",
    "forward",
    "kinds",
    "layers",
    "length",
    "make_cache",
    "prefill",
    "rewind",
    "state_arrays",
    "verify",
]
