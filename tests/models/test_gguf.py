"""GGUF -> MLX: a tiny model written as llama.cpp writes it converts back to the same model."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model, load_tokenizer
from support import gguf_helpers
from support.gguf_helpers import hf_to_gguf, make_bpe_model
from support.tinymodels import make_tiny_model

from macspec.base.errors import ConvertError
from macspec.models.convert import convert
from macspec.models.store import store_root

TEXTS = [
    "The quick brown fox, it's 12345 o'clock!",
    "  two  spaces\n\n\ttab\r\nCRLF and naïve café ünïcödé 日本 🤖",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x**2  # 3.14",
]
IDS = [1, 5, 40, 41, 100, 7, 200, 3, 9, 250, 17, 60]


@pytest.fixture(autouse=True)
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "models"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_bpe_model(tmp_path_factory.mktemp("src") / "tiny", seed=3, scale=4.0)


def _logits(model) -> np.ndarray:
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


def _reference_logits(src, weights: dict) -> np.ndarray:
    model, _ = load_model(src)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return _logits(model)


def _store_listing():
    root = store_root()
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_f32_gguf_gives_same_logits_and_tokenization(source, tmp_path):
    gguf = tmp_path / "tiny.f32.gguf"
    reference = hf_to_gguf(source, gguf, "f32")
    path = convert(str(gguf), output="tiny", dtype="float32")
    model, config = load_model(path)
    np.testing.assert_allclose(_logits(model), _reference_logits(source, reference), atol=1e-5)
    np.testing.assert_allclose(_logits(model), _logits(load_model(source)[0]), atol=1e-5)
    assert config["tie_word_embeddings"] is True and config["eos_token_id"] == 2

    original, rebuilt = load_tokenizer(source), load_tokenizer(path)
    for text in TEXTS:
        ids = original.encode(text, add_special_tokens=False)
        assert rebuilt.encode(text, add_special_tokens=False) == ids, text
        assert rebuilt.decode(ids) == text
    messages = [{"role": "user", "content": "Hi 42"}]
    kwargs = {"add_generation_prompt": True, "tokenize": False}
    assert rebuilt.apply_chat_template(messages, **kwargs) == original.apply_chat_template(
        messages, **kwargs
    )
    assert rebuilt.eos_token_ids == {2}
    assert json.loads((path / "macspec.json").read_text())["kind"] == "gguf"


def test_qk_permutation_is_undone(source, tmp_path, monkeypatch):
    """Negative control: a GGUF whose Q/K rows were NOT permuted converts to a different model, so
    the logits comparison above does detect the rotary row order."""
    monkeypatch.setattr(gguf_helpers, "permute", lambda w, n: w)
    gguf = tmp_path / "unpermuted.gguf"
    reference = hf_to_gguf(source, gguf, "f32")
    model, _ = load_model(convert(str(gguf), output="wrong", dtype="float32"))
    assert not np.allclose(_logits(model), _reference_logits(source, reference), atol=1e-3)


def test_f16_gguf(source, tmp_path):
    gguf = tmp_path / "tiny.f16.gguf"
    reference = hf_to_gguf(source, gguf, "f16")
    model, _ = load_model(convert(str(gguf), output="tiny-f16", dtype="float32"))
    np.testing.assert_allclose(_logits(model), _reference_logits(source, reference), atol=1e-4)


@pytest.mark.parametrize("kind,bits", [("q8_0", 8), ("q4_0", 4), ("q4_1", 4)])
def test_block_formats_kept_or_dequantized(source, tmp_path, kind, bits):
    gguf = tmp_path / f"tiny.{kind}.gguf"
    reference = hf_to_gguf(source, gguf, kind)
    expected = _reference_logits(source, reference)

    kept, config = load_model(convert(str(gguf), f"{kind}-keep", dtype="float32"))  # the default
    assert config["quantization"]["bits"] == bits
    assert config["quantization"]["group_size"] == 32
    np.testing.assert_allclose(_logits(kept), expected, atol=2e-3)

    full, config = load_model(convert(str(gguf), f"{kind}-f32", q="none", dtype="float32"))
    assert "quantization" not in config
    np.testing.assert_allclose(_logits(full), expected, atol=1e-4)


def _meta_gguf(path, meta, tensors=None):
    tensors = tensors or {"token_embd.weight": mx.zeros((8, 32))}
    mx.save_gguf(str(path), tensors, meta)


@pytest.mark.parametrize(
    "meta,message",
    [
        ({"general.architecture": "gpt2"}, "architecture 'gpt2' is not supported"),
        ({"general.architecture": "llama"}, "lacks 'llama.embedding_length'"),
    ],
)
def test_unsupported_gguf_is_refused(tmp_path, meta, message):
    path = tmp_path / "bad.gguf"
    _meta_gguf(path, meta)
    with pytest.raises(ConvertError, match=message) as e:
        convert(str(path), output="bad")
    assert str(path) in str(e.value)
    assert _store_listing() == []


def test_gguf_without_tokenizer_or_with_unknown_pre(source, tmp_path, monkeypatch):
    gguf = tmp_path / "t.gguf"
    hf_to_gguf(source, gguf, "f32", pre="no-such-pre")
    with pytest.raises(ConvertError, match="unknown BPE pre-tokenizer 'no-such-pre'"):
        convert(str(gguf), output="t")
    monkeypatch.setattr(gguf_helpers, "tokenizer_metadata", lambda src, pre: {})
    hf_to_gguf(source, gguf, "f32")
    with pytest.raises(ConvertError, match="has no tokenizer"):
        convert(str(gguf), output="t")
    assert _store_listing() == []


def test_truncated_and_fake_gguf(source, tmp_path):
    gguf = tmp_path / "t.gguf"
    hf_to_gguf(source, gguf, "q8_0")
    data = gguf.read_bytes()
    gguf.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ConvertError, match="truncated or damaged"):
        convert(str(gguf), output="t")
    fake = tmp_path / "fake.gguf"
    fake.write_text("not really")
    with pytest.raises(ConvertError, match="not a GGUF file"):
        convert(str(fake), output="t")
    assert _store_listing() == []


def test_unknown_tensor_is_named(source, tmp_path, monkeypatch):
    gguf = tmp_path / "t.gguf"
    original = gguf_helpers.gguf_name

    def renamed(name):
        return "blk.0.mystery.weight" if "v_proj" in name else original(name)

    monkeypatch.setattr(gguf_helpers, "gguf_name", renamed)
    hf_to_gguf(source, gguf, "f32")
    with pytest.raises(ConvertError, match="unexpected tensor 'blk.0.mystery.weight'"):
        convert(str(gguf), output="t")


def test_sentencepiece_gguf_tokenizes_like_sentencepiece(tmp_path):
    """A llama-type ("llama" = SentencePiece) GGUF vocabulary rebuilds into a tokenizer that
    encodes plain text exactly as SentencePiece (and llama.cpp) do, BOS included."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(gguf_helpers.CORPUS),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",  # as Llama's: llama.cpp applies no normalizer
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    (tmp_path / "sp.model").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    src = make_tiny_model(tmp_path / "src", vocab_rows=400)  # its own tokenizer goes unused
    gguf = tmp_path / "spm.gguf"
    hf_to_gguf(src, gguf, "f32", tok_meta=gguf_helpers.spm_metadata(tmp_path / "sp.model"))
    tokenizer = load_tokenizer(convert(str(gguf), output="spm"))
    for text in TEXTS[:2] + TEXTS[3:] + ["  leading spaces", "x", "The draft proposes."]:
        ids = [sp.bos_id()] + sp.encode(text)
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.decode(ids[1:]) == text


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """Llama 3.1-style rope: GGUF keeps only per-frequency factors (rope_freqs); the converter
    recovers rope_scaling and the model's logits match the source's."""
    src = make_bpe_model(tmp_path / "src", seed=4, scale=4.0)
    config = json.loads((src / "config.json").read_text())
    config["rope_theta"] = 1e6  # so that one frequency is scaled, one smoothed, two kept
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    (src / "config.json").write_text(json.dumps(config))
    factors = gguf_helpers.llama3_rope_freqs(config)
    assert (factors == 1).sum() == 2 and factors.max() == 8 and 1 < factors[2] < 8
    gguf = tmp_path / "l3.gguf"
    hf_to_gguf(src, gguf, "f32")
    path = convert(str(gguf), output="l3", dtype="float32")
    assert json.loads((path / "config.json").read_text())["rope_scaling"] == config["rope_scaling"]
    np.testing.assert_allclose(_logits(load_model(path)[0]), _logits(load_model(src)[0]), atol=1e-5)
    # and the scaling matters at these positions: without it the logits differ
    unscaled = {k: v for k, v in config.items() if k != "rope_scaling"}
    (path / "config.json").write_text(json.dumps(unscaled))
    assert not np.allclose(_logits(load_model(path)[0]), _logits(load_model(src)[0]), atol=1e-5)


@pytest.mark.parametrize(
    "type_id,message",
    [(15, "stored as Q8_K, which no GGUF reader decodes; readable: F32"), (99, "unknown type id")],
)
def test_tensor_types_no_reader_decodes_are_named(tmp_path, type_id, message):
    """Q8_K exists only inside llama.cpp's dot products; 99 is no type at all."""
    path = tmp_path / "odd.gguf"
    tensors = {
        "token_embd.weight": (np.zeros((4, 32), np.float32), "f32"),
        "blk.0.attn_q.weight": (np.zeros((4, 256), np.float32), ("raw", type_id, 4 * 292)),
    }
    gguf_helpers.write_blocks_gguf(path, tensors, {"general.architecture": "llama"})
    with pytest.raises(ConvertError, match=message) as e:
        convert(str(path), output="odd")
    assert "blk.0.attn_q.weight" in str(e.value)
    assert _store_listing() == []


def test_qwen2_gguf(tmp_path):
    """Qwen2: Q/K/V biases, no Q/K permutation in llama.cpp's files, and the qwen2 pre-tokenizer."""
    src = gguf_helpers.make_qwen2_model(tmp_path / "qwen", seed=6)
    gguf = tmp_path / "qwen.gguf"
    reference = hf_to_gguf(src, gguf, "q8_0", pre="qwen2")
    path = convert(str(gguf), output="qwen", q="keep", dtype="float32")
    model, config = load_model(path)
    assert config["model_type"] == "qwen2"
    np.testing.assert_allclose(_logits(model), _reference_logits(src, reference), atol=2e-3)
    # biases do reach the model: zeroing them changes the logits
    model.model.layers[0].self_attn.q_proj.bias *= 0
    assert not np.allclose(_logits(model), _reference_logits(src, reference), atol=2e-3)


def test_progress_and_keep_report(tmp_path, monkeypatch, capsys):
    """Long conversions print tensors done / total with an ETA; -q keep names what it decoded."""
    from support.gguf_arch_helpers import hf_to_gguf as write_case
    from support.gguf_arch_helpers import make_model

    from macspec.base import logs
    from macspec.models import gguf as mgguf

    logs.show()  # as `macspec convert` does: the notes go to stderr (else this test relies on an
    # earlier test in the same worker having called it)
    src = make_model(tmp_path / "src", "qwen3", seed=1)
    path = tmp_path / "mixed.gguf"
    write_case(src, path, "qwen3", qtype="Q5_0")
    monkeypatch.setattr(mgguf, "PROGRESS_EVERY", 0.0)
    convert(str(path), output="mixed", q="keep")
    err = capsys.readouterr().err
    total = len(mgguf.read_header(path).tensors)
    assert f"tensors {total}/{total} (100% of the data)" in err and "s left" in err
    assert "kept as MLX blocks: nothing" in err
    assert "Q5_0 tensors have no MLX block format, decoded to float32: " in err  # the CPU's
    assert "blk.*.attn_q.weight (2)" in err
