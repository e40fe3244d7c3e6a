"""Every tensor type llama.cpp writes: the values the converter reads equal the reference decoding
exactly (the block formulas, written out here for the legacy types; llama.cpp's own reader and
numpy dequantization for the K- and IQ-quants), alone, all in one file, and inside a model."""

from __future__ import annotations

import importlib
import json

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
from support.gguf_arch_helpers import hf_to_gguf, make_model

from macspec.models.convert import convert
from macspec.models.gguf_read import KEEP_BITS, dequantize, read_header, readable_types, to_affine

# Byte offsets of the float16 scales inside each block (ggml-common.h); random bytes there are
# replaced by small scales so that random blocks decode to finite, model-sized weights.
FP16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0],
    "IQ4_NL": [0], "IQ4_XS": [0], "TQ1_0": [52], "TQ2_0": [64],
}  # fmt: skip
SHAPE = (3, 512)  # every block size divides 512


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))


def blocks(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF bytes of a (rows, cols) tensor: quantized random weights where the gguf package
    can quantize, else random blocks with sane scales."""
    qt = T[kind]
    values = rng.normal(0, 0.5, shape).astype(np.float32)
    if kind == "F32":
        return values
    try:
        return gguf.quants.quantize(values, qt)
    except NotImplementedError:
        pass
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    for at in FP16_FIELDS.get(kind, []):
        scale = rng.uniform(0.0005, 0.004, raw.shape[:2]).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(shape[0], -1)


def _legacy(raw: np.ndarray, kind: str) -> np.ndarray:
    """The legacy block formats decoded from ggml-common.h's definitions, independently."""
    if kind in ("F16", "BF16"):
        if kind == "F16":
            return raw.view(np.float16).astype(np.float32)
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[kind]
    b = raw.reshape(raw.shape[0], -1, size)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        return (b[..., 2:].view(np.int8) * d).reshape(raw.shape[0], -1)
    m = b[..., 2:4].copy().view(np.float16).astype(np.float32) if kind in ("Q4_1", "Q5_1") else 0
    qs = b[..., size - 16 :]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int32)
    if kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        qh = b[..., at : at + 4].copy().view(np.uint32)
        q |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int32)
    offset = {"Q4_0": 8, "Q5_0": 16}.get(kind, 0)
    return ((q - offset) * d + m).reshape(raw.shape[0], -1)


def _write(path, tensors: dict) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (kind, raw) in tensors.items():
        if kind == "F32":
            w.add_tensor(name, raw)
        else:
            w.add_tensor(name, raw, raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _reference(path) -> dict[str, np.ndarray]:
    """llama.cpp's reader and dequantization: the values each tensor stands for."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        with np.errstate(all="ignore"):
            out[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(SHAPE)
    return out


def test_every_type_llama_cpp_writes_is_readable():
    want = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS"}
    want |= {f"Q{i}_K" for i in range(2, 7)} | {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"}
    want |= {"IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"}
    assert want <= set(readable_types())


@pytest.mark.parametrize("kind", readable_types())
def test_each_type_decodes_exactly(kind, tmp_path):
    rng = np.random.default_rng(sorted(readable_types()).index(kind))
    raw = blocks(kind, SHAPE, rng)
    path = tmp_path / f"{kind}.gguf"
    _write(path, {"t.weight": (kind, raw)})
    info = read_header(path).tensors["t.weight"]
    assert info.shape == SHAPE and info.type_name == kind
    got = dequantize(path, info)
    np.testing.assert_array_equal(got, _reference(path)["t.weight"])
    if kind not in ("F32",) and (kind in FP16_FIELDS or kind in ("F16", "BF16")):
        assert np.isfinite(got).all() and np.abs(got).max() > 0
    if kind in ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        np.testing.assert_array_equal(got, _legacy(raw, kind))


def test_one_file_with_a_tensor_of_each_type(tmp_path):
    rng = np.random.default_rng(7)
    kinds = readable_types()
    tensors = {f"t{i}.{k.lower()}.weight": (k, blocks(k, SHAPE, rng)) for i, k in enumerate(kinds)}
    path = tmp_path / "all.gguf"
    _write(path, tensors)
    header = read_header(path)
    assert [t.type_name for t in header.tensors.values()] == kinds
    reference = _reference(path)
    for name, info in header.tensors.items():
        np.testing.assert_array_equal(dequantize(path, info), reference[name], err_msg=name)


@pytest.mark.parametrize("kind", sorted(KEEP_BITS))
def test_blocks_mlx_shares_are_repacked_exactly(kind, tmp_path):
    """Q8_0/Q4_0/Q4_1 become MLX affine triplets (group 32) holding the very same values."""
    raw = blocks(kind, SHAPE, np.random.default_rng(3))
    path = tmp_path / f"{kind}.gguf"
    _write(path, {"t.weight": (kind, raw)})
    info = read_header(path).tensors["t.weight"]
    weight, scales, biases = to_affine(path, info)
    assert weight.dtype == np.uint32 and scales.dtype == biases.dtype == np.float16
    got = mx.dequantize(
        mx.array(weight),
        mx.array(scales).astype(mx.float32),
        mx.array(biases).astype(mx.float32),
        group_size=32,
        bits=KEEP_BITS[kind],
    )
    np.testing.assert_array_equal(np.array(got), _legacy(raw, kind))


def test_model_of_mixed_k_and_iq_quants(tmp_path):
    """A Qwen2 whose weights are spread over the K-, IQ-, TQ- and float types: the converted
    model's logits equal those of the same decoded weights loaded by mlx-lm."""
    src = make_model(tmp_path / "src", "qwen2", seed=5)
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, head_dim=64)
    (src / "config.json").write_text(json.dumps(config))
    kinds = [k for k in readable_types() if k in FP16_FIELDS and k not in KEEP_BITS]
    kinds += ["BF16", "F16"]
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    rng = np.random.default_rng(11)
    weights, raw = {}, {}
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        if p.ndim == 2:
            kind = kinds[i % len(kinds)]
            raw[name] = (kind, blocks(kind, tuple(p.shape), rng))
            weights[name] = gguf.quants.dequantize(raw[name][1], T[kind]).reshape(p.shape)
        else:
            weights[name] = 1.0 + 0.1 * rng.normal(size=p.shape).astype(np.float32)
    mx.save_safetensors(
        str(src / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    path = tmp_path / "mixed.gguf"
    hf_to_gguf(src, path, "qwen2", raw=raw)
    types = {t.type_name for t in read_header(path).tensors.values()}
    assert {k for k, _ in raw.values()} <= types and len(types) >= 12
    out = convert(str(path), output="mixed", dtype="float32")
    ids = mx.array([[1, 5, 9, 12, 30, 41, 7]])
    got = np.array(load_model(out)[0](ids))
    want = np.array(load_model(src)[0](ids))
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
