"""The native extension built for other x86 instruction sets than this CPU's best (slow set):
the AVX2 paths many AMD EPYC machines take (and Intel client cores, with AVX-VNNI), and AVX-512
without VNNI. A CPU that has the features runs each build, so their exactness tests run here
too (MACSPEC_NATIVE_ARCH)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What each build needs of the CPU running it, and the int8 products' path it takes.
ARCHES = {
    "x86-64-v3": ({"avx2", "fma", "bmi2", "f16c"}, "avx2"),
    "x86-64-v3-vnni": ({"avx2", "fma", "bmi2", "f16c", "avx_vnni"}, "avx-vnni"),
    "x86-64-v4": ({"avx2", "avx512f", "avx512bw", "avx512dq", "avx512vl"}, "avx512bw"),
}
TESTS = [
    *(
        "tests/cpu/test_products_int8.py",
        "tests/cpu/test_layer_ops.py",
        "tests/cpu/test_blocks_quantized.py",
    ),
    "tests/cpu/test_repack.py",
    "tests/cpu/test_factored_scales.py",
    "tests/cpu/test_kv_half.py",
    "tests/cpu/test_rooms.py",
]


def _flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_the_extension_built_for_an_older_isa_is_exact(arch):
    needs, isa = ARCHES[arch]
    if platform.machine() != "x86_64" or not needs <= _flags():
        pytest.skip(f"this CPU cannot run an {arch} build")
    env = {**os.environ, "MACSPEC_NATIVE_ARCH": arch}
    probe = (
        "from macspec.cpu import native; from macspec.cpu.state import STATE; "
        "e = native.load(); print(e.int8_isa() if e else STATE.ext_reason)"
    )
    built = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert built.stdout.strip().splitlines()[-1] == isa, built.stdout + built.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", *TESTS],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
