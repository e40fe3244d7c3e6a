"""macspec: exact speculative decoding for local LLMs on MLX."""

from .base import platform_info

# Before mlx.core is first imported (by .api): MLX's BLAS calls then bind to OpenBLAS (Linux).
platform_info.load_fast_blas()

from .api import distributed  # noqa: E402 (`from macspec import distributed`)
from .api.options import GenerationOptions  # noqa: E402
from .api.pair import Pair, load  # noqa: E402
from .api.stream import (  # noqa: E402
    GenerationResult,
    GenerationStats,
    GenerationStream,
    RoundEvent,
    generate,
    stream_generate,
)
from .base.errors import (  # noqa: E402
    CacheError,
    CompatError,
    ConvertError,
    MacspecError,
    MacspecWarning,
    ModelError,
    OptionError,
    PromptError,
)
from .base.platform_info import BlasWarning  # noqa: E402
from .core.sampling import SamplingOptions  # noqa: E402

# The CPU package's kernels join the core (core/hooks.py) when a model is first loaded
# (api/loading.py), not on import.

__version__ = "0.1.0"

__all__ = [
    "BlasWarning",
    "CacheError",
    "CompatError",
    "ConvertError",
    "GenerationOptions",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "MacspecError",
    "MacspecWarning",
    "ModelError",
    "OptionError",
    "Pair",
    "PromptError",
    "RoundEvent",
    "SamplingOptions",
    "distributed",
    "generate",
    "load",
    "stream_generate",
]
