"""What macspec runs on: backend, device, BLAS library, and the weight format that is fastest there.

On Linux the ``mlx[cpu]`` wheel links the reference BLAS, which makes float32 products 10-30x slower
than OpenBLAS and makes a K-row verification cost ~K single steps. ``import macspec`` therefore
loads Debian's OpenBLAS into the global symbol scope before ``mlx.core`` is first imported, so
mlx's ``cblas_sgemm`` binds to it: in the ``macspec`` command and in Python scripts alike.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import switches
from .errors import MacspecWarning

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


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _library_of(address: int | None) -> str | None:
    """The shared library that holds ``address`` (dladdr), or None."""
    if not address:
        return None
    try:
        info = _DlInfo()
        if not ctypes.CDLL(None).dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
            return None
    except (AttributeError, OSError):
        return None
    return os.path.normpath(os.fsdecode(info.dli_fname)) if info.dli_fname else None


def _global_symbol_library(symbol: str) -> str | None:
    """The file that defines ``symbol`` in the process's global scope (LD_PRELOAD comes first)."""
    try:
        address = ctypes.cast(getattr(ctypes.CDLL(None), symbol), ctypes.c_void_p).value
    except (AttributeError, OSError):
        return None
    return _library_of(address)


def _got_slot(path: str, symbol: str) -> tuple[int, int] | None:
    """(GOT slot address, first PT_LOAD address) of ``symbol`` in a 64-bit little-endian ELF
    shared library, both relative to its load base before alignment; None if it has none."""
    with open(path, "rb") as f:

        def read(offset: int, size: int) -> bytes:
            f.seek(offset)
            return f.read(size)

        head = read(0, 64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return None
        phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
        phdrs = read(phoff, phentsize * phnum)
        vaddrs = [struct.unpack_from("<I12xQ", phdrs, i * phentsize) for i in range(phnum)]
        first_load = min((vaddr for kind, vaddr in vaddrs if kind == 1), default=0)  # PT_LOAD
        raw = read(shoff, shentsize * shnum)
        # (type, file offset, size, linked section) of each section
        sections = [struct.unpack_from("<4xI16xQQI", raw, i * shentsize) for i in range(shnum)]
        wanted = symbol.encode() + b"\0"
        for kind, offset, size, link in sections:
            if kind != 4:  # SHT_RELA (.rela.dyn, .rela.plt), whose symbols are in .dynsym
                continue
            _, sym_offset, sym_size, str_link = sections[link]
            strings = read(sections[str_link][1], sections[str_link][2])
            names = struct.iter_unpack("<I20x", read(sym_offset, sym_size))
            index = next((i for i, (n,) in enumerate(names) if strings.startswith(wanted, n)), None)
            if index is None:
                continue
            for slot, info, _addend in struct.iter_unpack("<QQq", read(offset, size)):
                if info >> 32 == index:
                    return slot, first_load
    return None


def _mlx_blas_library(symbol: str = "cblas_sgemm") -> str | None:
    """The library mlx really calls for ``symbol``: the address the dynamic linker wrote into
    libmlx's GOT slot. Loading OpenBLAS after mlx changes what dlsym finds, not what mlx calls."""
    maps = []
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                maps.append((start, end, int(parts[2], 16), parts[5]))
    except (OSError, ValueError):
        return None
    for path in dict.fromkeys(m[3] for m in maps if Path(m[3]).name.startswith("libmlx")):
        try:
            slot = _got_slot(path, symbol)
        except (OSError, struct.error, IndexError):
            continue
        base = next((start for start, _, off, p in maps if p == path and off == 0), None)
        if slot is None or base is None:
            continue
        address = base - (slot[1] & ~0xFFF) + slot[0]
        if not any(s <= address < e - 8 for s, e, _, p in maps if p == path):
            continue  # never read outside the library's own mappings
        return _library_of(ctypes.c_void_p.from_address(address).value)
    return None


def _family(path: str) -> str:
    name = Path(path).name
    return next((kind for fragment, kind in _BLAS_FAMILIES if fragment in name), "other")


def blas_in_use(libs: list[str] | None = None) -> BlasInfo:
    """The BLAS that mlx's float32 products (``cblas_sgemm``) go through in this process.

    Read from the slot mlx's calls go through once mlx is loaded; before that (or where the slot
    cannot be read), the global scope's ``cblas_sgemm`` (LD_PRELOAD, or a library loaded
    RTLD_GLOBAL), else the first BLAS mapped. numpy's ``scipy_openblas`` does not count: its
    symbols are prefixed, so mlx cannot bind to it. ``libs``: decide from this list alone.
    """
    if sys.platform == "darwin":
        return BlasInfo("accelerate", None)
    if libs is None:
        found = _mlx_blas_library() or _global_symbol_library("cblas_sgemm")
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

    The kernel set decides how cheap a few-row product is (AVX-512 kernels against AVX2 ones:
    the README's measurements). ``OPENBLAS_CORETYPE`` overrides it."""
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


class BlasWarning(MacspecWarning):
    """MLX's float32 products run on a slow BLAS although a fast one is installed."""


# What `import macspec` did: the OpenBLAS it loaded, or why it loaded none (for `macspec doctor`).
LOADED: Path | None = None
NOT_LOADED_REASON: str | None = None


def openblas_to_load(env: dict[str, str] | None = None) -> Path | None:
    """The OpenBLAS that ``load_fast_blas`` would load now, or None where nothing should be done:
    not Linux, opted out, a fast BLAS already in the global scope, none installed, or mlx[cuda]
    (its products run on the GPU)."""
    if not sys.platform.startswith("linux") or switches.NO_BLAS_PRELOAD.value(env):
        return None
    found = _global_symbol_library("cblas_sgemm")
    if found and _family(found) in ("openblas", "mkl", "blis"):
        return None
    lib = find_openblas()
    if lib is None or _cuda_wheel_installed():
        return None
    return lib


def load_fast_blas() -> Path | None:
    """Load OpenBLAS with RTLD_GLOBAL before ``mlx.core`` is first imported, so that mlx binds its
    BLAS calls to it (``import macspec`` does this); the library loaded, or None.

    Once mlx.core is loaded its calls are bound for good: then, if it runs on a slow BLAS while an
    OpenBLAS is installed, warn (BlasWarning) with the remedy. Opt out: MACSPEC_NO_BLAS_PRELOAD=1.
    """
    global LOADED, NOT_LOADED_REASON
    lib = openblas_to_load()
    if lib is None:
        return None
    if "mlx.core" in sys.modules:
        if not blas_in_use().fast:
            NOT_LOADED_REASON = "mlx.core was imported before macspec"
            warnings.warn(
                f"mlx.core was imported before macspec, so MLX's float32 products run on "
                f"{blas_in_use().describe()}, 10-30x slower than the installed OpenBLAS: "
                f"import macspec before mlx and mlx_lm, or start Python with LD_PRELOAD={lib}",
                BlasWarning,
                stacklevel=3,
            )
        return None
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:  # e.g. a pip OpenBLAS without the system's libgfortran
        NOT_LOADED_REASON = f"cannot load {lib}: {e}"
        warnings.warn(
            f"{NOT_LOADED_REASON}; MLX's float32 products use its reference BLAS",
            BlasWarning,
            stacklevel=3,
        )
        return None
    LOADED = lib
    return lib


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
    """The weight format whose products are fastest on this backend, memory allowing: the one
    rule for the default model and `macspec doctor`'s advice.

    GPUs read 4-bit weights with fast kernels. On the CPU backend MLX's quantized products are
    far slower than BLAS float32 ones (README, "speed on Linux CPUs"), and without an optimized
    BLAS float32 is still the faster choice (doctor then advises installing one)."""
    backend = backend or detect_backend()
    if backend in ("metal", "cuda"):
        return WeightFormat(
            "4bit", f"{backend} has fast quantized kernels; 4-bit reads 8x fewer bytes"
        )
    blas = blas or blas_in_use()
    memory_bytes = memory_bytes if memory_bytes is not None else total_memory_bytes()
    f32_bytes = 4 * param_count
    if memory_bytes is not None and f32_bytes > memory_bytes // 2:
        return WeightFormat(
            "bfloat16", f"float32 weights ({f32_bytes / 1e9:.1f} GB) exceed half of memory"
        )
    if not blas.fast:
        return WeightFormat(
            "float32",
            f"CPU: MLX's quantized products are slower still; install {OPENBLAS_PACKAGE} for "
            f"fast float32 ones ({blas.kind} BLAS now)",
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
    import numpy as np

    n = megabytes * 1024 * 1024 // 4
    a = mx.arange(n, dtype=mx.float32)
    mx.eval(a)
    mlx_s = _best_time(lambda: mx.eval(a + 0.0), repeats)
    result = {"mlx": 2 * a.nbytes / mlx_s / 1e9}
    x = np.arange(n, dtype=np.float32)
    y = np.empty_like(x)
    np_s = _best_time(lambda: np.copyto(y, x), repeats)
    result["memcpy"] = 2 * x.nbytes / np_s / 1e9
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
