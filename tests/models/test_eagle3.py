"""Published EAGLE-3 checkpoints: each of the three layouts read into the internal one, checked
against the target, refused by name when it does not fit, and written back out in each format."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from support.drafter_models import EAGLE_TARGET_LAYERS, make_eagle3_draft, make_eagle_target
from support.tinymodels import make_tiny_model

from macspec.base.errors import ModelError
from macspec.models import eagle3
from macspec.models.eagle3_export import export

FORMATS = eagle3.FORMATS
DRAFT_VOCAB = 40  # of the target's 72 ids


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_eagle_target(tmp_path_factory.mktemp("target") / "t", seed=2)


def _config(path):
    return json.loads((path / "config.json").read_text())


def _draft(tmp_path, target, fmt, name="d", **kw):
    return make_eagle3_draft(tmp_path / name, target, fmt, draft_vocab=DRAFT_VOCAB, seed=4, **kw)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_is_detected_and_read_into_one_layout(tmp_path, target, fmt):
    path = _draft(tmp_path, target, fmt)
    assert eagle3.detect(path) == fmt
    ckpt = eagle3.load(path)
    c = ckpt.config
    assert (c.format, c.hidden_size, c.target_hidden_size, c.num_layers) == (fmt, 32, 32, 1)
    assert (c.draft_vocab_size, c.target_vocab_size) == (DRAFT_VOCAB, 72)
    written = mx.load(str(path / "model.safetensors"))
    for key, value in ckpt.weights.items():
        assert mx.array_equal(value, written[eagle3.source_name(fmt, key)]).item(), key
    assert set(ckpt.weights) == set(eagle3.expected_shapes(c))
    # d2t holds offsets (target id - draft id); the internal map is absolute and sorted.
    offsets = np.array(written["d2t"])
    assert np.array_equal(ckpt.d2t, np.arange(DRAFT_VOCAB) + offsets)
    assert np.all(np.diff(ckpt.d2t) > 0) and ckpt.d2t.max() < 72
    eagle3.check_target(ckpt, _config(target), str(target))
    assert eagle3.aux_layers(c, EAGLE_TARGET_LAYERS) == (2, 4, 5)


def test_format_defaults_follow_their_reference_code(tmp_path, target):
    """speculators: norm_before_residual defaults to true when absent (vLLM's algos.py) and
    norm_output means recycling the normed state; SpecForge's norm_output is the final norm
    before lm_head (default true); the EAGLE authors' layout has neither."""

    def drop_nbr(config, arrays):
        del config["norm_before_residual"]
        config["norm_output"] = True
        config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]

    c = eagle3.load(_draft(tmp_path, target, "speculators", edit=drop_nbr)).config
    assert c.norm_before_residual and c.recycle_normed and c.logits_norm
    assert eagle3.aux_layers(c, EAGLE_TARGET_LAYERS) == (1, 3, 6)
    c = eagle3.load(
        _draft(
            tmp_path, target, "specforge", "sf", edit=lambda cfg, a: cfg.update(norm_output=False)
        )
    ).config
    assert not c.logits_norm and not c.recycle_normed and not c.norm_before_residual
    c = eagle3.load(_draft(tmp_path, target, "eagle", "e")).config
    assert c.logits_norm and not c.recycle_normed and not c.norm_before_residual


def test_full_vocabulary_drafts_need_no_map(tmp_path, target):
    path = make_eagle3_draft(tmp_path / "full", target, "eagle", seed=1)
    ckpt = eagle3.load(path)
    assert ckpt.config.draft_vocab_size == 72 and np.array_equal(ckpt.d2t, np.arange(72))


# ------------------------------------------------------------------ refused


def _other_target(tmp_path, **kw):
    path = make_tiny_model(tmp_path / "other", seed=5, layers=EAGLE_TARGET_LAYERS, **kw)
    return _config(path)


def test_a_draft_for_another_target_is_refused_naming_what_differs(tmp_path, target):
    ckpt = eagle3.load(_draft(tmp_path, target, "speculators"))
    wider = _other_target(tmp_path, hidden=64, heads=4)
    with pytest.raises(ModelError, match="features of width 32, but the target has hidden size 64"):
        eagle3.check_target(ckpt, wider, "the target")
    shutil.rmtree(tmp_path / "other")
    rows = _other_target(tmp_path, vocab_rows=96)
    with pytest.raises(ModelError, match="vocabulary of 72 ids, but the target has 96"):
        eagle3.check_target(ckpt, rows, "the target")
    qwen = {**_config(target), "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(ModelError, match="drafts for LlamaForCausalLM, but the target is Qwen3"):
        eagle3.check_target(ckpt, qwen, "the target")
    shallow = {**_config(target), "num_hidden_layers": 4}  # default ids (2, 2, 1) fit ...
    eagle3.check_target(ckpt, shallow, "the target")
    deep = replace(ckpt.config, aux_layer_ids=(2, 4, 8))  # ... a layer 8 of 8 does not
    with pytest.raises(ModelError, match="reads target layer 8, but the target has 8 layers"):
        eagle3.check_target(replace(ckpt, config=deep), _config(target), "the target")


def _edit_d2t(change):
    def edit(config, arrays):
        d2t = np.array(arrays["d2t"])
        change(d2t)
        arrays["d2t"] = mx.array(d2t)

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_edit_d2t(lambda d: d.__setitem__(-1, 500)), "d2t maps draft id 39 to target id 539, "),
        (_edit_d2t(lambda d: d.__setitem__(1, d[0] - 1)), "d2t maps two draft ids to one"),
        (
            lambda c, a: a.update(t2d=mx.array(np.ones(72, dtype=bool))),
            "t2d does not mark exactly",
        ),
        (lambda c, a: a.pop("midlayer.mlp.down_proj.weight"), "lacks 'midlayer.mlp.down_proj"),
        (lambda c, a: a.pop("d2t"), "a draft vocabulary of 40 ids needs d2t"),
        (lambda c, a: a.update({"fc.weight": a["fc.weight"][:, :64]}), "'fc.weight' has shape"),
        (lambda c, a: a.update(extra=mx.zeros(3)), "'extra' is no part of an EAGLE-3 draft"),
        (lambda c, a: c.update(draft_vocab_size=80), "draft vocabulary \\(80 ids\\) is larger"),
        (lambda c, a: c.update(hidden_size="32"), "'hidden_size' = '32' is not a int"),
    ],
)
def test_malformed_checkpoints_are_refused_by_key(tmp_path, target, edit, message):
    path = _draft(tmp_path, target, "eagle", edit=edit)
    with pytest.raises(ModelError, match=message) as e:
        eagle3.load(path)
    assert str(path) in str(e.value)


def test_files_that_are_not_eagle3_drafts_are_refused(tmp_path, target):
    path = _draft(tmp_path, target, "eagle")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(ModelError, match="pytorch_model.bin: a pickled PyTorch checkpoint"):
        eagle3.load(path)
    spec = _draft(tmp_path, target, "speculators", "s")
    config = _config(spec) | {"speculators_model_type": "dflash"}
    (spec / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="speculators model type 'dflash', not eagle3"):
        eagle3.load(spec)
    with pytest.raises(ModelError, match="not an EAGLE-3 draft"):
        eagle3.load(target)  # an ordinary model


# ------------------------------------------------------------------ export


@pytest.mark.parametrize("src", FORMATS)
@pytest.mark.parametrize("dst", FORMATS)
def test_export_round_trips_between_formats(tmp_path, target, src, dst):
    ckpt = eagle3.load(_draft(tmp_path, target, src))
    out = export(ckpt, tmp_path / "out", dst, dtype="float32")
    back = eagle3.load(out)
    assert eagle3.detect(out) == dst
    assert replace(back.config, format=src) == replace(
        ckpt.config,
        target_architectures=back.config.target_architectures,
        target_name=back.config.target_name,
    )
    assert np.array_equal(back.d2t, ckpt.d2t)
    assert sorted(back.weights) == sorted(ckpt.weights)
    for k, v in ckpt.weights.items():
        assert mx.array_equal(back.weights[k], v).item(), k
    eagle3.check_target(back, _config(target), str(target))


def test_export_refuses_what_a_format_cannot_hold(tmp_path, target):
    ckpt = eagle3.load(_draft(tmp_path, target, "speculators"))
    flagged = replace(ckpt, config=replace(ckpt.config, norm_before_residual=True))
    with pytest.raises(ModelError, match="the eagle format cannot hold .*norm_before_residual"):
        export(flagged, tmp_path / "out", "eagle")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ModelError, match="already exists"):
        export(ckpt, tmp_path / "d", "speculators")
    with pytest.raises(ModelError, match="unknown EAGLE-3 format 'medusa'"):
        export(ckpt, tmp_path / "x", "medusa")


# ------------------------------------------------------------------ the store


def test_convert_stores_a_draft_as_it_is(tmp_path, target, monkeypatch):
    from macspec.models.convert import convert
    from macspec.models.store import resolve_model, store_root

    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    src = _draft(tmp_path, target, "specforge", edit=lambda c, a: c.update(fc_norm=False))
    out = convert(str(src), output="sf-draft", dtype="float32")
    assert resolve_model("sf-draft") == out
    back, ckpt = eagle3.load(out), eagle3.load(src)
    assert back.config == ckpt.config and np.array_equal(back.d2t, ckpt.d2t)
    assert all(mx.array_equal(back.weights[k], v).item() for k, v in ckpt.weights.items())
    assert json.loads((out / "macspec.json").read_text())["format"] == "specforge"
    bad = _draft(tmp_path, target, "eagle", "bad", edit=_edit_d2t(lambda d: d.__setitem__(0, -1)))
    with pytest.raises(ModelError, match="d2t maps draft id 0 to target id -1"):
        convert(str(bad), output="bad")
    assert sorted(p.name for p in store_root().iterdir()) == ["sf-draft"]
