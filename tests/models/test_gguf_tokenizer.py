"""Tokenizers rebuilt from GGUF metadata encode like the original Hugging Face tokenizer and like
transformers' own GGUF tokenizer conversion: byte-level BPE with the Qwen 2 and Llama 3
pre-tokenizers, SentencePiece; plus stop tokens and the Gemma chat template fallback."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from support import gguf_helpers
from support.gguf_helpers import CORPUS, SPECIALS, tokenizer_metadata
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_TOKENIZER_MAPPING,
    convert_gguf_tokenizer,
)

from macspec.base.errors import ConvertError
from macspec.models.gguf_tokenizer import _LLAMA3_RE, _QWEN2_RE, GEMMA_TEMPLATE, build_tokenizer

TEXTS = [
    "The quick brown fox, it's 12345 o'clock! DON'T shout; we'll see.",
    "  two  spaces\n\n\ttab\r\nCRLF and naïve café ünïcödé 日本 🤖",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x**2  # 3.14 and 1000000",
]
PATH = Path("test.gguf")


def _transformers(arch: str, meta: dict):
    wanted = GGUF_TOKENIZER_MAPPING["tokenizer"].items()
    fields = {v: meta["tokenizer." + k] for k, v in wanted if "tokenizer." + k in meta}
    return convert_gguf_tokenizer(arch, fields)[0]


def _regex_bpe(path: Path, regex: str):
    """A byte-level BPE trained behind the given split regex, as Qwen 2's and Llama 3's
    tokenizer.json are built."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS + TEXTS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return tok


@pytest.mark.parametrize(
    "pre,regex,arch", [("qwen2", _QWEN2_RE, "qwen2"), ("llama-bpe", _LLAMA3_RE, "llama")]
)
def test_bpe_pre_tokenizers_match_the_original_and_transformers(tmp_path, pre, regex, arch):
    original = _regex_bpe(tmp_path, regex)
    meta = tokenizer_metadata(tmp_path, pre)
    ours, _, _ = build_tokenizer(meta, PATH)
    theirs = _transformers(arch, meta)
    for text in TEXTS:
        want = original.encode(text).ids
        assert ours.encode(text).ids == want, text
        assert theirs.encode(text, add_special_tokens=False).ids == want, text
        assert ours.decode(want, skip_special_tokens=False) == text


def test_sentencepiece_matches_transformers(tmp_path):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    (tmp_path / "sp.model").write_bytes(model.getvalue())
    meta = gguf_helpers.spm_metadata(tmp_path / "sp.model")
    ours, _, _ = build_tokenizer(meta, PATH)
    theirs = _transformers("llama", meta)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    for text in [t for t in TEXTS if "<|" not in t] + ["x", "The draft proposes."]:
        assert ours.encode(text).ids == [sp.bos_id()] + sp.encode(text), text
        if not text.startswith(" "):  # transformers' Metaspace drops the prefix "▁" there; it
            # differs from SentencePiece and llama.cpp, which ours follows (checked just above)
            assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text).ids


def _chat_meta(tmp_path, template: str | None) -> dict:
    gguf_helpers.bpe_tokenizer(tmp_path)
    meta = tokenizer_metadata(tmp_path)
    meta.pop("tokenizer.chat_template")
    if template:
        meta["tokenizer.chat_template"] = template
    return meta


def test_stop_tokens_are_eos_and_the_templates_end_of_turn(tmp_path):
    meta = _chat_meta(
        tmp_path, "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    )
    meta["tokenizer.ggml.eos_token_id"] = 0  # <|endoftext|>
    _, config, stops = build_tokenizer(meta, PATH)
    assert stops == [0, 2]  # EOS, then <|im_end|>, which closes each turn
    assert config["chat_template"].startswith("{% for m")
    meta["tokenizer.ggml.eos_token_id"] = 2
    assert build_tokenizer(meta, PATH)[2] == [2]


def test_gemma_files_without_a_template_get_gemmas(tmp_path):
    meta = _chat_meta(tmp_path, None)
    assert "chat_template" not in build_tokenizer(meta, PATH)[1]
    _, config, _ = build_tokenizer(meta, PATH, family="gemma")
    assert config["chat_template"] == GEMMA_TEMPLATE


@pytest.mark.parametrize(
    "change,message",
    [
        ({"tokenizer.ggml.model": "bert"}, "tokenizer type 'bert' is not supported"),
        ({"tokenizer.ggml.tokens": [1, 2]}, "has no tokenizer"),
        ({"tokenizer.ggml.token_type": [1]}, "token_type does not match"),
        ({"tokenizer.ggml.merges": ["nospace"]}, "without usable merges"),
        ({"tokenizer.ggml.merges": ["zzq qqz"]}, "inconsistent BPE"),
        ({"tokenizer.ggml.pre": "mystery"}, "unknown BPE pre-tokenizer 'mystery'"),
    ],
)
def test_broken_tokenizer_metadata_is_named(tmp_path, change, message):
    meta = {**_chat_meta(tmp_path, None), **change}
    with pytest.raises(ConvertError, match=message):
        build_tokenizer(meta, PATH)
