"""Runtime switches (macspec/base/switches.py): one rule for on/off, numbers and choices checked
with the variable named, every MACSPEC_* variable read there alone, and `macspec doctor` lists
them."""

import ast
from pathlib import Path

import pytest

import macspec
from macspec.base import switches
from macspec.base.errors import OptionError
from macspec.tools import doctor

ROOT = Path(macspec.__file__).parent


@pytest.mark.parametrize("text", ["1", "true", "YES", " on "])
def test_a_flag_is_on(text):
    assert switches.KEEP_COSTS.value({"MACSPEC_KEEP_COSTS": text}) is True
    assert switches.NO_BLAS_PRELOAD.value({"MACSPEC_NO_BLAS_PRELOAD": text}) is True


@pytest.mark.parametrize("text", ["0", "false", "No", "OFF"])
def test_a_flag_is_off(text):
    assert switches.KERNELS.value({"MACSPEC_KERNELS": text}) is False
    assert switches.COMM_TIMING.value({"MACSPEC_COMM_TIMING": text}) is False


def test_unset_or_empty_is_the_default():
    assert switches.KERNELS.value({}) is True and switches.KERNELS.value({"MACSPEC_KERNELS": ""})
    assert switches.COMM_TIMING.value({}) is False
    assert switches.NATIVE_THREADS.value({}) is None and switches.HOME.value({}) is None


def test_anything_else_is_refused_with_the_variable_named():
    with pytest.raises(OptionError, match="MACSPEC_KERNELS='maybe': must be one of 1/true"):
        switches.KERNELS.value({"MACSPEC_KERNELS": "maybe"})
    with pytest.raises(OptionError, match="MACSPEC_NATIVE_THREADS='0': must be a whole number"):
        switches.NATIVE_THREADS.value({"MACSPEC_NATIVE_THREADS": "0"})
    with pytest.raises(OptionError, match="MACSPEC_DIST_TIMEOUT='-3': must be a number of sec"):
        switches.DIST_TIMEOUT.value({"MACSPEC_DIST_TIMEOUT": "-3"})
    with pytest.raises(OptionError, match="MACSPEC_PROMPT_CACHE_MB='lots': must be a number"):
        switches.PROMPT_CACHE_MB.value({"MACSPEC_PROMPT_CACHE_MB": "lots"})
    with pytest.raises(OptionError, match="one of float32, float16, 4bit"):
        switches.DEFAULT_FORMAT.value({"MACSPEC_DEFAULT_FORMAT": "int3"})


def test_values_of_each_kind():
    env = {
        "MACSPEC_NATIVE_THREADS": "3",
        "MACSPEC_DIST_TIMEOUT": "2.5",
        "MACSPEC_PROMPT_CACHE_MB": "0",
        "MACSPEC_HOME": "~/x",
        "MACSPEC_DEFAULT_FORMAT": "4bit",
    }
    assert switches.NATIVE_THREADS.value(env) == 3
    assert switches.DIST_TIMEOUT.value(env) == 2.5
    assert switches.PROMPT_CACHE_MB.value(env) == 0.0
    assert switches.HOME.value(env) == Path("~/x").expanduser()
    assert switches.DEFAULT_FORMAT.value(env) == "4bit"


def test_settings_list_every_switch_and_refuse_only_the_bad_one():
    found = switches.settings({"MACSPEC_NATIVE_THREADS": "many", "MACSPEC_KERNELS": "off"})
    assert [s.switch for s in found] == list(switches.ALL)
    by_name = {s.switch.name: s for s in found}
    assert by_name["MACSPEC_NATIVE_THREADS"].error and by_name["MACSPEC_KERNELS"].value is False
    assert [s.switch.name for s in found if s.error] == ["MACSPEC_NATIVE_THREADS"]
    misspelt = {"MACSPEC_KERNEL": "0", "MACSPEC_KERNELS": "0"}
    assert switches.unknown(misspelt) == {"MACSPEC_KERNEL": "0"}


def _names_outside_docstrings(path: Path) -> list[str]:
    """String constants in `path` that are a MACSPEC_* name (docstrings mention them in prose)."""
    tree = ast.parse(path.read_text())
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and n.value.strip().startswith("MACSPEC_")
    ]


def test_no_module_but_switches_reads_a_macspec_variable():
    found = {
        str(p.relative_to(ROOT)): names
        for p in sorted(ROOT.rglob("*.py"))
        if p.name != "switches.py" and (names := _names_outside_docstrings(p))
    }
    assert found == {}
    # the check sees a name where one is
    assert _names_outside_docstrings(ROOT / "base" / "switches.py").count("MACSPEC_KERNELS") == 1


def test_doctor_lists_every_switch_with_its_value(monkeypatch):
    monkeypatch.setenv("MACSPEC_KERNELS", "off")
    monkeypatch.setenv("MACSPEC_NATIVE_THREADS", "many")
    monkeypatch.setenv("MACSPEC_KERNAL", "0")
    rows = doctor.switch_report()
    assert [r["name"] for r in rows] == [s.name for s in switches.ALL] + ["MACSPEC_KERNAL"]
    by_name = {r["name"]: r for r in rows}
    assert by_name["MACSPEC_KERNELS"]["value"] == "off"
    assert "whole number" in by_name["MACSPEC_NATIVE_THREADS"]["error"]
    assert by_name["MACSPEC_KERNAL"]["error"] == "no switch has this name"
    assert by_name["MACSPEC_NATIVE_BLOCKS"]["read"] == "at import"


def test_every_switch_defined_is_listed_in_all():
    """A switch missing from ALL would be called unknown when set, and left out of doctor."""
    from macspec.base import switches as module

    defined = {v.name for v in vars(module).values() if isinstance(v, module.Switch)}
    assert defined == {s.name for s in module.ALL}


@pytest.mark.parametrize("env", [{"MACSPEC_KV_CACHE": "bf16"}, {"MACSPEC_REPACK": "maybe"}])
def test_a_malformed_switch_read_at_import_is_a_message_where_it_is_used(env, tmp_path):
    # `import macspec` reads the CPU package's switches; a bad one is its OptionError when a
    # model is first loaded (the command line's message), not a traceback out of the import.
    import os
    import subprocess
    import sys

    from support.tinymodels import make_tiny_model

    target = make_tiny_model(tmp_path / "t")
    run_env = {**os.environ, **env}
    name = next(iter(env))
    imported = subprocess.run(
        [sys.executable, "-c", "import macspec"], env=run_env, capture_output=True, text=True
    )
    assert imported.returncode == 0, imported.stderr
    cmd = [sys.executable, "-m", "macspec", "generate", "Hi", "--target", str(target)]
    done = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
    assert done.returncode != 0
    assert done.stderr.startswith(f"macspec: error: {name}=") and "Traceback" not in done.stderr
