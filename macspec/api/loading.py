"""Loading one model directory for a pair: mlx-lm's loader (never a model's own code), the
backend's layer kernels, and the facts a pair needs of it (output rows, context length, caches)."""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..base.errors import MacspecError, ModelError
from ..core import caches, hooks
from ..cpu import install_default

log = logging.getLogger("macspec")


def load_model(
    path: Path, group: mx.distributed.Group | None = None, use_kernels: bool = True
) -> tuple[nn.Module, TokenizerWrapper, dict]:
    """(model, tokenizer, config) of a model directory; a ModelError naming it otherwise."""
    from mlx_lm.utils import load as mlx_load

    # The CPU package's kernels in the core (plain mlx where they do not apply), also where this
    # model's layers are not switched (use_kernels off): sampling runs them all the same.
    install_default()
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a model directory: config.json is missing")
    if not list(path.glob("model*.safetensors")):
        raise ModelError(f"{path} has no weights (model*.safetensors)")
    if group is not None:  # only this rank's part of the weights (tensor or pipeline parallel)
        from ..core import load_sharded

        return load_sharded(path, group)
    try:
        # Never trust_remote_code: a model directory must not run its own code.
        model, tokenizer, config = mlx_load(str(path), return_config=True)
    except MacspecError:
        raise
    except Exception as e:  # mlx-lm raises ValueError/KeyError/RuntimeError from deep inside
        raise ModelError(f"cannot load the model in {path}: {type(e).__name__}: {e}") from e
    if use_kernels:
        changed = hooks.accelerate_model(model)  # the CPU package's layers, where installed
        log.info(
            "%s: %d decoder layers switched by the %r hooks",
            path.name,
            changed,
            hooks.installed().name,
        )
    return model, tokenizer, config


def embedding_rows(model: nn.Module) -> int:
    # The logits width is the only architecture-independent way to count output rows.
    return int(model(mx.array([[0]])).shape[-1])


def tokenizer_vocab(tokenizer: TokenizerWrapper) -> int:
    """Ids the tokenizer knows (mlx-lm's wrapper holds the Hugging Face tokenizer)."""
    return len(tokenizer._tokenizer)


def context_length(config: dict) -> int:
    for cfg in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_ctx", "max_seq_len", "seq_length"):
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return cfg[key]
    return 1 << 20  # unknown: do not invent a limit


def checked_caches(model: nn.Module, where: Path, role: str, vocab: int) -> dict[str, int]:
    """The model's cache kinds; refuses, before any output, one speculation cannot rewind."""
    try:
        return caches.check(model, vocab)
    except ModelError as e:
        raise ModelError(
            f"the {role} model ({where}) cannot speculate exactly: {e}; "
            "decode it plainly (speculative=False, or no draft)"
        ) from None
