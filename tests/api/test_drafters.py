"""The drafter table (macspec/api/drafters.py): one entry per drafter drives load()'s choices, the
commands' --drafter flag, the kinds a draft directory may declare and the README's table; each
entry builds its drafter for a loaded pair."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.tinymodels import make_tiny_model

import macspec
from macspec.api import drafters
from macspec.base.errors import ModelError, OptionError
from macspec.cli import build_parser
from macspec.core import REGISTRY

README = Path(macspec.__file__).parents[1] / "README.md"


def test_one_table_names_the_drafters_everywhere():
    names = [e.name for e in drafters.ENTRIES]
    assert len(set(names)) == len(names)
    assert all(REGISTRY[e.name] is e.drafter for e in drafters.ENTRIES)  # core's class, same name
    assert list(drafters.DRAFTERS) == [e.name for e in drafters.ENTRIES if e.needs != "file"]
    assert set(drafters.OWN_DRAFTERS) == {"ngram", "mtp"}
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    flag = next(a for a in generate._actions if "--drafter" in a.option_strings)
    assert list(flag.choices) == list(drafters.DRAFTERS)
    text = README.read_text(encoding="utf-8")
    table = text[text.index("| drafter | how |") :].split("\n\n")[0]
    listed = re.findall(r"^\| `([a-z0-9]+)` \|", table, re.M)
    assert listed == names


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("drafters") / "target", seed=2)


def test_each_entry_that_needs_no_file_builds_for_a_pair(target):
    for name, kind in (("ngram", "ngram"), ("model", "model")):
        kw = {"drafter": name} if name == "ngram" else {"draft": target, "drafter": "model"}
        pair = macspec.load(target, measure=False, **kw)
        assert pair.drafter_kind == kind
        assert isinstance(pair.make_drafter(True), drafters.TABLE[kind].drafter)
    hybrid = macspec.load(target, target, measure=False)
    assert hybrid.drafter_kind == "model+ngram"
    assert type(hybrid.make_drafter(True)).__name__ == "HybridDrafter"
    with pytest.raises(OptionError, match="unknown drafter='eagle'"):
        macspec.load(target, drafter="eagle")  # a directory's kind, not a choice


def test_a_draft_directory_declares_only_a_file_kind(tmp_path, target):
    assert drafters.draft_kind(target) == "model"
    for kind in ("ngram", "nonsense"):
        (tmp_path / "draft.json").write_text(json.dumps({"kind": kind}))
        with pytest.raises(
            ModelError, match=rf"draft\.json declares an unknown draft kind '{kind}'"
        ):
            drafters.draft_kind(tmp_path)
