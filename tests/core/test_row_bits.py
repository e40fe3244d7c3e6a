"""A verification row is a plain step, bit for bit, at every width the engine may ask for.

Greedy speculation equals plain decoding only if each row of a K+1-row pass gets the very logits
a pass of its own gives: otherwise the first near-tie goes another way (issue 54: n-gram copies
of 17-24 drafts, past the 16 rows the CPU kernels once took, changed a real answer). These tests
compare the logits of passes of 1 to 64 rows with plain steps' on quantized and float32 targets,
with macspec's kernels and with mlx's own ops, check that the loop never builds a pass wider than
the backend's promise (hooks.alike_rows), and run greedy n-gram copies up to the policy's longest
on a target built with near-ties everywhere, where a rounding difference shows as another id.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama, qwen2
from support import archzoo
from support.tinymodels import chunk_logits, llama_like, make_tiny_model

import macspec
from macspec.base import switches
from macspec.core import hooks, policy
from macspec.core.target import Target
from macspec.cpu import alike, blocks, kernels, native, products
from macspec.cpu.state import STATE

WIDTHS = (1, 2, 16, 17, 18, 25, 33, 64)
PROMPT = [3, 9, 27, 17, 5, 40, 2]
ROWS = [int(i) for i in (np.arange(max(WIDTHS)) * 7 + 11) % 300]
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "vocab_size": 300}
# (bits, group, int8 activations); 0 bits: float32 weights
KINDS = [(4, 64, True), (4, 32, True), (4, 64, False), (8, 64, True), (0, 0, False)]


def _model(module, bits: int, group: int):
    model = llama_like(module, model_type=module.__name__.rsplit(".", 1)[-1], **SHAPE)
    if bits:
        model.set_dtype(mx.float16)  # half scales and biases, as converted models hold them
        nn.quantize(model, group_size=group, bits=bits)
    mx.eval(model.parameters())
    kernels.accelerate(model)
    return model


def _unalike_widths(model) -> list[int]:
    """The widths at which some row of a verification pass differs from its plain step."""
    steps = chunk_logits(model, [PROMPT, *([r] for r in ROWS)])[1:]
    out = []
    for n in WIDTHS:
        rows = chunk_logits(model, [PROMPT, ROWS[:n]])[1]
        if any(not np.array_equal(rows[i], steps[i][0]) for i in range(n)):
            out.append(n)
    return out


@pytest.mark.skipif(native.load() is None, reason=f"no native kernels here: {STATE.ext_reason}")
@pytest.mark.parametrize(("bits", "group", "int8"), KINDS)
@pytest.mark.parametrize("module", [llama, qwen2])  # qwen2: biased q/k/v products
def test_every_row_of_a_pass_of_any_width_is_a_plain_step(
    module, bits, group, int8, native_calls, monkeypatch
):
    monkeypatch.setattr(STATE, "int8_activations", int8)
    model = _model(module, bits, group)
    assert alike.rows_alike(model) and alike.alike_rows(model) is None  # any width
    assert _unalike_widths(model) == []
    # the wide passes ran on the fused layers too, not on mlx's ops
    passes = 1 + len(ROWS) + len(WIDTHS) * 2
    assert native_calls["attn_mlp"] == passes * 2
    if bits == 4 and group == 64 and int8 and blocks.enabled():
        assert products.repacked(model.layers[0].mlp.up_proj)


@pytest.mark.skipif(native.load() is None, reason=f"no native kernels here: {STATE.ext_reason}")
def test_a_prompt_read_in_one_pass_leaves_the_states_of_one_id_at_a_time():
    """Prefill is no other path: a 47-id prompt read whole, then a step, gives the logits and
    the KV cache that 47 one-id passes and the step give (so a prompt-cache restore, whose
    states came from passes of any widths, is a fresh prefill's)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = _model(llama, 4, 64)
    prompt = PROMPT + ROWS[:40]
    whole, single = make_prompt_cache(model), make_prompt_cache(model)
    model(mx.array([prompt]), cache=whole)
    for t in prompt:
        model(mx.array([[t]]), cache=single)
    a = np.array(model(mx.array([[7]]), cache=whole))
    b = np.array(model(mx.array([[7]]), cache=single))
    np.testing.assert_array_equal(a, b)
    for c, d in zip(whole, single, strict=True):
        for x, y in zip(c.state, d.state, strict=True):
            np.testing.assert_array_equal(np.array(x), np.array(y))


def test_without_the_native_kernels_rows_are_not_promised_alike(monkeypatch):
    monkeypatch.setattr(STATE, "native_products", False)
    model = _model(llama, 4, 64)
    assert not alike.rows_alike(model)
    monkeypatch.setenv(str(switches.SPECULATE_UNALIKE), "0")
    assert alike.alike_rows(model) == 1


def _gemma(path=None):
    """A sliding-window target (gemma3_text): its layers run mlx-lm's own ops."""
    if path is not None:
        return archzoo.make_arch_model(path, "gemma3_text")
    model = archzoo.build_model("gemma3_text")
    kernels.accelerate(model)
    return model


def test_a_target_on_mlx_ops_is_said_to_round_its_rows_otherwise(caplog):
    """gemma3_text's verification rows differ from its plain steps in the last bits, from 2 rows
    on (measured here, on any BLAS): it is not promised alike, and by default it speculates with
    a warning, said once."""
    model = _gemma()
    assert not alike.rows_alike(model)
    ids = [r % archzoo.VOCAB for r in ROWS[:8]]
    steps = chunk_logits(model, [PROMPT, *([r] for r in ids)])[1:]
    rows = chunk_logits(model, [PROMPT, ids])[1]
    assert any(not np.array_equal(rows[i], steps[i][0]) for i in range(8))
    np.testing.assert_allclose(rows, np.concatenate(steps), rtol=0, atol=1e-4)
    STATE.told.discard("gemma3_text")
    with caplog.at_level(logging.WARNING, logger="macspec.cpu"):
        assert alike.alike_rows(model) is None
        assert alike.alike_rows(model) is None
    said = [r.getMessage() for r in caplog.records if "float rounding" in r.getMessage()]
    assert len(said) == 1 and "gemma3_text" in said[0]
    assert str(switches.SPECULATE_UNALIKE) in said[0]


def test_switched_off_such_a_target_decodes_plainly(tmp_path, monkeypatch):
    pair = macspec.load(_gemma(tmp_path / "gemma"), drafter="ngram")
    prompt = "abab abab ab"
    plain = macspec.generate(pair, prompt, max_tokens=40, speculative=False)
    monkeypatch.setenv(str(switches.SPECULATE_UNALIKE), "0")
    strict = macspec.generate(pair, prompt, max_tokens=40, num_draft=8, adaptive=False)
    assert strict.tokens == plain.tokens and strict.stats.drafted == 0
    monkeypatch.delenv(str(switches.SPECULATE_UNALIKE))
    loose = macspec.generate(pair, prompt, max_tokens=40, num_draft=8, adaptive=False)
    assert loose.stats.drafted > 0


class _Widths:
    """Records the ids of every target pass after the prompt."""

    def __init__(self, monkeypatch):
        self.seen: list[int] = []
        real = Target._pass

        def spied(target, tokens, rewindable):
            self.seen.append(tokens.size)
            return real(target, tokens, rewindable)

        monkeypatch.setattr(Target, "_pass", spied)


def _near_tie_target(path):
    """A float32 target whose output head gives every id of its first half a twin a hair
    likelier (its row times 1 + 3e-7): the argmax between them is decided by the last bits,
    so any row computed otherwise than a plain step shows as another id (issue 54's case)."""
    path = make_tiny_model(path, seed=0, hidden=64, tie=False)
    weights = dict(mx.load(str(path / "model.safetensors")))
    head = np.array(weights["lm_head.weight"])
    half = head.shape[0] // 2
    head[half : 2 * half] = head[:half] * np.float32(1 + 3e-7)
    weights["lm_head.weight"] = mx.array(head)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


@pytest.fixture(scope="module")
def near_ties(tmp_path_factory):
    return macspec.load(_near_tie_target(tmp_path_factory.mktemp("ties") / "t"), drafter="ngram")


PROMPTS = ["abab abab ab", "The cat. The cat. The", "one two one two one", "xyz xyz xyz x"]


def test_greedy_ngram_copies_up_to_the_longest_equal_plain_decoding(near_ties):
    """Fixed K up to COPY_FACTOR x the default K (the adaptive policy's longest copy), and the
    adaptive default with num_draft 8 (copies up to 32): the same ids as plain decoding."""
    longest = policy.COPY_FACTOR * 8
    widest = 0
    for prompt in PROMPTS:
        plain = macspec.generate(near_ties, prompt, max_tokens=100, speculative=False)
        for k in (17, 24, longest):
            r = macspec.generate(near_ties, prompt, max_tokens=100, num_draft=k, adaptive=False)
            assert r.tokens == plain.tokens, (prompt, k)
            widest = max(widest, len(r.stats.per_position_acceptance))
        r = macspec.generate(near_ties, prompt, max_tokens=100, num_draft=8)
        assert r.tokens == plain.tokens, (prompt, "adaptive")
    assert widest == longest  # copies of the longest length were verified


def test_the_loop_builds_no_pass_wider_than_the_backend_promises(near_ties, monkeypatch):
    """A backend that computes rows alike in passes of at most 5 ids (hooks.alike_rows): every
    round then verifies at most 4 drafts, and the answer is plain decoding's; one that promises
    a single row gets plain steps only."""
    widths = _Widths(monkeypatch)
    prompt = PROMPTS[1]
    plain = macspec.generate(near_ties, prompt, max_tokens=60, speculative=False)
    for promise in (5, 1):
        old = hooks.install(replace(hooks.installed(), alike_rows=lambda model, n=promise: n))
        try:
            widths.seen.clear()
            r = macspec.generate(near_ties, prompt, max_tokens=60, num_draft=16, adaptive=False)
        finally:
            hooks.install(old)
        assert r.tokens == plain.tokens
        assert max(widths.seen) == promise
    assert r.stats.drafted == 0
