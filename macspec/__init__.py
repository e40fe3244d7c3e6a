"""macspec: exact speculative decoding for local LLMs on MLX."""

from .api import (
    GenerationResult,
    GenerationStats,
    GenerationStream,
    Pair,
    RoundEvent,
    generate,
    load,
    stream_generate,
)
from .errors import CompatError, ConvertError, MacspecError, ModelError, OptionError, PromptError
from .sampling import SamplingOptions

__version__ = "0.1.0"

__all__ = [
    "CompatError",
    "ConvertError",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "MacspecError",
    "ModelError",
    "OptionError",
    "Pair",
    "PromptError",
    "RoundEvent",
    "SamplingOptions",
    "generate",
    "load",
    "stream_generate",
]
