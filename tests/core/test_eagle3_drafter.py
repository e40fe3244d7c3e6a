"""Drafting with published EAGLE-3 checkpoints (`--draft PATH` detects the format): greedy
equality with plain decoding for each layout (chains and trees), the draft's cache against a
recomputation, exactness at T=1 with a reduced draft vocabulary (an off-by-one d2t caught), and
a draft for another target refused at load naming what differs."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from support.drafter_models import make_eagle3_draft, make_eagle_target
from support.exactness import chi_square, exact_joint, sample_prefixes
from support.policies import SOFTMAX
from support.tinymodels import make_tiny_model

import macspec
from macspec.base.errors import ModelError
from macspec.core.drafters import Eagle3Drafter, drafter_class
from macspec.core.drafters.eagle3 import Eagle3Draft
from macspec.core.target import hidden_states
from macspec.models.eagle3_draft import taps_for
from macspec.models.store import store_root

FORMATS = ("eagle", "specforge", "speculators")


def _target_weights(target) -> dict:
    out = {}
    for f in target.glob("*.safetensors"):
        out.update(mx.load(str(f)))
    return out


def tamed(target):
    """An edit making a draft guess "the next token repeats": fc passes the highest tapped
    layer through, the layer adds small terms, the head is the target's own rows of the draft's
    ids. Tiny random targets repeat often enough to exercise keeping and rewinding."""
    weights = _target_weights(target)

    def edit(config, arrays):
        h = arrays["norm.weight"].shape[0]
        fc = arrays["fc.weight"]
        arrays["fc.weight"] = mx.concatenate([mx.zeros((h, 2 * h)), mx.eye(h)], 1) + 0.05 * fc
        for k in list(arrays):
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                arrays[k] = 0.1 * arrays[k]
        ids = np.arange(arrays["lm_head.weight"].shape[0])
        if "d2t" in arrays:
            ids = ids + np.array(arrays["d2t"])
        arrays["lm_head.weight"] = weights["lm_head.weight"][mx.array(ids)]
        arrays["norm.weight"] = weights["model.norm.weight"]

    return edit


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-drafting")
    target = make_eagle_target(root / "target", seed=0)
    drafts = {
        fmt: make_eagle3_draft(root / fmt, target, fmt, draft_vocab=60, seed=1, edit=tamed(target))
        for fmt in FORMATS
    }
    return target, drafts


def load(target, draft, **kw):
    pair = macspec.load(target, draft, measure=False, **kw)
    pair.eos_token_ids = frozenset()  # full-length answers: more rounds
    return pair


def test_each_format_is_detected_as_an_eagle3_draft(dirs):
    target, drafts = dirs
    assert drafter_class("eagle3") is Eagle3Drafter
    for fmt, path in drafts.items():
        pair = macspec.load(target, path, measure=False)
        assert pair.drafter_kind == "eagle3+ngram", fmt
        assert pair.describe() == f"target + draft {fmt} (eagle3+ngram)"
        drafter = macspec.load(target, path, drafter="model", measure=False).make_drafter(False)
        assert isinstance(drafter, Eagle3Drafter) and drafter.needs_hidden
        # default layer ids (2, L // 2, L - 3) = (2, 4, 5) read the outputs of layers 1, 3, 4
        assert drafter.feature_layers == (1, 3, 4)
        assert drafter.parts.vocab_ids.size == 60


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_speculative_equals_plain(dirs, fmt):
    target, drafts = dirs
    pair = load(target, drafts[fmt], drafter="model")
    accepted = rejected = 0
    for prompt in ["Once upon", "ab ab ab"]:
        plain = macspec.generate(pair, prompt, max_tokens=24, speculative=False)
        runs = [{"num_draft": k, "adaptive": a} for k in (1, 3) for a in (False, True)]
        runs.append({"num_draft": 3, "tree_nodes": 4, "adaptive": False})
        for kw in runs:
            spec = macspec.generate(pair, prompt, max_tokens=24, **kw)
            assert spec.tokens == plain.tokens, (prompt, kw)
            accepted += spec.stats.accepted
            rejected += spec.stats.drafted - spec.stats.accepted
    assert accepted > 0 and rejected > 0, (accepted, rejected)


soft = SOFTMAX


def test_cache_after_rounds_matches_a_recomputation(dirs):
    target, drafts = dirs
    pair = load(target, drafts["speculators"], drafter="model")
    drafter = pair.make_drafter(False)
    draft, parts = drafter.draft, drafter.parts

    def feats(ids):
        return hidden_states(pair.target, mx.array(ids), None, drafter.feature_layers)

    def reference(context):
        state = draft.state(feats(context[:-1])[None])
        out = draft.step(state, parts.embed(mx.array(context[1:]))[None])
        small = parts.logits(draft.decode(out)[0, -1:])
        return drafter._full(mx.softmax(small, axis=-1))[0]

    context = [1, 10, 11, 12, 13, 14]
    drafter.start(context, feats(context[:-1]))
    drafter.commit(0, 0, [20], feats(context)[-1:])
    context.append(20)
    key = mx.random.key(0)
    for k, n in [(4, 2), (3, 3), (2, 0), (4, 1)]:
        key, sub = mx.random.split(key)
        proposal = drafter.propose(k, soft, sub)
        assert mx.allclose(proposal.probs[0], reference(context), atol=1e-4).item(), (k, n)
        drafts_ = proposal.tokens.tolist()
        emitted = drafts_[:n] + [30 + n]
        drafter.commit(k, n, emitted, feats(context + drafts_[:n])[-(n + 1) :])
        context += emitted


def test_unsorted_layer_ids_feed_fc_in_the_checkpoints_order():
    taps, order = taps_for((5, 2, 4), "draft")
    assert taps == (1, 3, 4) and order == (2, 0, 1)
    taps, order = taps_for((3, 3, 6), "draft")  # a shallow target repeats a layer
    assert taps == (2, 5) and order == (0, 0, 1)
    with pytest.raises(ModelError, match="input of target layer 0"):
        taps_for((0, 2, 4), "draft")


def test_state_reads_the_taps_in_order(dirs):
    target, drafts = dirs
    pair = load(target, drafts["eagle"], drafter="model")
    draft: Eagle3Draft = pair.make_drafter(False).draft
    ht = draft.target_hidden
    features = mx.random.normal((1, 2, 4 * ht))  # three taps, then the final features
    want = draft.fc(features[..., : 3 * ht])
    assert mx.allclose(draft.state(features), want, atol=1e-5).item()
    draft.order = (2, 0, 1)
    parts = [features[..., i * ht : (i + 1) * ht] for i in (2, 0, 1)]
    want = draft.fc(mx.concatenate(parts, axis=-1))
    assert mx.allclose(draft.state(features), want, atol=1e-5).item()
    draft.order = (0, 1, 2)


# ------------------------------------------------------------------ the distribution at T=1


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """A target of 9 output rows (7 the tokenizer knows) and a draft knowing 6 of them."""
    root = tmp_path_factory.mktemp("eagle3-small")
    kw = {"chars": "abcd", "scale": 8.0, "vocab_rows": 9, "tie": False, "layers": 8}
    target = make_tiny_model(root / "target", seed=3, **kw)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "architectures": ["Llama"]}))
    draft = make_eagle3_draft(root / "draft", target, "eagle", draft_vocab=6, seed=2)
    return load(target, draft, drafter="model")


def _full_off_by_one(self, small):
    """A broken d2t: q placed one target id above where it was drawn."""
    full = mx.zeros((small.shape[0], self.vocab_size), dtype=mx.float32)
    ids = mx.broadcast_to((self.parts.vocab_ids[None] + 1) % self.vocab_size, small.shape)
    return mx.put_along_axis(full, ids, small, axis=-1)


OPTIONS = {
    "T=1": {"temperature": 1.0},
    "T=1,top_k=3": {"temperature": 1.0, "top_k": 3},
    "T=1,penalty": {"temperature": 1.0, "repetition_penalty": 1.3},
}


@pytest.mark.parametrize(
    ("options", "broken"),
    [("T=1", False), ("T=1,penalty", False), ("T=1", True)],
)
def test_distribution_at_temperature_one(small_pair, options, broken, monkeypatch):
    pair = small_pair
    # 7 ids the tokenizer knows (of 9 rows); the draft proposes fewer (q = 0 on the others)
    assert pair.vocab_size == 7 and pair.make_drafter(False).parts.vocab_ids.size < 7
    assert isinstance(pair.make_drafter(False).draft.fc, nn.QuantizedLinear)  # the default
    if broken:
        monkeypatch.setattr(Eagle3Drafter, "_full", _full_off_by_one)
    prompt, opts = [3, 4, 5, 3], OPTIONS[options]
    expected = exact_joint(pair, prompt, 3, **opts)
    counts = sample_prefixes(pair, prompt, 3, 600, num_draft=2, adaptive=False, **opts)
    p = chi_square(expected, counts)
    assert (p < 1e-3) if broken else (p > 1e-3), p


# ------------------------------------------------------------------ refused at load


def _other(tmp_path, name, **kw):
    path = make_tiny_model(tmp_path / name, seed=0, scale=3.0, tie=False, layers=8, **kw)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    return path


def test_a_draft_for_another_target_is_refused_naming_what_differs(dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    _, drafts = dirs
    wide = _other(tmp_path, "wide", hidden=64)
    with pytest.raises(ModelError, match="features of width 32, but .*wide has hidden size 64"):
        macspec.load(wide, drafts["eagle"], measure=False)
    rows = _other(tmp_path, "rows", vocab_rows=96)
    with pytest.raises(ModelError, match="vocabulary of 72 ids, but .*rows has 96"):
        macspec.load(rows, drafts["speculators"], measure=False)
    qwen = _other(tmp_path, "qwen")
    config = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForX"]}))
    with pytest.raises(ModelError, match="drafts for LlamaForCausalLM, but .*qwen is Qwen3ForX"):
        macspec.load(qwen, drafts["speculators"], measure=False)
    assert not store_root().exists() or not any(store_root().iterdir())


def _edit(change):
    def edit(config, arrays):
        change(config, arrays)

    return edit


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c, a: a.update(d2t=a["d2t"] + 40), "d2t maps draft id .* outside"),
        (lambda c, a: c.update(draft_vocab_size=80), "draft vocabulary \\(80 ids\\) is larger"),
        (lambda c, a: a.pop("midlayer.self_attn.k_proj.weight"), "lacks 'midlayer.self_attn.k"),
    ],
)
def test_bad_drafts_are_refused_at_load(dirs, tmp_path, monkeypatch, change, message):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    target, _ = dirs
    path = make_eagle3_draft(tmp_path / "bad", target, "eagle", draft_vocab=40, edit=_edit(change))
    with pytest.raises(ModelError, match=message) as e:
        macspec.load(target, path, measure=False)
    assert str(path) in str(e.value)
    assert not (tmp_path / "home").exists() or not any(store_root().iterdir())
    shutil.rmtree(path)


def test_check_compares_no_tokenizer_but_the_target(dirs, tmp_path, monkeypatch):
    from macspec.models.compat import check

    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    target, drafts = dirs
    report = check(target, drafts["specforge"])
    assert report.compatible
    assert "an EAGLE-3 draft (specforge format) proposing 60 of the target's ids" in report.format()
    wide = _other(tmp_path, "wide", hidden=64)
    report = check(wide, drafts["specforge"])
    assert not report.compatible and "hidden size 64" in report.errors[0]


# ------------------------------------------------------------------ the published forward


def _rms(x, w, eps=1e-5):
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _attention(x, w, p, heads=4, kv=2, base=10000.0):
    """Llama attention over x (1, T, D) from the raw tensors, causal, RoPE from position 0
    (Qwen3's: q_norm / k_norm over each head first)."""
    _, t, _ = x.shape

    def split(name, n):
        return (x @ w[p + name].T).reshape(1, t, n, -1).transpose(0, 2, 1, 3)

    q, k, v = split("q_proj.weight", heads), split("k_proj.weight", kv), split("v_proj.weight", kv)
    if p + "q_norm.weight" in w:
        q, k = _rms(q, w[p + "q_norm.weight"]), _rms(k, w[p + "k_norm.weight"])
    hd = q.shape[-1]
    q = mx.fast.rope(q, hd, traditional=False, base=base, scale=1.0, offset=0)
    k = mx.fast.rope(k, hd, traditional=False, base=base, scale=1.0, offset=0)
    k, v = mx.repeat(k, heads // kv, axis=1), mx.repeat(v, heads // kv, axis=1)
    scores = (q @ k.swapaxes(-1, -2)) * hd**-0.5 + mx.triu(mx.full((t, t), -mx.inf), k=1)
    out = (mx.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(1, t, -1)
    return out @ w[p + "o_proj.weight"].T


def reference_forward(
    w, fmt, features, embeds, norm_before_residual=False, fc_norm=False, qwen3=False
):
    """The authors' cnets.py Model over rows with real features (the keys as published):
    g = fc(f_low, f_mid, f_high); attention over cat(input_layernorm(e), hidden_norm(g)) with
    residual g (or hidden_norm(g)); logits = lm_head(norm(out))."""
    p = "layers.0." if fmt == "speculators" else "midlayer."
    ht = features.shape[-1] // 3
    parts = [features[..., i * ht : (i + 1) * ht] for i in range(3)]
    if fc_norm:
        parts = [_rms(f, w[f"fc_norm.{i}.weight"]) for i, f in enumerate(parts)]
    g = mx.concatenate(parts, axis=-1) @ w["fc.weight"].T
    normed = _rms(g, w[p + "hidden_norm.weight"])
    x0 = mx.concatenate([_rms(embeds, w[p + "input_layernorm.weight"]), normed], axis=-1)
    h = (normed if norm_before_residual else g) + _attention(x0, w, p + "self_attn.")
    m = _rms(h, w[p + "post_attention_layernorm.weight"])
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    out = h + (nn.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T


VARIANTS = {
    "eagle": ("eagle", {}),
    "specforge+fc_norm": ("specforge", {"fc_norm": True}),
    "speculators+norm_before_residual": ("speculators", {"norm_before_residual": True}),
    "speculators+qwen3": ("speculators", {"qwen3": True}),
}


def qwen3_layers(config, arrays):
    """A speculators draft of Qwen3 layers: q_norm / k_norm over each head."""
    config["transformer_layer_config"]["model_type"] = "qwen3"
    for name in ("q_norm", "k_norm"):
        arrays[f"layers.0.self_attn.{name}.weight"] = 1 + 0.2 * mx.random.normal((8,))


@pytest.mark.parametrize("bits", ["float", "8"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_draft_computes_the_published_forward(dirs, tmp_path, variant, bits, monkeypatch):
    """As stored (float), the published forward to float rounding; with 8-bit weights (the
    default), its products quantized, and close to it (the draft only proposes: exactness does
    not depend on it, the greedy and T=1 tests above run the default)."""
    monkeypatch.setenv("MACSPEC_DRAFT_BITS", bits)
    target, _ = dirs
    fmt, flags = VARIANTS[variant]

    def edit(config, arrays):
        config.update({k: v for k, v in flags.items() if k != "qwen3"})
        if flags.get("qwen3"):
            qwen3_layers(config, arrays)
        if flags.get("fc_norm"):
            arrays.update(
                {f"fc_norm.{i}.weight": 1 + 0.2 * mx.random.normal((32,)) for i in range(3)}
            )

    path = make_eagle3_draft(tmp_path / variant, target, fmt, draft_vocab=60, seed=4, edit=edit)
    w = {k: v.astype(mx.float32) for k, v in mx.load(str(path / "model.safetensors")).items()}
    pair = macspec.load(target, path, drafter="model", measure=False)
    drafter = pair.make_drafter(False)
    draft, parts = drafter.draft, drafter.parts
    mx.random.seed(0)
    features = 3 * mx.random.normal((1, 5, 3 * 32))
    ids = mx.array([3, 9, 27, 41, 8])
    embeds = parts.embed(ids)[None]
    final = mx.zeros((1, 5, 32))  # the target's final features: EAGLE-3 does not read them
    out = draft.step(draft.state(mx.concatenate([features, final], -1)), embeds)
    got = draft.decode(out) @ draft.head_weight().T
    want = reference_forward(w, fmt, features, embeds, **flags)
    quantized = [p for p, m in draft.named_modules() if isinstance(m, nn.QuantizedLinear)]
    if bits == "float":
        assert not quantized
        assert mx.allclose(got, want, atol=2e-4, rtol=1e-4).item(), variant
        return
    assert {"fc", "layers.0.self_attn.q_proj", "layers.0.mlp.down_proj"} <= set(quantized)
    assert ("lm_head" in quantized) == ("lm_head" in draft)
    assert not mx.allclose(got, want, atol=2e-4, rtol=1e-4).item()  # quantized indeed
    error = mx.abs(got - want).max() / mx.abs(want).max()
    assert error.item() < 0.05, (variant, error.item())
    # and the draft's ids are the target ids d2t names (offsets: target = draft + d2t)
    d2t = np.array(w["d2t"]).astype(np.int64)
    assert parts.vocab_ids.tolist() == (np.arange(60) + d2t).tolist()


def test_a_qwen3_draft_recycling_normed_states_drafts_exactly(dirs, tmp_path):
    """speculators' Qwen3 layers with norm_output (the next position reads norm(out))."""
    target, _ = dirs
    tame = tamed(target)

    def edit(config, arrays):
        tame(config, arrays)
        qwen3_layers(config, arrays)
        config["norm_output"] = True

    path = make_eagle3_draft(tmp_path / "q3", target, "speculators", draft_vocab=60, edit=edit)
    pair = load(target, path, drafter="model")
    draft = pair.make_drafter(False).draft
    assert draft.recycle_normed and "q_norm" in draft.layers[0].self_attn
    for prompt in ["Once upon", "ab ab ab"]:
        plain = macspec.generate(pair, prompt, max_tokens=16, speculative=False)
        for kw in ({"num_draft": 3, "adaptive": False}, {"num_draft": 3, "tree_nodes": 4}):
            assert macspec.generate(pair, prompt, max_tokens=16, **kw).tokens == plain.tokens


@pytest.mark.parametrize("bits", ["float", "8"])
def test_drafts_in_generation_are_the_teacher_forced_predictions(dirs, bits, monkeypatch):
    """Each K=1 draft the loop proposes is the draft's prediction from the target's real
    features of the context, as distill trains and measures it (teacher forcing): the taps the
    target's passes hand the drafter are the right layers at the right positions. Exactness
    cannot see a wrong feature (the draft only proposes); acceptance would fall silently."""
    monkeypatch.setenv("MACSPEC_DRAFT_BITS", bits)
    target, drafts = dirs
    pair = load(target, drafts["speculators"], drafter="model")
    prompt = [1, 10, 11, 12, 13, 10, 11]
    proposed = []  # (index in the sequence, draft id)
    at = len(prompt)
    for ev in macspec.stream_generate(
        pair, prompt, max_tokens=40, num_draft=1, adaptive=False, temperature=0
    ):
        drafts_ = list(ev.accepted) + list(ev.rejected)
        if drafts_:
            proposed.append((at, drafts_[0]))
        at += len(ev.emitted)
    seq = prompt + macspec.generate(pair, prompt, max_tokens=40, speculative=False).tokens
    drafter = pair.make_drafter(False)
    draft, parts = drafter.draft, drafter.parts
    feats = hidden_states(pair.target, mx.array(seq), None, drafter.feature_layers)
    out = draft.step(draft.state(feats[:-1][None]), parts.embed(mx.array(seq[1:]))[None])
    guess = parts.vocab_ids[mx.argmax(parts.logits(draft.decode(out)[0]), axis=-1)].tolist()
    # guess[t] is read from (features of t, id t + 1): the id at t + 2
    assert len(proposed) > 10
    assert [d for _, d in proposed] == [guess[i - 2] for i, _ in proposed]
    assert 0 < sum(seq[i] == d for i, d in proposed) < len(proposed)  # some kept, some not
