"""Every supported GGUF architecture: a tiny model written as llama.cpp writes it converts to a
model with the logits mlx-lm computes for the same weights from a Hugging Face directory."""

from __future__ import annotations

import json
from dataclasses import replace

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model
from support.gguf_arch_helpers import CASES, GEMMA, hf_to_gguf, make_model

from macspec.base.errors import ConvertError
from macspec.models import gguf_arch
from macspec.models.convert import convert
from macspec.models.store import store_root

# longer than gemma3's test window (4), so that the sliding window matters
IDS = [1, 5, 9, 12, 30, 41, 7, 3, 200, 17, 60, 9]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))


def _logits(path) -> np.ndarray:
    model, _ = load_model(path)
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


def test_every_supported_architecture_has_a_case():
    assert {arch for arch, _ in CASES.values()} == set(gguf_arch.supported())


@pytest.mark.parametrize("case", sorted(CASES))
def test_architecture_logits_match_mlx_lm(case, tmp_path):
    src = make_model(tmp_path / "src", case, seed=sorted(CASES).index(case))
    path = tmp_path / f"{case}.gguf"
    hf_to_gguf(src, path, case)
    out = convert(str(path), output=case, dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == json.loads((src / "config.json").read_text())["model_type"]
    want = _logits(src)
    assert np.abs(want).max() > 1.0  # the random weights give logits far from uniform
    np.testing.assert_allclose(_logits(out), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["llama", "gemma3", "phi3-longrope", "gemma2", "qwen3-yarn"])
def test_each_transform_matters(case, tmp_path, monkeypatch):
    """Negative controls: leaving out what llama.cpp did (Q/K permutation, Gemma's +1 on norms)
    or what the file says (Gemma 3's sliding-window pattern, Phi-3's longrope factors) changes the
    logits, so the equality above does check them."""
    src = make_model(tmp_path / "src", case, seed=1)
    path = tmp_path / f"{case}.gguf"
    hf_to_gguf(src, path, case)
    spec = gguf_arch.ARCHS[CASES[case][0]]
    if case == "llama":
        monkeypatch.setitem(gguf_arch.ARCHS, "llama", replace(spec, permute_qk=False))
    elif case == "gemma3":
        extra = spec.extra

        def no_window(m, c):
            return {**extra(m, c), "sliding_window_pattern": 1}

        monkeypatch.setitem(gguf_arch.ARCHS, "gemma3", replace(spec, extra=no_window))
    elif case == "gemma2":
        monkeypatch.setitem(gguf_arch.ARCHS, "gemma2", replace(spec, norm_shift=0.0))
    else:
        monkeypatch.setattr(gguf_arch, "_rope_scaling", lambda *a: None)
    out = convert(str(path), output="wrong", dtype="float32")
    assert not np.allclose(_logits(out), _logits(src), atol=1e-3)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_1"])
def test_quantized_moe_and_gemma(qtype, tmp_path):
    """Quantized GGUFs of the MoE and Gemma families: decoded (-q none) they equal the reference
    built from the same decoded weights; kept (-q keep) Q8_0/Q4_0 stay MLX blocks, experts too."""
    for case in ("qwen3moe", "gemma3"):
        src = make_model(tmp_path / case, case, seed=2)
        path = tmp_path / f"{case}.{qtype}.gguf"
        hf_to_gguf(src, path, case, qtype)
        # the reference: the same model with each 2-D weight replaced by its decoded blocks
        ref_dir = tmp_path / f"{case}-ref"
        ref_dir.mkdir()
        weights = mx.load(str(src / "model.safetensors"))
        for k, v in weights.items():
            if v.ndim >= 2:
                t = gguf.GGMLQuantizationType[qtype]
                a = np.array(v.astype(mx.float32))
                weights[k] = mx.array(gguf.quants.dequantize(gguf.quants.quantize(a, t), t))
        mx.save_safetensors(str(ref_dir / "model.safetensors"), weights)
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (ref_dir / f).write_bytes((src / f).read_bytes())
        full = convert(str(path), output=f"{case}-{qtype}", dtype="float32")
        np.testing.assert_allclose(_logits(full), _logits(ref_dir), rtol=1e-4, atol=1e-4)
        kept = convert(str(path), output=f"{case}-{qtype}-keep", q="keep", dtype="float32")
        config = json.loads((kept / "config.json").read_text())
        if qtype == "Q5_1":
            assert "quantization" not in config
        else:
            assert config["quantization"]["bits"] == {"Q8_0": 8, "Q4_0": 4}[qtype]
        tol = 2e-2 if case in GEMMA else 5e-3  # MLX dequantizes in float32 from float16 scales
        np.testing.assert_allclose(_logits(kept), _logits(ref_dir), rtol=tol, atol=tol)


def test_unknown_architecture_is_refused_before_any_work(tmp_path, monkeypatch):
    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from macspec.models import gguf as mgguf

    def boom(*a, **k):
        raise AssertionError("decoded a tensor of an unsupported architecture")

    monkeypatch.setattr(mgguf, "dequantize", boom)
    with pytest.raises(ConvertError, match="architecture 'bert' is not supported") as e:
        convert(str(path), output="bert")
    for arch in ("gemma3", "llama", "phi3", "qwen3moe"):
        assert arch in str(e.value)
    assert not store_root().exists() or not any(store_root().iterdir())
