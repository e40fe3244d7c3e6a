"""Bad input gets the project's own error, naming the file or value."""

import json

import pytest
from support.tinymodels import make_tiny_model

import macspec
from macspec.base.errors import MacspecError, ModelError, OptionError, PromptError


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelError, match="nowhere"):
        macspec.load(tmp_path / "nowhere")


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="config.json"):
        macspec.load(tmp_path / "empty")


def test_corrupt_weights(tmp_path):
    d = make_tiny_model(tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelError, match=str(d)):
        macspec.load(d)


def test_unsupported_architecture(tmp_path):
    d = make_tiny_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "no_such_arch"}))
    with pytest.raises(ModelError, match="no_such_arch"):
        macspec.load(d)


def test_remote_code_is_refused(tmp_path):
    d = make_tiny_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_file": "evil.py"}))
    (d / "evil.py").write_text("raise SystemExit('ran remote code')\n")
    with pytest.raises(ModelError, match="custom module"):
        macspec.load(d)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(pair, prompt):
    with pytest.raises(PromptError, match="empty"):
        macspec.generate(pair, prompt)


@pytest.mark.parametrize("bad", [-1, 72, 10_000, 3.5, "a"])
def test_token_ids_out_of_range(pair, bad):
    with pytest.raises(PromptError, match=repr(bad).replace(".", r"\.")):
        macspec.generate(pair, [5, bad])


def test_prompt_longer_than_context(tmp_path):
    d = make_tiny_model(tmp_path / "m", context=16)
    pair = macspec.load(d)
    with pytest.raises(PromptError, match="16"):
        macspec.generate(pair, "x" * 16)


@pytest.mark.parametrize(
    "option",
    [
        {"num_draft": 0},
        {"num_draft": -2},
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"top_k": 2.5},
        {"min_p": 1.0},
        {"repetition_penalty": 0.0},
        {"seed": "x"},
        {"stop": [""]},
    ],
    ids=str,
)
def test_invalid_options(pair, option):
    (name,) = option
    with pytest.raises(OptionError, match=name):
        macspec.generate(pair, "hi", **option)


def test_errors_share_one_base_class():
    for cls in (ModelError, OptionError, PromptError, macspec.CompatError, macspec.ConvertError):
        assert issubclass(cls, MacspecError)
