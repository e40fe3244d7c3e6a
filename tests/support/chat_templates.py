"""Real chat templates of the model families the server parses tool calls for (never committed:
their models' terms apply). llama.cpp keeps them as test data, and llama-cpp-python's source
distribution on PyPI carries llama.cpp: it is fetched once with pip, checked against the pinned
hash, and only the templates named here are kept, outside the repository."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from support.gemma_file import cache_dir

REQUIREMENT = "llama-cpp-python==0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
INSIDE = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"
NAMES = {
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "hermes3": "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "llama3.2": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "llama3.3": "meta-llama-Llama-3.3-70B-Instruct.jinja",
    "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "mistral-small-3.2": "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "gemma2": "google-gemma-2-2b-it.jinja",
    "gemma4": "google-gemma-4-31B-it.jinja",
}


class Unreachable(Exception):
    """PyPI could not be reached (tests skip)."""


def templates() -> dict[str, str]:
    """Name -> template text, fetched on first use."""
    where = cache_dir() / "chat-templates-0.3.36"
    if not all((where / f).is_file() for f in NAMES.values()):
        _fetch(where)
    return {name: (where / f).read_text() for name, f in NAMES.items()}


def _fetch(where: Path) -> None:
    where.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=where.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:"]
        cmd += ["--disable-pip-version-check", "--dest", tmp, REQUIREMENT]
        if subprocess.run(cmd, capture_output=True, check=False).returncode != 0:
            raise Unreachable(f"pip could not download {REQUIREMENT}")
        sdist = next(Path(tmp).glob("*.tar.gz"))
        if hashlib.sha256(sdist.read_bytes()).hexdigest() != SHA256:
            raise RuntimeError(f"{sdist.name} does not have sha256 {SHA256}")  # fail, not skip
        out = Path(tmp) / "templates"
        out.mkdir()
        with tarfile.open(sdist) as tar:
            for f in NAMES.values():
                member = tar.extractfile(INSIDE + f)
                (out / f).write_bytes(member.read())
        if where.exists():  # another run fetched them meanwhile
            return
        out.replace(where)
