"""macspec's native CPU products (csrc/cpu_linear.cpp): built on this machine on first use, or
None, in which case every caller keeps mlx's own ops.

The extension is an MLX primitive: it joins MLX's graph like any op and runs on MLX's CPU stream.
It is compiled for this CPU (-march=native) with the system C++ compiler (which MLX's own CPU
`mx.compile` needs as well), against the installed mlx headers and the nanobind version whose
ABI the mlx wheel was built with, and cached under the macspec cache directory, one file per
(source, mlx, nanobind, Python, CPU) combination. Building takes a while, once (docs/cpu.md,
"figures behind the code"); nothing is downloaded. MACSPEC_NATIVE=0 turns it off; any failure
is remembered as the reason (STATE.ext_reason), logged at INFO (`macspec -v`) and
reported by `macspec doctor`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from ..base import switches
from ..base.logs import progress
from ..base.paths import native_dir
from .state import STATE

log = logging.getLogger("macspec.cpu")

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCE = SOURCE_DIR / "cpu_linear.cpp"  # the products, and the module's bindings
SOURCES = (
    SOURCE,
    *(
        SOURCE_DIR / f"cpu_{n}.cpp"
        for n in (
            *("layer", "attention", "block", "attn_mlp", "sample", "qfloat", "qint8"),
            *("q4rows", "q4rows_avx2", "q4wide", "q4packed"),
        )
    ),
)
HEADERS = tuple(
    SOURCE_DIR / f"{n}.h"
    for n in (
        *("common", "layer", "kv", "linear", "block", "vec16", "quant", "qdot", "qint8"),
        "attend_keys",
    )
)
MODULE = "_macspec_cpu"
# Compilers run at once at most (each may take ~1 GB of memory on the larger sources).
BUILD_JOBS = 4


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _paths() -> dict[str, str]:
    import nanobind

    nb = Path(nanobind.__file__).resolve().parent
    mlx_root = Path(mx.__file__).resolve().parent
    return {
        "nb": str(nb),
        "mlx_include": str(mlx_root / "include"),
        "mlx_lib": str(mlx_root / "lib"),
        "python_include": sysconfig.get_paths()["include"],
    }


def _key(cxx: str, arch: str) -> str:
    import nanobind

    parts = [
        *(path.read_bytes() for path in (*SOURCES, *HEADERS)),
        mx.__version__.encode(),
        nanobind.__version__.encode(),
        sys.version.encode(),
        platform.machine().encode(),
        cxx.encode(),
        _cpu_flags().encode(),
        arch.encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so that a cache shared by machines builds per CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _arch_flags(arch: str) -> tuple[str, ...]:
    """-march for a switches.NATIVE_ARCH choice; x86-64-v3-vnni is no GCC level of its own."""
    if arch == "x86-64-v3-vnni":
        return ("-march=x86-64-v3", "-mavxvnni")
    return (f"-march={arch}",)


def _build(cxx: str, out: Path, arch: str) -> None:
    p = _paths()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    common = [
        "-O3",
        "-fPIC",
        "-fvisibility=hidden",
        "-DNDEBUG",
        "-DNB_COMPACT_ASSERTIONS",
        "-fno-strict-aliasing",
        f"-I{p['python_include']}",
        f"-I{p['nb']}/include",
        f"-I{p['nb']}/ext/robin_map/include",
    ]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        nb_obj = Path(tmp, "nanobind.o")
        objs = [Path(tmp, source.stem + ".o") for source in SOURCES]
        lib = Path(tmp, MODULE + suffix)
        steps = [
            [cxx, "-std=c++17", *common, "-c", f"{p['nb']}/src/nb_combined.cpp", "-o", nb_obj],
            *(
                [
                    cxx,
                    "-std=c++20",
                    *_arch_flags(arch),
                    *common,
                    "-DNB_DOMAIN=mlx",  # mlx's own bindings' domain: mx.array passes through
                    f"-I{p['mlx_include']}",
                    "-c",
                    source,
                    "-o",
                    obj,
                ]
                for source, obj in zip(SOURCES, objs, strict=True)
            ),
            [
                cxx,
                "-shared",
                *objs,
                nb_obj,
                f"-L{p['mlx_lib']}",
                "-lmlx",
                f"-Wl,-rpath,{p['mlx_lib']}",
                "-o",
                lib,
            ],
        ]
        # The objects compile side by side (a first build took ~60 s one at a time on 2
        # cores); each is a separate compiler process, so threads suffice to wait on them.
        *compiles, link = steps
        with ThreadPoolExecutor(min(os.cpu_count() or 1, BUILD_JOBS)) as pool:
            done = list(pool.map(_run, compiles))
        for cmd, failed in zip(compiles, done, strict=True):  # the first failure, in order
            if failed is not None:
                raise RuntimeError(
                    f"{Path(cxx).name} could not build {Path(cmd[-1]).name}: {failed}"
                )
        if (failed := _run(link)) is not None:
            raise RuntimeError(f"{Path(cxx).name} could not build {lib.name}: {failed}")
        os.replace(lib, out)  # atomic: a concurrent build or reader sees the whole file


def _run(cmd: list) -> str | None:
    """Run one compiler command: None, or what it said when it failed."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if done.returncode:
        return done.stderr.strip()[-400:] or f"exit status {done.returncode}"
    return None


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _self_test(ext: ModuleType) -> None:
    """The products agree with mlx's on this machine, or the extension is not used."""
    x = mx.random.normal((3, 160), key=mx.random.key(0))
    w = mx.random.normal((40, 160), key=mx.random.key(1))
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    got = [ext.linear(x, w), ext.qlinear(x, wq, s, b, 32, 4)]
    want = [x @ w.T, mx.quantized_matmul(x, wq, s, b, group_size=32, bits=4)]
    for g, r in zip(got, want, strict=True):
        if not mx.allclose(g, r, rtol=1e-4, atol=1e-3).item():
            raise RuntimeError("its products differ from mlx's on this machine")
    # int8 activations: x rounded to 1/254 of each group's largest value, no more
    int8 = ext.qlinear(x, wq, s, b, 32, 4, int8=True)
    if not mx.allclose(int8, want[1], rtol=0.0, atol=0.02 * mx.abs(want[1]).max().item()).item():
        raise RuntimeError("its int8 products differ from mlx's on this machine")


def _why_not(cxx: str | None) -> str | None:
    """Why the extension is not built here, or None when it can be."""
    if not switches.NATIVE.value():
        return f"switched off ({switches.NATIVE} is off)"
    if platform.system() != "Linux":
        return "only built on Linux (macOS runs Metal, or Accelerate on its CPU)"
    if "avx2" not in _cpu_flags().split():
        # Its kernels are written and measured for x86-64 with AVX2 or AVX-512 only.
        return "only built for x86-64 CPUs with AVX2 (this CPU keeps mlx's products)"
    if cxx is None:
        return "no C++ compiler (install g++)"
    if importlib.util.find_spec("nanobind") is None:
        return "nanobind is not installed (pip install nanobind)"
    if missing := [path.name for path in (*SOURCES, *HEADERS) if not path.is_file()]:
        return f"its source is missing from the installed package ({', '.join(missing)})"
    return None


def load() -> ModuleType | None:
    """The extension (built first if needed), or None with STATE.ext_reason saying why."""
    if STATE.ext_tried:
        return STATE.ext
    threads = switches.NATIVE_THREADS.value()  # a malformed value is the caller's OptionError
    STATE.ext_tried = True
    cxx = _compiler()
    reason = _why_not(cxx)
    if reason is None:
        try:
            STATE.ext = _built(cxx, threads)
        except Exception as e:  # a failed build or an ABI mismatch: mlx's ops stay in use
            reason = f"{type(e).__name__}: {e}"
    STATE.ext_reason = reason
    if reason is not None:
        log.info("the native CPU kernels are not in use, mlx's own ops are: %s", reason)
    return STATE.ext


def _built(cxx: str, threads: int | None) -> ModuleType:
    """The extension for this machine, built first if it is not in the cache, self-tested."""
    arch = switches.NATIVE_ARCH.value()
    name = MODULE + (sysconfig.get_config_var("EXT_SUFFIX") or "")
    build = STATE.ext_build = _key(cxx, arch)
    path = native_dir() / build / name
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        # One build at a time: a second process (a test worker, a server beside a chat)
        # waits for it and loads its result instead of compiling a copy on the same cores.
        with _locked(path.parent / "build.lock"):
            if not path.is_file():
                progress(log, "building its CPU kernels for this machine (once)")
                _build(cxx, path, arch)
    ext = _load(path)
    if threads:
        ext.set_threads(threads)
    _self_test(ext)
    return ext


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (made if missing) while the block runs; the kernel
    drops it if the process dies."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(log, "waiting for another macspec process to build its CPU kernels (once)")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
