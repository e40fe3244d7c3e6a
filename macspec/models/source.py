"""What `macspec convert` reads: a GGUF file, a local Hugging Face directory, or a Hub repo
fetched with only the files an MLX model needs, after refusing anything that would run the
repository's own code."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from ..base.errors import ConvertError
from ..base.logs import progress

# Only what an MLX model needs: never pickles (*.bin, *.pth), code (*.py) or other formats.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
_REPO_RE = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")

log = logging.getLogger("macspec.models")


def source_kind(source: str) -> tuple[str, Any]:
    """("gguf", Path) | ("dir", Path) | ("hub", repo_id)."""
    from .gguf import is_gguf

    path = Path(source).expanduser()
    if path.is_file():
        if is_gguf(path):
            return "gguf", path.resolve()
        raise ConvertError(f"{path}: not a GGUF file nor a model directory")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConvertError(f"{path}: not a Hugging Face model directory (no config.json)")
        return "dir", path.resolve()
    if _REPO_RE.fullmatch(source) and ".." not in source and not source.startswith((".", "/")):
        return "hub", source
    raise ConvertError(
        f"{source!r} is neither an existing directory or GGUF file nor a Hugging Face repo id "
        "(like HuggingFaceTB/SmolLM2-135M-Instruct)"
    )


def download(repo_id: str, revision: str | None = None) -> Path:
    """Snapshot of a Hub repo (cached, resumable; HF_TOKEN is used for gated repos)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    progress(log, f"fetching {repo_id} (resumable; Hugging Face cache: {constants.HF_HUB_CACHE})")
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS)
    except GatedRepoError as e:
        raise ConvertError(
            f"{repo_id} is gated: accept its licence at https://huggingface.co/{repo_id} and set "
            "HF_TOKEN to a token of that account (or run `hf auth login`)"
        ) from e
    except RepositoryNotFoundError as e:
        raise ConvertError(
            f"{repo_id}: repository not found, or private and not readable with your token "
            "(set HF_TOKEN if it is yours)"
        ) from e
    except RevisionNotFoundError as e:
        raise ConvertError(f"{repo_id}: revision {revision!r} not found") from e
    except LocalEntryNotFoundError as e:
        raise ConvertError(
            f"cannot reach huggingface.co and {repo_id} is not in the local cache: connect to the "
            "internet (or unset HF_HUB_OFFLINE), or convert a local directory or GGUF file"
        ) from e
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise ConvertError(f"{repo_id}: not authorised (HTTP {status}); set HF_TOKEN") from e
        raise ConvertError(f"{repo_id}: download failed ({e})") from e
    except OSError as e:
        raise ConvertError(f"{repo_id}: download failed ({e})") from e
    return Path(path)


def check_safe(src: Path) -> dict:
    """The source's config, after refusing anything that would need the repo's own Python code."""
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConvertError(f"{src / 'config.json'}: unreadable ({e})") from e
    tok_config = {}
    if (src / "tokenizer_config.json").is_file():
        try:
            tok_config = json.loads((src / "tokenizer_config.json").read_text())
        except ValueError as e:
            raise ConvertError(f"{src / 'tokenizer_config.json'}: unreadable ({e})") from e
    for file, cfg in (("config.json", config), ("tokenizer_config.json", tok_config)):
        code = [k for k in ("auto_map", "model_file") if k in cfg]
        if code:
            raise ConvertError(
                f"{src / file} asks to run the repository's own Python code ({', '.join(code)}); "
                "macspec never executes code from a model repo (no trust_remote_code). Use a model "
                "whose architecture mlx-lm implements itself."
            )
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except (ValueError, KeyError, ImportError) as e:
        raise ConvertError(
            f"{src}: architecture {config.get('model_type')!r} is not supported by mlx-lm ({e})"
        ) from e
    if not any(src.glob("*.safetensors")):
        raise ConvertError(
            f"{src}: no *.safetensors weights (macspec does not load pickled PyTorch .bin files)"
        )
    return config
