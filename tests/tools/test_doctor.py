"""Backend detection, the OpenBLAS that `import macspec` loads, and `macspec doctor`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from macspec.base import platform_info as be
from macspec.cli import main

MLX_REF = "/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
DEBIAN_OB = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
NUMPY_OB = "/site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so"


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS always uses Accelerate")
def test_blas_classification_from_mapped_libraries():
    assert be.blas_in_use([NUMPY_OB, MLX_REF]) == be.BlasInfo("reference", MLX_REF)
    assert be.blas_in_use([DEBIAN_OB, MLX_REF]).kind == "openblas"
    assert be.blas_in_use(["/opt/intel/lib/libmkl_rt.so.2"]).kind == "mkl"
    # numpy's OpenBLAS has prefixed symbols that mlx cannot bind to
    assert be.blas_in_use([NUMPY_OB]).kind == "not loaded"
    assert not be.blas_in_use([MLX_REF]).fast
    assert be.blas_in_use([DEBIAN_OB]).fast


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="loading is Linux-only")
def test_nothing_to_load_when_opted_out_or_already_loaded():
    assert be.openblas_to_load({"MACSPEC_NO_BLAS_PRELOAD": "1"}) is None
    if be.find_openblas() is not None:  # this process imported macspec, which loaded it
        assert be.LOADED == be.find_openblas() or os.environ.get("LD_PRELOAD")
        assert be.openblas_to_load({}) is None


def test_openblas_candidates_cover_debian_pthread_path():
    names = [str(p) for p in be.openblas_candidates()]
    assert any(n.endswith("-linux-gnu/openblas-pthread/libopenblas.so.0") for n in names)


def test_choose_weight_format():
    ob = be.BlasInfo("openblas", DEBIAN_OB)
    ref = be.BlasInfo("reference", MLX_REF)
    gb = 10**9
    assert be.choose_weight_format(135_000_000, "metal").dtype == "4bit"
    assert be.choose_weight_format(135_000_000, "cuda").dtype == "4bit"
    assert be.choose_weight_format(135_000_000, "cpu", ob, 16 * gb).dtype == "float32"
    assert be.choose_weight_format(8 * gb, "cpu", ob, 16 * gb).dtype == "bfloat16"
    # MLX's CPU quantized products are slower than even reference-BLAS float32 ones
    slow = be.choose_weight_format(135_000_000, "cpu", ref, 16 * gb)
    assert slow.dtype == "float32" and be.OPENBLAS_PACKAGE in slow.reason


def test_measurements_are_positive():
    bw = be.measure_bandwidth(megabytes=8, repeats=1)
    assert bw["best"] == max(bw.values()) and bw["mlx"] > 0
    assert be.measure_matmul_gflops(64, repeats=1) > 0


@pytest.mark.subprocess
def test_doctor_json(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] in ("cpu", "metal", "cuda")
    assert report["blas"] == be.blas_in_use().kind
    assert report["bandwidth_gbs"]["best"] > 0 and report["matmul_gflops"] > 0
    assert report["advice"] and report["weight_format"]["dtype"] in ("float32", "bfloat16", "4bit")


def _clean_env(**env: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, **env}


def _doctor_subprocess(**env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "macspec", "doctor", "--json"],
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


NO_OPENBLAS = "no Debian OpenBLAS (apt-get install libopenblas0-pthread)"


@pytest.mark.skipif(be.find_openblas() is None, reason=NO_OPENBLAS)
@pytest.mark.subprocess
def test_command_loads_openblas_in_process_and_opt_out_works():
    fast = _doctor_subprocess()
    assert fast["blas"] == "openblas" and fast["blas_loaded_by_macspec"] == str(be.find_openblas())
    assert fast["openblas"]["core"] and fast["openblas"]["threads"] >= 1
    slow = _doctor_subprocess(MACSPEC_NO_BLAS_PRELOAD="1")
    assert slow["blas"] == "reference" and slow["blas_loaded_by_macspec"] is None
    assert slow["openblas"] is None


def _script(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        check=True,
    )


REPORT = (
    "import json; from macspec.base.platform_info import blas_in_use, openblas_details\n"
    "import mlx.core as mx\n"
    "mx.eval(mx.ones((8, 64)) @ mx.ones((64, 64)))\n"
    "print(json.dumps([blas_in_use().kind, blas_in_use().path, openblas_details()]))\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mlx[cpu] on Linux only")
@pytest.mark.skipif(be.find_openblas() is None, reason=NO_OPENBLAS)
@pytest.mark.subprocess
def test_a_script_importing_macspec_runs_mlx_on_openblas():
    # blas_in_use reads the slot mlx's cblas_sgemm calls go through, not just what is loaded
    done = _script("import macspec\n" + REPORT)
    kind, path, details = json.loads(done.stdout)
    assert (kind, path) == ("openblas", str(be.find_openblas()))
    assert details["threads"] >= 1
    assert "Warning" not in done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mlx[cpu] on Linux only")
@pytest.mark.skipif(be.find_openblas() is None, reason=NO_OPENBLAS)
@pytest.mark.subprocess
def test_mlx_imported_before_macspec_warns_once_with_the_remedy():
    code = "import mlx.core\nimport macspec\nimport importlib; importlib.import_module('macspec')\n"
    done = _script(code + REPORT)
    kind, path, details = json.loads(done.stdout)
    # OpenBLAS loaded after mlx would fool a look-up by name; mlx's calls still go to its own BLAS
    assert kind == "reference" and details is None
    assert done.stderr.count("BlasWarning") == 1
    assert "import macspec before mlx" in done.stderr
    assert f"LD_PRELOAD={be.find_openblas()}" in done.stderr
    opted_out = _script(code + REPORT, MACSPEC_NO_BLAS_PRELOAD="1")
    assert opted_out.stderr == ""  # no warning


@pytest.mark.skipif(be.find_openblas() is None, reason=NO_OPENBLAS)
@pytest.mark.subprocess
def test_doctor_reports_the_openblas_kernels_in_use():
    # Debian's OpenBLAS picks kernels per CPU at start-up; OPENBLAS_CORETYPE forces a set.
    forced = _doctor_subprocess(OPENBLAS_CORETYPE="Haswell", OPENBLAS_NUM_THREADS="1")
    assert forced["openblas"] == {"core": "Haswell", "threads": 1}


def test_advice_on_avx2_kernels_forced_onto_an_avx512_cpu():
    from macspec.tools.doctor import advice

    report = {
        "backend": "cpu",
        "blas": "openblas",
        "rows8_over_rows1": 2.5,
        "openblas": {"core": "Haswell", "threads": 2},
        "openblas_coretype_env": "Haswell",
        "cpu_avx512": True,
    }
    (note,) = advice(report)
    assert note.startswith("OPENBLAS_CORETYPE=Haswell forces OpenBLAS's Haswell kernels")
    # Not forced, an AVX2-only CPU, or AVX-512 kernels forced: nothing to say.
    for change in (
        {"openblas_coretype_env": None},
        {"cpu_avx512": False},
        {"openblas": {"core": "Cooperlake", "threads": 2}, "openblas_coretype_env": "Cooperlake"},
    ):
        assert advice({**report, **change})[0].startswith("fine:")


def test_doctor_times_verification_passes_of_a_model(tmp_path, capsys):
    from support.tinymodels import make_tiny_model

    model = make_tiny_model(tmp_path / "m", seed=1)
    assert main(["doctor", "--json", "--model", str(model)]) == 0
    costs = json.loads(capsys.readouterr().out)["verify_cost"]
    assert list(costs["ms"]) == ["1", "2", "3", "5", "8"] and costs["ratio"]["1"] == 1.0
    assert all(ms > 0 for ms in costs["ms"].values())
    assert list(costs["split_ms"]) == ["1", "2", "3", "5", "8"]
    assert all(t["layers"] > 0 and t["head"] > 0 for t in costs["split_ms"].values())
    assert len(costs["policy"]) == 3 and costs["policy"][0].startswith("at 30%: ")
    assert main(["doctor", "--model", str(model)]) == 0
    out = capsys.readouterr().out
    # (each run's choice follows its own timings: only the line is compared)
    assert "layers + head  1: " in out and "policy         at 90%: " in out
    # Where one pass goes: each part timed; the rest is what the pass built whole took beyond
    # them, and the overlap what evaluating while building saved against it (both clamped at 0).
    names = ("build", "layer products", "head", "rest", "sample", "overlap saves", "built whole")
    for n, parts in costs["breakdown_ms"].items():
        assert set(parts) == set(names)
        assert parts["build"] > 0 and parts["layer products"] > 0 and parts["head"] > 0
        whole = parts["built whole"]
        alone = parts["build"] + parts["layer products"] + parts["head"]
        assert whole > parts["build"], n
        assert parts["rest"] == pytest.approx(max(whole - alone, 0.0), abs=0.011), n
        assert parts["overlap saves"] == pytest.approx(max(whole - costs["ms"][n], 0.0), abs=0.011)
    chart = tmp_path / "pass.png"
    assert main(["doctor", "--model", str(model), "--chart", str(chart)]) == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_floor_counts_the_weights_a_pass_reads(tmp_path):
    """Every weight once, but an input embedding apart from the output head only looked up."""
    import mlx.core as mx
    from support.tinymodels import make_tiny_model

    from macspec.tools.doctor import verify_costs

    for tie in (True, False):
        model = make_tiny_model(tmp_path / str(tie), seed=1, hidden=64, vocab_rows=4096, tie=tie)
        weights = mx.load(str(model / "model.safetensors"))
        every = sum(v.nbytes for v in weights.values())
        read = sum(v.nbytes for k, v in weights.items() if tie or "embed_tokens" not in k)
        costs = verify_costs(str(model), rows=(1,), repeats=1)
        assert costs["weights_mb"] == round(read / 1e6, 1)
        assert (round(every / 1e6, 1) == costs["weights_mb"]) is tie


def test_doctor_times_a_model_not_laid_out_as_a_decoder(tmp_path, capsys):
    """qwen3_5 wraps its decoder (`model.language_model`): pass times, no split, no crash."""
    from support.archzoo import make_arch_model

    model = make_arch_model(tmp_path / "q", "qwen3_5")
    assert main(["doctor", "--json", "--model", str(model)]) == 0
    costs = json.loads(capsys.readouterr().out)["verify_cost"]
    assert list(costs["ms"]) == ["1", "2", "3", "5", "8"] and all(costs["ms"].values())
    assert costs["split_ms"] == {} and costs["breakdown_ms"] == {}
    assert main(["doctor", "--model", str(model), "--chart", str(tmp_path / "c.png")]) == 0
    assert "not laid out as an mlx-lm decoder" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def fresh_native(monkeypatch, home=None):
    """native.load() starts over, switched on, building into `home` (None: the usual cache)."""
    from macspec.cpu.state import STATE

    for name, value in (("ext_tried", False), ("ext", None), ("ext_reason", None)):
        monkeypatch.setattr(STATE, name, value)
    monkeypatch.delenv("MACSPEC_NATIVE", raising=False)
    if home is not None:
        monkeypatch.setenv("MACSPEC_HOME", str(home))


def test_the_native_products_build_wherever_they_are_meant_to(monkeypatch):
    """Falling back is for machines without a compiler, nanobind or an AVX2 CPU: a failed
    build where all are present is a bug (the AVX-512 kernels once did not compile on AVX2
    CPUs, and every user there silently got mlx's slower products; the kernels' own tests then
    skip, so this one must fail). The build is the cache's: its key holds the sources' hash, so
    it was built from these very sources, and on a fresh checkout (CI) from scratch."""
    import importlib.util

    from macspec.base.paths import native_dir
    from macspec.cpu import native
    from macspec.cpu.state import STATE

    fresh_native(monkeypatch)
    ext = native.load()
    reason = STATE.ext_reason
    if reason is not None and reason.startswith(("only built", "no C++", "nanobind")):
        pytest.skip(f"not built on this machine by design: {reason}")
    assert importlib.util.find_spec("nanobind") is not None
    assert ext is not None, reason
    assert list((native_dir() / STATE.ext_build).glob("*.so"))


def test_a_failed_native_build_leaves_mlx_products_and_says_why(monkeypatch, tmp_path):
    """A compiler that fails: no extension, mlx's own products, and a reason naming the step."""
    import shutil

    from macspec.cpu import native, products
    from macspec.cpu.state import STATE

    if shutil.which("false") is None:
        pytest.skip("no `false` command to stand in for a failing compiler")
    fresh_native(monkeypatch, tmp_path)
    monkeypatch.setenv("CXX", shutil.which("false"))
    assert native.load() is None and not products.active()
    if STATE.ext_reason.startswith("only built"):
        return  # not Linux, or not an AVX2 CPU: never built
    assert STATE.ext_reason.startswith(
        "RuntimeError: false could not build nanobind.o: exit status"
    )
    from macspec.tools.doctor import native_products

    assert native_products().startswith("off: RuntimeError: false could not build nanobind.o")
    assert not list((tmp_path / "native").rglob("*.so"))


FAKE_CXX = """#!/bin/sh
# A compiler that takes a second, says which process ran it, and writes an empty output.
echo "$PPID" >> "$CXX_LOG"
sleep 1
prev=""
for arg in "$@"; do [ "$prev" = "-o" ] && out="$arg"; prev="$arg"; done
: > "$out"
"""


def test_two_processes_on_a_fresh_cache_build_the_kernels_once(tmp_path):
    """A second process (the other test worker, a server beside a chat) waits for the first's
    build and loads its result instead of compiling a copy on the same cores."""
    from macspec.cpu import native

    cxx, log = tmp_path / "fake-c++", tmp_path / "calls.log"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    env = {**os.environ, "MACSPEC_HOME": str(tmp_path / "home"), "CXX": str(cxx)}
    env.update(CXX_LOG=str(log))
    env.pop("MACSPEC_NATIVE", None)
    code = (
        "from macspec.base.logs import show; from macspec.cpu import native; "
        "from macspec.cpu.state import STATE; show(); native.load(); print(STATE.ext_reason)"
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    said = [run.communicate(timeout=120) for run in runs]
    reasons = [out.decode() for out, _ in said]
    if any(r.startswith("only built") for r in reasons):
        pytest.skip(f"not built on this machine by design: {reasons[0].strip()}")
    callers = log.read_text().split()
    assert len(set(callers)) == 1  # one process compiled
    assert len(callers) == len(native.SOURCES) + 2  # nanobind, each source, the link
    assert all("could not build" not in r for r in reasons)  # both got past the build
    notes = sorted(err.decode() for _, err in said)  # each says what it does meanwhile
    assert "building its CPU kernels" in notes[0] and "waiting for another" not in notes[0]
    assert "waiting for another macspec process to build its CPU kernels" in notes[1]


def test_doctor_says_what_the_policy_would_choose_with_the_passes_it_timed():
    from macspec.tools.doctor import policy_lines

    # Passes over 2-8 ids barely dearer than one: free drafts pay even at 30%, up to 7 of them.
    cheap = policy_lines({"1": 10.0, "2": 10.5, "3": 11.0, "5": 12.0, "8": 13.0})
    assert cheap[0].startswith("at 30%: K=") and cheap[-1].startswith("at 90%: K=7: priced to pay")
    # Each id fed costs a whole step (a CPU whose passes grow with their rows): never.
    dear = policy_lines({"1": 10.0, "2": 20.0, "3": 30.0, "5": 50.0, "8": 80.0})
    assert all(" plain: priced below plain (copy of a 16-id match K=" in line for line in dear)
