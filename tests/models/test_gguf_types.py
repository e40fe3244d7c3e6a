"""Every tensor type llama.cpp writes: the values the converter reads equal the reference decoding
exactly (the block formulas, written out here for the legacy types; llama.cpp's own reader and
numpy dequantization for the K- and IQ-quants), alone, all in one file, and inside a model."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
from support.gguf_arch_helpers import hf_to_gguf, make_model

from macspec.base.errors import ModelError
from macspec.cpu import native
from macspec.models import fidelity
from macspec.models.convert import convert
from macspec.models.gguf_blocks import KEPT, keep_tensor
from macspec.models.gguf_read import dequantize, read_header, readable_types

# Byte offsets of the float16 scales inside each block (ggml-common.h); random bytes there are
# replaced by small scales so that random blocks decode to finite, model-sized weights.
FP16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0],
    "IQ4_NL": [0], "IQ4_XS": [0], "TQ1_0": [52], "TQ2_0": [64],
}  # fmt: skip
SHAPE = (3, 512)  # every block size divides 512
native.load()  # the CPU kernels from the machine's cache, before a test's MACSPEC_HOME hides it


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


@pytest.mark.parametrize("kind", sorted(KEPT))
def test_blocks_mlx_can_hold_are_kept_exactly(kind, tmp_path):
    """Q8_0/Q4_0/Q4_1/Q4_K/Q5_K become MLX affine triplets (group 32) whose float32
    dequantization is gguf's own, bit for bit; Q6_K's 16-weight sub-blocks go to 8 bits with the
    coarser sub-block of each group exact and the other within a quarter of its step."""
    raw = blocks(kind, SHAPE, np.random.default_rng(3))
    path = tmp_path / f"{kind}.gguf"
    _write(path, {"t.weight": (kind, raw)})
    info = read_header(path).tensors["t.weight"]
    kept = keep_tensor(path, info)
    bits, exact = KEPT[kind]
    assert kept.weight.dtype == np.uint32 and kept.scales.dtype == kept.biases.dtype == np.float32
    assert kept.weight.shape == (SHAPE[0], SHAPE[1] * bits // 32)
    got = np.array(
        mx.dequantize(mx.array(kept.weight), mx.array(kept.scales), mx.array(kept.biases), 32, bits)
    )
    want = gguf.quants.dequantize(raw, T[kind]).reshape(SHAPE)
    if exact:
        np.testing.assert_array_equal(got, want)
        assert kept.inexact == 0
        return
    # Q6_K: per group of 32, the sub-block of larger |scale| exactly; the other one rounded
    sc = raw.reshape(SHAPE[0], -1, 210)[..., 192:208].view(np.int8).astype(np.int32)
    step = np.abs(sc.reshape(SHAPE[0], -1, 2)).max(-1)  # in units of d
    d = raw.reshape(SHAPE[0], -1, 210)[..., 208:210].copy().view(np.float16).astype(np.float32)
    big = np.repeat((step.reshape(SHAPE[0], -1, 8) * d).reshape(SHAPE[0], -1), 32, -1)
    err = np.abs(got - want)
    assert (err <= 0.25 * big * (1 + 1e-6)).all()
    assert 0 < kept.inexact == np.count_nonzero(err) < got.size / 2 + 1
    assert 0 < kept.worst <= 0.25


def test_a_q6k_group_whose_scales_share_a_factor_is_exact(tmp_path):
    """4 * sc_small / sc_big whole: both sub-blocks land on the 8-bit grid exactly."""
    raw = blocks("Q6_K", (1, 256), np.random.default_rng(4)).reshape(1, 1, 210).copy()
    raw[..., 192:208] = np.array([8, 2] * 4 + [-12, 3] * 4, np.int8).view(np.uint8)
    path = tmp_path / "q6.gguf"
    _write(path, {"t.weight": ("Q6_K", raw.reshape(1, -1))})
    kept = keep_tensor(path, read_header(path).tensors["t.weight"])
    got = mx.dequantize(*(mx.array(a) for a in (kept.weight, kept.scales, kept.biases)), 32, 8)
    want = gguf.quants.dequantize(raw.reshape(1, -1), T.Q6_K)
    np.testing.assert_array_equal(np.array(got), want)
    assert kept.inexact == 0


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_damaged_scales_name_the_tensor(kind, tmp_path):
    raw = blocks(kind, SHAPE, np.random.default_rng(5)).copy()
    at = {"Q4_K": 0, "Q6_K": 208, "Q8_0": 0}[kind]
    per = {"Q4_K": 144, "Q6_K": 210, "Q8_0": 34}[kind]
    view = raw.reshape(SHAPE[0], -1, per)
    view[1, 0, at : at + 2] = np.array([np.nan], np.float16).view(np.uint8)
    path = tmp_path / f"{kind}.gguf"
    _write(path, {"blk.0.attn_q.weight": (kind, raw)})
    with pytest.raises(ModelError, match=r"'blk\.0\.attn_q\.weight'.*not finite"):
        keep_tensor(path, read_header(path).tensors["blk.0.attn_q.weight"])


@pytest.mark.parametrize("damage", ["nan scale", "truncated"])
def test_a_damaged_k_quant_file_converts_to_nothing(damage, tmp_path):
    """A whole convert of a Q4_K_M file with a NaN super-block scale, or cut short inside its
    last tensor, raises a ModelError naming the tensor or file, and leaves no store entry."""
    from macspec.models.store import store_root

    _, path = _kquant_model(tmp_path, 9)
    info = read_header(path).tensors["blk.1.ffn_gate.weight"]
    assert info.type_name == "Q4_K"
    data = bytearray(path.read_bytes())
    if damage == "nan scale":  # d of the tensor's third super-block
        at = info.offset + 2 * 144
        data[at : at + 2] = np.array([np.nan], np.float16).tobytes()
        match = r"'blk\.1\.ffn_gate\.weight'.*not finite"
    else:
        last = max(read_header(path).tensors.values(), key=lambda t: t.offset)
        del data[last.offset + last.nbytes // 2 :]
        match = str(path.name)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=match):
        convert(str(path), output="damaged")
    root = store_root()
    assert not root.exists() or list(root.iterdir()) == []


def _gguf_model(tmp_path: Path, seed: int, kind_of, **shape) -> tuple[Path, Path]:
    """A Qwen2 (source directory, GGUF file) whose i-th 2-D weight `name` is stored as
    kind_of(i, name), random blocks; the source holds gguf's dequantization of them."""
    src = make_model(tmp_path / f"src{seed}", "qwen2", seed=seed)
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, head_dim=64, **shape)
    (src / "config.json").write_text(json.dumps(config))
    module = importlib.import_module("mlx_lm.models.qwen2")
    model = module.Model(module.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    weights, raw = {}, {}
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        if p.ndim == 2:
            kind = kind_of(i, name)
            raw[name] = (kind, blocks(kind, tuple(p.shape), rng))
            weights[name] = gguf.quants.dequantize(raw[name][1], T[kind]).reshape(p.shape)
        else:
            weights[name] = 1.0 + 0.1 * rng.normal(size=p.shape).astype(np.float32)
    mx.save_safetensors(
        str(src / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    path = tmp_path / f"model{seed}.gguf"
    hf_to_gguf(src, path, "qwen2", raw=raw)
    return src, path


def test_model_of_mixed_k_and_iq_quants(tmp_path):
    """A Qwen2 whose weights are spread over the K-, IQ-, TQ- and float types: the converted
    model's logits equal those of the same decoded weights loaded by mlx-lm."""
    kinds = [k for k in readable_types() if k in FP16_FIELDS and k not in KEPT]
    kinds += ["BF16", "F16"]
    src, path = _gguf_model(tmp_path, 11, lambda i, _: kinds[i % len(kinds)])
    types = {t.type_name for t in read_header(path).tensors.values()}
    assert len(types - {"F32"}) >= 12 and types - {"F32"} <= set(kinds)
    out = convert(str(path), output="mixed", dtype="float32")
    ids = mx.array([[1, 5, 9, 12, 30, 41, 7]])
    got = np.array(load_model(out)[0](ids))
    want = np.array(load_model(src)[0](ids))
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def _kquant_model(tmp_path: Path, seed: int, main: str = "Q4_K") -> tuple[Path, Path]:
    """A Qwen2 stored as Q4_K_M is (Q5_K_M with main="Q5_K"): Q4_K products, Q6_K v/down
    products and output head."""

    def q4_k_m(_: int, name: str) -> str:
        six = name.endswith(("v_proj.weight", "down_proj.weight", "lm_head.weight"))
        return "Q6_K" if six else main

    return _gguf_model(tmp_path, seed, q4_k_m, tie_word_embeddings=False)


def test_a_q4_k_m_file_is_kept_by_default_and_speculation_on_it_is_exact(tmp_path):
    """convert keeps Q4_K at 4 bits and Q6_K at 8, groups of 32, by default; the kept model runs
    on the native products (repacked where this build repacks) with logits near the decoded
    weights', and greedy speculation on it equals plain decoding."""
    import macspec
    from macspec.api.stream import generate
    from macspec.cpu import products

    src, path = _kquant_model(tmp_path, 5)
    out = convert(str(path), output="kept")
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization"]
    assert (quant["bits"], quant["group_size"]) == (4, 32)
    assert quant["model.layers.0.mlp.down_proj"]["bits"] == 8
    assert quant["lm_head"]["bits"] == 8 and "model.layers.0.mlp.gate_proj" not in quant
    _, draft_path = _kquant_model(tmp_path, 6)
    draft = convert(str(draft_path), output="draft", q="4")
    pair = macspec.load(str(out), str(draft), measure=False)
    layer = pair.target.model.layers[0]
    ext = native.load()
    assert products.repacked(layer.mlp.gate_proj) == (ext is not None and ext.q4_packs())
    ids = mx.array([[1, 5, 9, 12, 30, 41, 7]])
    want = np.array(load_model(src)[0](ids))
    got = np.array(load_model(out)[0](ids))
    # Q6_K's rounded sub-blocks (random scales here, far apart: worse than a real file's)
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    pair.eos_token_ids = frozenset()
    for prompt in ([1, 5, 9, 12], [30, 41, 7, 7, 7, 30, 41]):
        plain = generate(pair, prompt, max_tokens=24, speculative=False).tokens
        for k in (1, 4):
            fast = generate(pair, prompt, max_tokens=24, num_draft=k, adaptive=False)
            assert fast.tokens == plain
            assert fast.stats.drafted > 0


def test_a_q5_k_m_file_keeps_5_bits_which_the_cpu_runs_as_8_bit_integers(tmp_path):
    """Q5_K is kept at 5 bits in groups of 32 (what the store holds, for every backend); the CPU
    products take those integers widened to a byte each (products.widen): logits near mlx's own
    5-bit product on the same store model, and greedy speculation on it equals plain decoding."""
    import macspec
    from macspec.api.stream import generate
    from macspec.cpu import products

    src, path = _kquant_model(tmp_path, 8, main="Q5_K")
    out = convert(str(path), output="kept5")
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert (quant["bits"], quant["group_size"]) == (5, 32)
    assert quant["model.layers.0.mlp.down_proj"]["bits"] == 8
    ids = mx.array([[1, 5, 9, 12, 30, 41, 7]])
    stock = np.array(load_model(out)[0](ids))  # mlx's 5-bit product, float activations
    pair = macspec.load(str(out), drafter="ngram", measure=False)
    gate = pair.target.model.layers[0].mlp.gate_proj
    assert gate.bits == (8 if products.active() else 5) and gate.group_size == 32
    got = np.array(pair.target(ids))
    assert np.abs(got - stock).max() < 0.02 * np.abs(stock).max()  # int8 activations
    want = np.array(load_model(src)[0](ids))
    assert np.abs(got - want).max() < 0.03 * np.abs(want).max()
    pair.eos_token_ids = frozenset()
    prompt = [30, 41, 7, 9, 30, 41, 7, 9, 30, 41]
    plain = generate(pair, prompt, max_tokens=24, speculative=False).tokens
    for k in (2, 6):
        fast = generate(pair, prompt, max_tokens=24, num_draft=k, adaptive=False)
        assert fast.tokens == plain


def test_eval_takes_the_gguf_file_itself_as_the_reference(tmp_path):
    """`--reference FILE.gguf` decodes it to float32; the kept model is near it, a -q 4 copy
    further, and the file against its own float32 decoding is at KL 0."""
    from macspec.tools import evaluate

    src, path = _kquant_model(tmp_path, 7)
    kept = convert(str(path), output="kept")
    q4 = convert(str(path), output="q4", q="4")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 6)
    near = evaluate.evaluate(str(kept), str(text), reference=str(path), context=64)
    far = evaluate.evaluate(str(q4), str(text), reference=str(path), context=64)
    same = evaluate.evaluate(str(src), str(text), reference=str(path), context=64)
    assert same.kl_max < 1e-6 and same.top1_agreement == 1.0
    assert 0 < near.kl_mean < far.kl_mean
    # -q 4 measured what it cost at convert time, against the blocks kept, on the built-in text
    measured = json.loads((q4 / "macspec.json").read_text())["fidelity"]
    kept_model, tokenizer = fidelity.load_model(kept)
    q4_model, _ = fidelity.load_model(q4)
    ids = tokenizer.encode(fidelity.SAMPLE.read_text(encoding="utf-8"))[:512]
    again = fidelity.Report.of(fidelity.score(q4_model, ids, kept_model, context=512))
    assert measured["positions"] == again.positions > 100
    assert again.kl_mean > 0
    assert measured["kl_mean"] == pytest.approx(again.kl_mean, rel=1e-4, abs=1e-6)
    assert measured["top1_agreement"] == pytest.approx(again.top1_agreement, abs=1e-4)
    assert "fidelity" not in json.loads((kept / "macspec.json").read_text())
    unmeasured = convert(str(path), output="q8", q="8", measure=False)
    assert "fidelity" not in json.loads((unmeasured / "macspec.json").read_text())
