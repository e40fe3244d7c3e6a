"""MTP layers in GGUF files (llama.cpp writes GLM-4.5's as blk.{L+i}.* + blk.{L+i}.nextn.*):
`macspec convert FILE.gguf` keeps them as it keeps a safetensors checkpoint's."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
from support.archzoo import _write_byte_level_char_tokenizer
from support.drafter_models import glm4moe_gguf, make_mtp_checkpoint, mtp_trunk

from macspec.base.errors import ModelError
from macspec.models import mtp
from macspec.models.convert import convert
from macspec.models.store import store_root


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    src = make_mtp_checkpoint(tmp_path_factory.mktemp("glm") / "glm", "glm4_moe", count=2, seed=3)
    _write_byte_level_char_tokenizer(src)  # a GGUF carries a byte-level BPE
    return src


def _store() -> list[str]:
    return sorted(p.name for p in store_root().iterdir()) if store_root().exists() else []


def test_gguf_nextn_layers_become_the_same_heads_as_the_checkpoints(glm, tmp_path):
    out = convert(str(glm4moe_gguf(glm, tmp_path / "glm.gguf")), output="gguf", dtype="float32")
    model, _ = load_model(out)
    want = dict(tree_flatten(mtp_trunk("glm4_moe", 2, seed=3).parameters()))
    have = dict(tree_flatten(model.parameters()))
    assert sorted(have) == sorted(want)
    assert all(mx.array_equal(have[k], want[k]).item() for k in want)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    ref = convert(str(glm), output="hf", dtype="float32")
    a, b = mx.load(str(out / mtp.WEIGHTS)), mx.load(str(ref / mtp.WEIGHTS))
    assert sorted(a) == sorted(b) and all(mx.array_equal(a[k], b[k]).item() for k in a)
    cfg = mtp.read_config(out)
    assert (cfg.count, cfg.layout, cfg.source) == (2, "deepseek", str(tmp_path / "glm.gguf"))
    mtp.read_heads(out, model)


def test_a_gguf_without_nextn_layers(glm, tmp_path):
    path = glm4moe_gguf(glm, tmp_path / "trunk.gguf", drop_heads=True)
    out = convert(str(path), output="trunk", dtype="float32")
    assert not (out / mtp.META).exists()
    with pytest.raises(ModelError, match="trunk.gguf: no MTP heads"):
        convert(str(path), output="x", mtp="require")
    assert _store() == ["trunk"]


def test_a_gguf_missing_a_nextn_tensor_is_refused_by_name(glm, tmp_path):
    path = glm4moe_gguf(glm, tmp_path / "cut.gguf", drop="blk.3.nextn.eh_proj.weight")
    with pytest.raises(
        ModelError, match="cut.gguf: MTP layer 1 lacks GGUF tensor 'blk.3.nextn.eh_proj.weight'"
    ):
        convert(str(path), output="x")
    assert _store() == []


def test_glm_45_attention_biases_without_qk_norms(tmp_path):
    """GLM-4.5's own shape: q/k/v biases, no q/k norms (read from the tensors present)."""
    over = {"attention_bias": True, "use_qk_norm": False}
    src = make_mtp_checkpoint(tmp_path / "g45", "glm4_moe", count=1, seed=4, **over)
    _write_byte_level_char_tokenizer(src)
    out = convert(str(glm4moe_gguf(src, tmp_path / "g45.gguf")), output="g45", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["attention_bias"] and not config["use_qk_norm"]
    model, _ = load_model(out)
    want = dict(tree_flatten(mtp_trunk("glm4_moe", 1, seed=4, **over).parameters()))
    have = dict(tree_flatten(model.parameters()))
    assert sorted(have) == sorted(want)
    assert all(mx.array_equal(have[k], want[k]).item() for k in want)
    _, heads = mtp.read_heads(out, model)
    assert heads[0].block.self_attn.q_proj.bias.shape == (32,)
