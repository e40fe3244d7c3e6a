"""Logging: one logger per layer; a fallback says why at INFO, shown by the CLI's -v; progress
notes on long work are shown without it."""

import logging

import pytest

from macspec.base import logs
from macspec.cli import build_parser
from macspec.cpu import native
from macspec.cpu.state import STATE


@pytest.fixture
def native_off(monkeypatch):
    for name, value in (("ext_tried", False), ("ext", None), ("ext_reason", None)):
        monkeypatch.setattr(STATE, name, value)
    monkeypatch.setenv("MACSPEC_NATIVE", "0")
    yield
    logs.show(verbose=False)


WHY = "macspec: the native CPU kernels are not in use, mlx's own ops are: switched off"


def test_a_fallback_is_logged_at_info_with_its_reason(native_off, caplog):
    caplog.set_level(logging.INFO, logger="macspec")
    assert native.load() is None
    (record,) = [r for r in caplog.records if r.name == "macspec.cpu"]
    assert record.levelno == logging.INFO and "(MACSPEC_NATIVE is off)" in record.getMessage()


def test_verbose_shows_the_reasons_and_quiet_does_not(native_off, capsys, monkeypatch):
    logs.show(verbose=False)
    native.load()
    assert WHY not in capsys.readouterr().err
    monkeypatch.setattr(STATE, "ext_tried", False)
    logs.show(verbose=True)
    native.load()
    assert WHY in capsys.readouterr().err


def test_progress_notes_and_warnings_show_without_verbose(capsys):
    logs.show(verbose=False)
    log = logging.getLogger("macspec.models")
    logs.progress(log, "tensors 3/9")
    log.info("a reason nobody asked for")
    log.warning("a warning")
    log.error("a failure")
    assert capsys.readouterr().err.splitlines() == [
        "macspec: tensors 3/9",
        "macspec: warning: a warning",
        "macspec: error: a failure",
    ]


def test_the_cli_takes_verbose_before_or_after_the_command():
    parser = build_parser()
    assert parser.parse_args(["-v", "models"]).verbose is True
    assert parser.parse_args(["models", "--verbose"]).verbose is True
    assert parser.parse_args(["models"]).verbose is False
