"""The model store: names, resolution, listing facts, tokenizer fingerprints, the pair catalog."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
from support.tinymodels import make_tiny_model

from macspec.base.errors import ModelError, OptionError
from macspec.models import catalog, store
from macspec.models.catalog import ensure_pair
from macspec.models.store import (
    list_models,
    load_catalog,
    model_info,
    resolve_model,
    store_root,
    tokenizer_fingerprint,
    validate_name,
)
from macspec.models.wheels import WheelFile


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_store_root(home, monkeypatch):
    assert store_root() == home / "models"
    monkeypatch.delenv("MACSPEC_HOME")
    import platformdirs

    expected = Path(platformdirs.user_cache_dir("macspec", appauthor=False)) / "models"
    assert store_root() == expected


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".hidden", "", "a" * 129, "x\\y", "a b"])
def test_invalid_names(name):
    with pytest.raises(OptionError, match="invalid model name"):
        validate_name(name)


def test_valid_names():
    for name in ["SmolLM2-135M-Instruct-4bit", "qwen2.5_7b", "a", "x+y"]:
        assert validate_name(name) == name


def test_resolve_paths_and_names(tmp_path):
    model = make_tiny_model(tmp_path / "somewhere" / "m")
    assert resolve_model(str(model)) == model.resolve()
    stored = make_tiny_model(store_root() / "stored")
    assert resolve_model("stored") == stored
    with pytest.raises(ModelError) as e:
        resolve_model("absent")
    assert "absent" in str(e.value) and "macspec models" in str(e.value)
    assert "macspec convert" in str(e.value)
    with pytest.raises(ModelError, match="no such model directory"):
        resolve_model("../stored")
    with pytest.raises(ModelError, match="no such model directory"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelError, match="not a model directory"):
        resolve_model(str(tmp_path / "somewhere"))
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelError, match="macspec convert"):
        resolve_model(str(gguf))
    with pytest.raises(ModelError, match="macspec convert org/model"):
        resolve_model("org/model")
    with pytest.raises(ModelError) as e:  # a catalog model says how to get exactly it
        resolve_model("Qwen2.5-7B-Instruct-4bit")
    fetch = "macspec convert Qwen/Qwen2.5-7B-Instruct -q 4 -o Qwen2.5-7B-Instruct-4bit"
    assert fetch in str(e.value)
    # hidden (temporary) entries are never resolved or listed
    make_tiny_model(store_root() / ".tmp-1-half")
    with pytest.raises(ModelError):
        resolve_model(".tmp-1-half")
    assert [i.name for i in list_models()] == ["stored"]


def test_listing_facts(tmp_path):
    path = make_tiny_model(store_root() / "t", hidden=32, vocab_rows=100)
    model, _ = load_model(path)
    info = model_info(path)
    assert info.architecture == "llama"
    assert info.parameters == sum(v.size for _, v in tree_flatten(model.parameters()))
    assert info.bits == "f32"
    assert info.size_bytes == sum(f.stat().st_size for f in path.iterdir())
    assert re.fullmatch(r"[0-9a-f]{12}", info.fingerprint)
    assert info.acceptance is None
    report = {"k4": {"temperature_0": {"acceptance_rate": 0.71, "mean_accepted_length": 3.2}}}
    (path / "report.json").write_text(json.dumps(report))
    assert model_info(path).acceptance == (
        "k4.temperature_0.acceptance_rate=0.71, k4.temperature_0.mean_accepted_length=3.2"
    )


def test_fingerprint_depends_on_vocabulary_only(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=0, hidden=32)
    b = make_tiny_model(tmp_path / "b", seed=5, hidden=64, vocab_rows=128)  # other weights/rows
    c = make_tiny_model(tmp_path / "c", chars="abcdefgh")  # other vocabulary
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(c)
    # the special ids count: the same strings with one token no longer special differ
    data = json.loads((b / "tokenizer.json").read_text())
    data["added_tokens"][2]["special"] = False
    (b / "tokenizer.json").write_text(json.dumps(data))
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)
    (c / "tokenizer.json").unlink()
    assert tokenizer_fingerprint(c) == "-"


def test_models_command(capsys, tmp_path):
    assert catalog.models() == 0
    assert "No models in the store" in capsys.readouterr().out
    make_tiny_model(store_root() / "alpha")
    make_tiny_model(store_root() / "beta", chars="xyz")
    assert catalog.models() == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == [
        "NAME",
        "ARCH",
        "PARAMS",
        "FORMAT",
        "SIZE",
        "TOKENIZER",
        "ACCEPTANCE",
        "MTP",
    ]
    assert lines[1].startswith("alpha") and lines[2].startswith("beta")
    assert catalog.models(json_output=True) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["alpha", "beta"]
    assert rows[0]["fingerprint"] != rows[1]["fingerprint"]


def test_catalog_is_well_formed():
    pairs = load_catalog()
    assert len(pairs) >= 3
    names = [p["name"] for p in pairs]
    assert len(set(names)) == len(names) and "default" not in names
    for p in pairs:
        for role in ("target", "draft"):
            spec = p[role]
            validate_name(spec["name"])
            if "wheels" in spec:  # PyPI slices, every hash pinned (tests/models/test_wheels.py)
                assert WheelFile.from_spec(spec["wheels"], spec["name"]).parts
            else:
                assert re.fullmatch(r"[\w.-]+/[\w.-]+", spec["source"])
            assert spec.get("q", "none") in ("4", "8", "none", "keep")
        assert p["min_memory_gb"] > 0
    sources = {p["target"]["source"] for p in pairs}
    assert "Qwen/Qwen2.5-7B-Instruct" in sources
    assert "meta-llama/Llama-3.1-8B-Instruct" in sources
    assert "HuggingFaceTB/SmolLM2-1.7B-Instruct" in sources


def test_ensure_pair_fetches_only_what_is_missing(tmp_path, monkeypatch):
    catalog_file = tmp_path / "catalog.json"
    pair = {
        "name": "p",
        "min_memory_gb": 1,
        "target": {"source": "org/big", "name": "big-4bit", "q": "4"},
        "draft": {"source": "org/small", "name": "small", "q": "none"},
    }
    catalog_file.write_text(json.dumps({"pairs": [pair]}))
    monkeypatch.setattr(store.load_catalog, "__defaults__", (catalog_file,))
    target = make_tiny_model(store_root() / "big-4bit")
    calls = []

    def fake_convert(source, output=None, **kw):
        calls.append((source, output, kw["q"]))
        return make_tiny_model(store_root() / output)

    monkeypatch.setattr(catalog.converter, "convert", fake_convert)
    assert ensure_pair("p") == (target, store_root() / "small")
    assert calls == [("org/small", "small", "none")]
    assert ensure_pair("p") == (target, store_root() / "small")
    assert len(calls) == 1
    with pytest.raises(OptionError, match="unknown pair 'q'.*default, p"):
        ensure_pair("q")


def test_a_store_entry_converted_otherwise_than_the_catalog_says_is_named(
    tmp_path, monkeypatch, caplog
):
    catalog_file = tmp_path / "catalog.json"
    target = {"source": "org/big.gguf", "name": "big", "q": "keep"}
    catalog_file.write_text(json.dumps({"pairs": [{"name": "p", "target": target}]}))
    monkeypatch.setattr(store.load_catalog, "__defaults__", (catalog_file,))
    path = make_tiny_model(store_root() / "big")
    (path / store.INFO_FILE).write_text(json.dumps({"q": "4", "dtype": "float32"}))
    with caplog.at_level("WARNING", logger="macspec.models"):
        assert ensure_pair("p") == (path, None)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "'big' was converted with -q 4 --dtype float32" in message
    assert "now converts it with -q keep (docs/models.md" in message and str(path) in message
    caplog.clear()
    (path / store.INFO_FILE).write_text(json.dumps({"q": "keep", "dtype": "float32"}))
    with caplog.at_level("WARNING", logger="macspec.models"):
        ensure_pair("p")
    assert caplog.records == []


def test_ensure_default_pair(monkeypatch, tmp_path):
    from macspec.models import default

    monkeypatch.setattr(default, "default_target", lambda: tmp_path / "t")
    monkeypatch.setattr(default, "default_draft", lambda: None)
    assert ensure_pair("default") == (tmp_path / "t", None)


def test_pairs_listing(capsys):
    assert catalog.models(pairs=True) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["PAIR", "MEMORY", "TARGET", "DRAFT"]
    assert "default" in out and "qwen2.5-7b" in out and "macspec chat --pair NAME" in out
