"""What macspec runs on: backend, device, BLAS library, and the weight format that is fastest there.

On Linux the ``mlx[cpu]`` wheel links the reference BLAS, which makes float32 products ~35x slower
than OpenBLAS and makes a K-row verification cost ~K single steps. ``ensure_fast_blas`` re-executes
the ``macspec`` command once with Debian's OpenBLAS preloaded; mlx's ``cblas_sgemm`` binds to it.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Set in the re-executed child so that a failed or refused preload never loops.
REEXEC_ENV = "MACSPEC_BLAS_REEXEC"
OPT_OUT_ENV = "MACSPEC_NO_BLAS_PRELOAD"
# Debian/Ubuntu package libopenblas0-pthread (and -openmp, -serial) install these.
OPENBLAS_PACKAGE = "libopenblas0-pthread"
_OPENBLAS_VARIANTS = ("openblas-pthread", "openblas-openmp", "openblas-serial", "")
# Library name fragments, fastest family first; the first one mapped into the process wins.
_BLAS_FAMILIES = (
    ("openblas", "openblas"),
    ("mkl_rt", "mkl"),
    ("libmkl", "mkl"),
    ("libblis", "blis"),
    ("flexiblas", "flexiblas"),
    ("libcblas", "reference"),
    ("libblas", "reference"),
)


def openblas_candidates() -> list[Path]:
    """Where Debian-family systems put ``libopenblas.so.0`` for this machine's architecture."""
    machine = platform.machine() or "x86_64"
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.lower(), machine)
    paths = []
    for lib in (f"/usr/lib/{arch}-linux-gnu", "/usr/lib64", "/usr/lib"):
        for variant in _OPENBLAS_VARIANTS:
            paths.append(Path(lib, variant, "libopenblas.so.0"))
    # `pip install cmeel-openblas` ships unprefixed symbols too (it needs the system libgfortran5).
    for entry in sys.path:
        if entry.endswith("site-packages"):
            paths.append(Path(entry, "cmeel.prefix", "lib", "libopenblas.so.0"))
    return paths


def find_openblas() -> Path | None:
    """The first system OpenBLAS found, or None."""
    return next((p for p in openblas_candidates() if p.is_file()), None)


def mapped_libraries() -> list[str]:
    """Shared libraries mapped into this process (Linux only; empty elsewhere)."""
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    libs = []
    for line in text.splitlines():
        path = line.split()[-1] if line.split() else ""
        if path.startswith("/") and ".so" in path and path not in libs:
            libs.append(path)
    return libs


@dataclass(frozen=True)
class BlasInfo:
    kind: str  # openblas, mkl, blis, flexiblas, accelerate, reference, other, not loaded
    path: str | None  # the library file, when one is mapped

    @property
    def fast(self) -> bool:
        return self.kind in ("openblas", "mkl", "blis", "accelerate")

    def describe(self) -> str:
        return f"{self.kind} ({self.path})" if self.path else self.kind


def _global_symbol_library(symbol: str) -> str | None:
    """The file that defines ``symbol`` in the process's global scope (LD_PRELOAD comes first)."""
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(getattr(process, symbol), ctypes.c_void_p)
        info = DlInfo()
        if not process.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
            return None
        return os.fsdecode(info.dli_fname)
    except (AttributeError, OSError):
        return None


def _family(path: str) -> str:
    name = Path(path).name
    return next((kind for fragment, kind in _BLAS_FAMILIES if fragment in name), "other")


def blas_in_use(libs: list[str] | None = None) -> BlasInfo:
    """The BLAS that mlx's float32 products (``cblas_sgemm``) go through in this process.

    A library in the global scope (LD_PRELOAD, or loaded RTLD_GLOBAL) wins over the reference
    ``libblas`` that the mlx[cpu] wheel bundles and loads privately. numpy's ``scipy_openblas``
    does not count: its symbols are prefixed, so mlx cannot bind to it.
    """
    if sys.platform == "darwin":
        return BlasInfo("accelerate", None)
    if libs is None:
        found = _global_symbol_library("cblas_sgemm")
        if found:
            return BlasInfo(_family(found), found)
        libs = mapped_libraries()
    for lib in libs:
        name = Path(lib).name
        if "scipy_openblas" in name:
            continue
        if any(fragment in name for fragment, _ in _BLAS_FAMILIES):
            return BlasInfo(_family(lib), lib)
    return BlasInfo("not loaded", None)


def openblas_details() -> dict[str, Any] | None:
    """OpenBLAS's kernel set and thread count in this process, or None without OpenBLAS.

    The kernel set decides how cheap a few-row product is: on an AVX-512 CPU OpenBLAS 0.3.21
    picked Cooperlake kernels and a 5-token SmolLM2 pass cost 1.3x one token, against 1.6x
    with the AVX2 (Zen/Haswell) kernels of an older CPU. ``OPENBLAS_CORETYPE`` overrides it."""
    import ctypes

    try:
        process = ctypes.CDLL(None)
        corename = process.openblas_get_corename
        threads = process.openblas_get_num_threads
    except (AttributeError, OSError):
        return None
    corename.restype = ctypes.c_char_p
    threads.restype = ctypes.c_int
    return {"core": os.fsdecode(corename() or b"?"), "threads": int(threads())}


def _cuda_wheel_installed() -> bool:
    from importlib import metadata

    for name in ("mlx-cuda", "mlx-cuda-12", "mlx-cuda-13"):
        try:
            metadata.version(name)
            return True
        except metadata.PackageNotFoundError:
            continue
    return False


def preload_plan(env: dict[str, str] | None = None, libs: list[str] | None = None) -> Path | None:
    """The OpenBLAS to preload by re-executing, or None when nothing should be done."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or env.get(OPT_OUT_ENV, "") not in ("", "0"):
        return None
    if env.get(REEXEC_ENV):
        return None  # already re-executed once: whatever happened, do not loop
    if blas_in_use(libs).fast:
        return None
    lib = find_openblas()
    if lib is None or _cuda_wheel_installed():
        return None  # on CUDA the products run on the GPU, so the CPU BLAS does not matter
    return lib


def ensure_fast_blas() -> None:
    """Re-execute this command once with OpenBLAS preloaded when it can be had and is not loaded.

    A no-op on macOS (Accelerate), with mlx[cuda], with ``MACSPEC_NO_BLAS_PRELOAD=1``, when an
    optimized BLAS is already mapped, or when no system OpenBLAS is installed.
    """
    lib = preload_plan()
    if lib is None:
        return
    env = dict(os.environ)
    env[REEXEC_ENV] = str(lib)
    env["LD_PRELOAD"] = " ".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    argv[0] = sys.executable
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError:
        return  # cannot re-exec (odd launcher): run on at reference-BLAS speed


def detect_backend() -> str:
    """``metal``, ``cuda`` or ``cpu``: where mlx runs by default here."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def device_name() -> str:
    import mlx.core as mx

    try:
        name = mx.device_info().get("device_name", "")
    except (AttributeError, RuntimeError):
        name = ""
    if not name and Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return name or platform.processor() or platform.machine()


def cpu_has_avx512() -> bool:
    """Whether the CPU has AVX-512 (Linux: /proc/cpuinfo; False where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return "avx512f" in flags.split()


# OpenBLAS kernel sets built for AVX-512 (its names for them, lower-cased).
AVX512_OPENBLAS_CORES = ("skylakex", "cooperlake", "sapphirerapids")


def total_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class WeightFormat:
    dtype: str  # "float32", "bfloat16" or "4bit"
    reason: str


def choose_weight_format(
    param_count: int,
    backend: str | None = None,
    blas: BlasInfo | None = None,
    memory_bytes: int | None = None,
) -> WeightFormat:
    """The weight format whose products are fastest on this backend, memory allowing.

    Measured on an x86 CPU with OpenBLAS (SmolLM2-135M): one token costs 64 ms in float32, 97 ms
    in 4-bit, 153 ms in bfloat16, and 5 tokens cost 1.3x, 4.8x and 1.8x one token respectively:
    mlx's CPU quantized kernels scale with the row count, BLAS float32 products do not.
    """
    backend = backend or detect_backend()
    if backend in ("metal", "cuda"):
        return WeightFormat(
            "4bit", f"{backend} has fast quantized kernels; 4-bit reads 8x fewer bytes"
        )
    blas = blas or blas_in_use()
    memory_bytes = memory_bytes if memory_bytes is not None else total_memory_bytes()
    f32_bytes = 4 * param_count
    if not blas.fast:
        return WeightFormat(
            "4bit",
            f"CPU with {blas.kind} BLAS: float32 products are slow, install {OPENBLAS_PACKAGE}",
        )
    if memory_bytes is not None and f32_bytes > memory_bytes // 2:
        return WeightFormat(
            "bfloat16", f"float32 weights ({f32_bytes / 1e9:.1f} GB) exceed half of memory"
        )
    return WeightFormat(
        "float32",
        f"CPU with {blas.kind}: float32 BLAS products verify K tokens at near 1-token cost",
    )


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up: allocation and kernel set-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(megabytes: int = 128, repeats: int = 3) -> dict[str, float]:
    """Memory bandwidth in GB/s (bytes read + written) from large copies.

    ``mlx`` is an mlx element-wise copy (one CPU thread on the CPU backend); ``memcpy`` is numpy's
    copy, closer to what the memory system can do. Both are returned; ``best`` is their maximum.
    """
    import mlx.core as mx

    n = megabytes * 1024 * 1024 // 4
    a = mx.arange(n, dtype=mx.float32)
    mx.eval(a)
    mlx_s = _best_time(lambda: mx.eval(a + 0.0), repeats)
    result = {"mlx": 2 * a.nbytes / mlx_s / 1e9}
    try:
        import numpy as np

        x = np.arange(n, dtype=np.float32)
        y = np.empty_like(x)
        np_s = _best_time(lambda: np.copyto(y, x), repeats)
        result["memcpy"] = 2 * x.nbytes / np_s / 1e9
    except ImportError:
        pass
    result["best"] = max(result.values())
    return result


def measure_matmul_gflops(size: int = 1024, rows: int | None = None, repeats: int = 3) -> float:
    """float32 matrix-product speed in GFLOP/s (``rows`` x size times size x size)."""
    import mlx.core as mx

    m = rows or size
    a = mx.random.normal((m, size), key=mx.random.key(0))
    b = mx.random.normal((size, size), key=mx.random.key(1))
    mx.eval(a, b)
    seconds = _best_time(lambda: mx.eval(a @ b), repeats)
    return 2.0 * m * size * size / seconds / 1e9
