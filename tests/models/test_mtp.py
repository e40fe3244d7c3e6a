"""MTP heads kept by `macspec convert`: the target stays what mlx-lm loads, the heads compute what
the published reference computes (checked against mlx-lm's own transforms of the same tensors),
and malformed checkpoints are refused by file and key with nothing left in the store."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.utils import _get_classes, load_model
from support.drafter_models import MTP_ARCHS, ZERO_CENTRED, make_mtp_checkpoint, mtp_trunk
from support.tinymodels import make_tiny_model

from macspec import cli
from macspec.base.errors import ModelError
from macspec.models import compat, mtp
from macspec.models.convert import convert
from macspec.models.mtp_extract import owns
from macspec.models.store import model_info, store_root

COUNTS = {"deepseek_v3": 2, "glm4_moe": 2, "qwen3_next": 2, "qwen3_5": 1, "mimo": 2}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-src")
    return {a: make_mtp_checkpoint(root / a, a, count=COUNTS[a], seed=3) for a in MTP_ARCHS}


def _hf(src) -> dict:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def _store() -> list[str]:
    root = store_root()
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def _copy(src, tmp_path, edit):
    """A copy of a checkpoint with its weights changed by edit(weights) (one file)."""
    dst = tmp_path / "edited"
    shutil.copytree(src, dst)
    weights = _hf(dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    (dst / "model.safetensors.index.json").unlink()
    edit(weights)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "pt"})
    return dst


# ------------------------------------------------------------------ a reference forward


def _rms(x, gain, eps):
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def _reference_block(src, arch, i):
    """MTP head i's decoder layer as mlx-lm treats a layer of the model: its published tensors
    put in place of trunk layer `block`, the whole checkpoint through mlx-lm's own sanitize."""
    config = json.loads((src / "config.json").read_text())
    layout = mtp.layout_for(config)
    text = mtp.text_config(config)
    L, j = text["num_hidden_layers"], MTP_ARCHS[arch]["block"]
    weights = _hf(src)
    prefix = layout.prefix(L, i)
    parts = {n for _, n in layout.fusion + layout.copies}
    trunk = f"model.language_model.layers.{j}." if arch == "qwen3_5" else f"model.layers.{j}."
    hf = {k: v for k, v in weights.items() if not owns(layout, k, L) and not k.startswith(trunk)}
    for k, v in weights.items():
        if k.startswith(prefix) and k[len(prefix) :] not in parts:
            hf[trunk + k[len(prefix) :]] = v
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.load_weights(list(model.sanitize(hf).items()))
    return model.layers[j], weights, layout, L


def _reference(src, arch, i, hidden, embeds):
    block, weights, layout, L = _reference_block(src, arch, i)
    base = layout.shared_prefix or layout.prefix(L, i)
    names = dict(layout.fusion)
    eps = mtp.text_config(json.loads((src / "config.json").read_text()))["rms_norm_eps"]

    def gain(name):
        g = weights[base + names[name]]
        return g + 1.0 if arch in ZERO_CENTRED else g  # zero-centred RMSNorm: x * (1 + w)

    e, h = _rms(embeds, gain("embed_norm"), eps), _rms(hidden, gain("hidden_norm"), eps)
    x = mx.concatenate([h, e] if layout.order == "hidden_embed" else [e, h], axis=-1)
    x = x @ weights[base + names["proj"]].T
    out = block(x, create_attention_mask(x, None, return_array=True), None)
    return out, _rms(out, gain("out_norm"), eps)


# ------------------------------------------------------------------ conversion


@pytest.mark.parametrize("arch", list(MTP_ARCHS))
def test_convert_keeps_heads_and_leaves_the_model_as_mlx_lm_loads_it(sources, arch):
    out = convert(str(sources[arch]), output=arch, dtype="float32")
    model, _ = load_model(out)
    want = dict(tree_flatten(mtp_trunk(arch, COUNTS[arch], seed=3).parameters()))
    have = dict(tree_flatten(model.parameters()))
    assert sorted(have) == sorted(want)
    for k, v in want.items():
        assert mx.array_equal(have[k], v).item(), k
    cfg = mtp.read_config(out)
    assert (cfg.count, cfg.block_layer) == (COUNTS[arch], MTP_ARCHS[arch]["block"])
    assert not cfg.own_embed and not cfg.own_head  # the copies equal the target's: not kept
    info = json.loads((out / "macspec.json").read_text())
    assert info["mtp"] == cfg.describe()
    assert model_info(out).mtp == cfg.describe()


@pytest.mark.parametrize("arch", list(MTP_ARCHS))
def test_each_head_computes_the_published_forward(sources, arch):
    out = convert(str(sources[arch]), output=arch, dtype="float32")
    model, _ = load_model(out)
    cfg, heads = mtp.read_heads(out, model)
    assert cfg.layout == mtp.layout_for({"model_type": arch}).name
    key = mx.random.key(5)
    h, e = (mx.random.normal((1, 6, cfg.hidden_size), key=k) for k in mx.random.split(key))
    for i, head in enumerate(heads):
        want_out, want_normed = _reference(sources[arch], arch, i, h, e)
        got = head(h, e, mtp.MtpHead.make_mask(h), None)
        np.testing.assert_allclose(np.array(got), np.array(want_out), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(
            np.array(head.normed(got)), np.array(want_normed), rtol=1e-4, atol=1e-4
        )


def test_the_fusion_order_and_norm_convention_matter(sources):
    """The reference check above fails when MiMo's (hidden, embed) order is swapped or the
    Qwen gains are read without their +1: it can tell the layouts apart."""
    out = convert(str(sources["mimo"]), output="mimo", dtype="float32")
    model, _ = load_model(out)
    _, heads = mtp.read_heads(out, model)
    h, e = mx.random.normal((1, 4, 32)), mx.random.normal((1, 4, 32))
    want, _ = _reference(sources["mimo"], "mimo", 0, h, e)
    heads[0].hidden_first = False
    assert not np.allclose(
        np.array(heads[0](h, e, mtp.MtpHead.make_mask(h))), np.array(want), atol=1e-3
    )
    out = convert(str(sources["qwen3_next"]), output="qn", dtype="float32")
    model, _ = load_model(out)
    _, heads = mtp.read_heads(out, model)
    heads[0].embed_norm.weight = heads[0].embed_norm.weight - 1.0
    want, _ = _reference(sources["qwen3_next"], "qwen3_next", 0, h, e)
    assert not np.allclose(
        np.array(heads[0](h, e, mtp.MtpHead.make_mask(h))), np.array(want), atol=1e-3
    )


def test_fp8_head_weights_are_decoded_as_mlx_lm_decodes_the_model(sources, tmp_path):
    def to_fp8(weights):
        key = "model.layers.3.self_attn.o_proj.weight"
        w = weights[key]
        weights[key] = mx.to_fp8(w / 2.0)
        weights[key + "_scale_inv"] = mx.full((1, 1), 2.0)

    src = _copy(sources["deepseek_v3"], tmp_path, to_fp8)
    out = convert(str(src), output="fp8", dtype="float32")
    model, _ = load_model(out)
    _, heads = mtp.read_heads(out, model)
    h, e = mx.random.normal((1, 3, 32)), mx.random.normal((1, 3, 32))
    want, _ = _reference(src, "deepseek_v3", 1, h, e)
    got = heads[1](h, e, mtp.MtpHead.make_mask(h))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-3, atol=1e-3)


def test_a_differing_copy_of_the_output_head_is_kept(sources, tmp_path):
    def perturb(weights):
        for key in (
            "model.layers.2.shared_head.head.weight",
            "model.layers.3.shared_head.head.weight",
        ):
            weights[key] = weights[key] * 1.5

    src = _copy(sources["deepseek_v3"], tmp_path, perturb)
    out = convert(str(src), output="own-head", dtype="float32")
    cfg = mtp.read_config(out)
    assert cfg.own_head and not cfg.own_embed
    model, _ = load_model(out)
    _, heads = mtp.read_heads(out, model)
    want = _hf(src)["model.layers.3.shared_head.head.weight"]
    assert mx.array_equal(heads[1].head.weight, want).item()


def test_quantized_conversion_quantizes_the_heads_like_the_model(sources):
    out = convert(str(sources["deepseek_v3"]), output="q4", q="4", group_size=32)
    cfg = mtp.read_config(out)
    assert cfg.quantization["bits"] == 4 and cfg.quantization["group_size"] == 32
    model, _ = load_model(out)
    _, heads = mtp.read_heads(out, model)

    def kinds(module):
        return {k: (type(m).__name__, getattr(m, "bits", None)) for k, m in module.named_modules()}

    # The block is quantized exactly as the model's own layer of its kind.
    assert kinds(heads[1].block) == kinds(model.layers[cfg.block_layer])
    assert "QuantizedSwitchLinear" in {t for t, _ in kinds(heads[1].block).values()}
    assert type(heads[1].proj).__name__ == "QuantizedLinear"


def test_mtp_can_be_dropped_and_is_kept_by_default(sources):
    convert(str(sources["mimo"]), output="kept", dtype="float32")
    assert (store_root() / "kept" / mtp.META).is_file()
    out = convert(str(sources["mimo"]), output="dropped", dtype="float32", mtp="drop")
    assert not (out / mtp.META).exists() and not (out / mtp.WEIGHTS).exists()
    assert model_info(out).mtp is None


def test_cli_flags(sources, capsys):
    assert cli.main(["convert", str(sources["mimo"]), "-o", "a", "--dtype", "float32"]) == 0
    assert (store_root() / "a" / mtp.META).is_file()
    assert cli.main(["convert", str(sources["mimo"]), "-o", "b", "--no-mtp"]) == 0
    assert not (store_root() / "b" / mtp.META).exists()
    assert cli.main(["models"]) == 0
    assert "2 MTP heads" in capsys.readouterr().out


# ------------------------------------------------------------------ refused


def test_require_refuses_a_model_without_heads(tmp_path):
    src = make_tiny_model(tmp_path / "plain", seed=1)
    with pytest.raises(ModelError, match="no MTP heads.*'llama'"):
        convert(str(src), output="x", mtp="require")
    assert _store() == []
    assert cli.main(["convert", str(src), "-o", "y", "--mtp"]) == 1
    assert _store() == []


def test_declared_but_absent_heads(sources, tmp_path):
    src = _copy(
        sources["glm4_moe"],
        tmp_path,
        lambda w: [w.pop(k) for k in list(w) if ".layers.2." in k or ".layers.3." in k],
    )
    with pytest.raises(ModelError, match="declares 2 MTP head.*no \\*.safetensors holds"):
        convert(str(src), output="x", mtp="require")
    assert _store() == []
    out = convert(str(src), output="auto")  # auto: the model converts, without heads
    assert not (out / mtp.META).exists()


@pytest.mark.parametrize(
    ("arch", "key", "message"),
    [
        (
            "deepseek_v3",
            "model.layers.3.eh_proj.weight",
            "MTP head 1 lacks 'model.layers.3.eh_proj",
        ),
        ("qwen3_next", "mtp.fc.weight", "lacks 'mtp.fc.weight'"),
        ("mimo", "model.mtp_layers.1.final_layernorm.weight", "lacks 'model.mtp_layers.1.final"),
        (
            "glm4_moe",
            "model.layers.2.mlp.experts.2.up_proj.weight",
            "lacks 'model.layers.2.mlp.experts.2.up",
        ),
        ("qwen3_5", "mtp.layers.0.self_attn.o_proj.weight", "lacks 'self_attn.o_proj.weight'"),
    ],
)
def test_a_truncated_head_is_refused_by_key(sources, tmp_path, arch, key, message):
    src = _copy(sources[arch], tmp_path, lambda w: w.pop(key))
    with pytest.raises(ModelError, match=message) as e:
        convert(str(src), output="x", dtype="float32")
    assert str(src) in str(e.value)
    assert _store() == []


def test_a_missing_head_and_a_wrong_shape_are_refused(sources, tmp_path):
    drop = lambda w: [w.pop(k) for k in list(w) if k.startswith("model.mtp_layers.1.")]  # noqa: E731
    with pytest.raises(ModelError, match="declares 2 MTP heads.*'model.mtp_layers.1.\\*'"):
        convert(str(_copy(sources["mimo"], tmp_path, drop)), output="x")
    shutil.rmtree(tmp_path / "edited")

    def narrow(w):
        w["model.layers.2.eh_proj.weight"] = w["model.layers.2.eh_proj.weight"][:, :32]

    with pytest.raises(ModelError, match="'model.layers.2.eh_proj.weight' has shape \\[32, 32\\]"):
        convert(str(_copy(sources["deepseek_v3"], tmp_path, narrow)), output="x")
    assert _store() == []


def test_stored_heads_that_are_truncated_or_foreign_are_refused(sources, tmp_path):
    out = convert(str(sources["mimo"]), output="m", dtype="float32")
    model, _ = load_model(out)
    weights = mx.load(str(out / mtp.WEIGHTS))
    weights.pop("heads.1.block.mlp.down_proj.weight")
    mx.save_safetensors(str(out / mtp.WEIGHTS), weights)
    with pytest.raises(ModelError, match="lacks 'heads.1.block.mlp.down_proj.weight'"):
        mtp.read_heads(out, model)
    other, _ = load_model(convert(str(sources["glm4_moe"]), output="g", dtype="float32"))
    with pytest.raises(ModelError, match="mimo of width 32, not this glm4_moe"):
        mtp.read_heads(out, other)
    (out / mtp.META).unlink()
    with pytest.raises(ModelError, match="keeps no MTP heads"):
        mtp.read_heads(out, model)


def test_check_says_the_target_carries_heads(sources, tmp_path, capsys):
    target = convert(str(sources["qwen3_5"]), output="t", dtype="float32")
    report = compat.check(target, target)
    assert report.mtp == {"target": "1 MTP head (qwen3_next layout)", "draft": report.mtp["draft"]}
    assert "the target carries 1 MTP head (qwen3_next layout)" in report.format()
    plain = make_tiny_model(tmp_path / "plain", seed=1)
    assert compat.check(plain, plain).mtp == {}


# The fusion tensors of head 0 as the reference code names and shapes them (H = 32, V = 72):
# vLLM deepseek_mtp.py@03356f8c / glm4_moe_mtp.py@028aedf6, qwen3_next_mtp.py@055e47c2 /
# qwen3_5_mtp.py@01d99805, mimo_mtp.py@0bb55d60; the count field each reads from the config.
PUBLISHED = {
    "deepseek_v3": (
        "num_nextn_predict_layers",
        {
            "model.layers.2.enorm.weight": [32],
            "model.layers.2.hnorm.weight": [32],
            "model.layers.2.eh_proj.weight": [32, 64],
            "model.layers.2.shared_head.norm.weight": [32],
            "model.layers.2.shared_head.head.weight": [72, 32],
            "model.layers.2.embed_tokens.weight": [72, 32],
            "model.layers.2.self_attn.kv_b_proj.weight": [64, 16],
            "model.layers.2.mlp.experts.3.down_proj.weight": [32, 32],
            "model.layers.2.mlp.gate.e_score_correction_bias": [4],
        },
    ),
    "glm4_moe": (
        "num_nextn_predict_layers",
        {
            "model.layers.2.eh_proj.weight": [32, 64],
            "model.layers.2.shared_head.head.weight": [72, 32],
            "model.layers.2.mlp.experts.0.gate_proj.weight": [32, 32],
            "model.layers.2.self_attn.q_norm.weight": [8],
        },
    ),
    "qwen3_next": (
        "num_nextn_predict_layers",
        {
            "mtp.fc.weight": [32, 64],
            "mtp.pre_fc_norm_embedding.weight": [32],
            "mtp.pre_fc_norm_hidden.weight": [32],
            "mtp.norm.weight": [32],
            "mtp.layers.0.self_attn.q_proj.weight": [64, 32],
            "mtp.layers.1.mlp.experts.3.up_proj.weight": [32, 32],
            "mtp.layers.0.mlp.shared_expert_gate.weight": [1, 32],
        },
    ),
    "qwen3_5": (
        "mtp_num_hidden_layers",
        {
            "mtp.fc.weight": [32, 64],
            "mtp.norm.weight": [32],
            "mtp.layers.0.self_attn.q_norm.weight": [8],
            "mtp.layers.0.mlp.down_proj.weight": [32, 64],
        },
    ),
    "mimo": (
        "num_nextn_predict_layers",
        {
            "model.mtp_layers.0.token_layernorm.weight": [32],
            "model.mtp_layers.0.hidden_layernorm.weight": [32],
            "model.mtp_layers.0.input_proj.weight": [32, 64],
            "model.mtp_layers.1.final_layernorm.weight": [32],
            "model.mtp_layers.0.self_attn.q_proj.bias": [32],
        },
    ),
}


@pytest.mark.parametrize("arch", list(PUBLISHED))
def test_the_tiny_checkpoints_hold_the_published_names_and_shapes(sources, arch):
    from macspec.models.mtp_extract import index

    count_key, keys = PUBLISHED[arch]
    config = json.loads((sources[arch] / "config.json").read_text())
    assert mtp.text_config(config)[count_key] == COUNTS[arch]
    held = index(sources[arch])
    for key, shape in keys.items():
        assert held[key][1] == shape, key
    # and the trunk in its published form: raw conv1d kernels, zero-centred gains
    if arch in ZERO_CENTRED:
        conv = next(s for k, (_, s) in held.items() if k.endswith("conv1d.weight"))
        assert conv[1] == 1 and conv[2] == 4
