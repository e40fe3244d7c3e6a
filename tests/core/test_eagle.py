"""The EAGLE-style drafter: loading, cache bookkeeping against a fresh recomputation, greedy
equality and distributional exactness through the engine."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from support.drafts import make_draft
from support.exactness import chi_square, exact_joint, sample_prefixes
from support.policies import SOFTMAX
from support.tinymodels import make_tiny_model

import macspec
from macspec.base.errors import ModelError
from macspec.core.drafters.eagle import EagleDrafter, TargetParts
from macspec.core.target import hidden_states
from macspec.cpu.state import STATE
from macspec.models.compat import check


@pytest.fixture(scope="module")
def eagle_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = make_tiny_model(root / "target", seed=0, hidden=48, tie=False, scale=2.0)
    # Drop some ids from the draft's vocabulary: q = 0 there, which the rule must handle.
    vocab = [i for i in range(66) if i % 5 != 4]
    draft = make_draft(root / "draft", target, vocab_ids=vocab)
    return target, draft


@pytest.fixture(scope="module")
def eagle_pair(eagle_dirs):
    return macspec.load(*eagle_dirs)


@pytest.fixture(scope="module")
def tapped_dirs(tmp_path_factory):
    """A draft that reads the output of the target's first layer too (EAGLE-3 features)."""
    root = tmp_path_factory.mktemp("tapped")
    target = make_tiny_model(root / "target", seed=0, hidden=48, tie=False, scale=2.0, layers=3)
    vocab = [i for i in range(66) if i % 5 != 4]
    draft = make_draft(root / "draft", target, vocab_ids=vocab, feature_layers=(0, 1))
    return target, draft


@pytest.fixture(scope="module")
def deep_dirs(tmp_path_factory):
    """A draft of two decoder layers (`macspec distill --layers 2`)."""
    root = tmp_path_factory.mktemp("deep")
    target = make_tiny_model(root / "target", seed=0, hidden=48, tie=False, scale=2.0)
    vocab = [i for i in range(66) if i % 5 != 4]
    return target, make_draft(root / "draft", target, vocab_ids=vocab, layers=2)


def other_pair(which, tapped_dirs, deep_dirs, **kw):
    return macspec.load(*(tapped_dirs if which == "tapped layers" else deep_dirs), **kw)


@pytest.fixture(scope="module")
def eagle_only(eagle_dirs):
    """The eagle drafter alone, without the n-gram lookup tried first."""
    return macspec.load(*eagle_dirs, drafter="model")


def test_load_makes_an_eagle_drafter(eagle_pair, eagle_only, eagle_dirs):
    assert eagle_pair.drafter_kind == "eagle+ngram"
    assert eagle_pair.make_drafter(False).needs_hidden
    assert eagle_only.drafter_kind == "eagle"
    drafter = eagle_only.make_drafter(False)
    assert isinstance(drafter, EagleDrafter) and drafter.needs_hidden
    assert check(*eagle_dirs).compatible
    # With the CPU kernels, the draft's products (its layer, its input projection and its head
    # rows) run the native products where they are built; without them, mlx's own.
    from macspec.cpu import products

    native = products.active() and mx.default_device() == mx.cpu
    assert STATE.is_switched(drafter.draft.fc) == native
    assert drafter.parts.native
    stock = macspec.load(*eagle_dirs, drafter="model", kernels=False).make_drafter(False)
    assert type(stock.draft.fc) is nn.Linear and not stock.parts.native


@pytest.mark.parametrize("which", ["final features", "tapped layers", "two layers"])
def test_greedy_speculative_equals_target_only(eagle_pair, tapped_dirs, deep_dirs, which):
    pair = eagle_pair if which == "final features" else other_pair(which, tapped_dirs, deep_dirs)
    rejected = accepted = 0
    for prompt in ["Once upon", "The cat sat on the", [1, 20, 30, 40, 5]]:
        plain = macspec.generate(pair, prompt, max_tokens=40, speculative=False)
        for k in (1, 2, 4, 6):
            for adaptive in (False, True):
                spec = macspec.generate(pair, prompt, max_tokens=40, num_draft=k, adaptive=adaptive)
                assert spec.tokens == plain.tokens, f"{prompt!r} K={k} adaptive={adaptive}"
                rejected += spec.stats.drafted - spec.stats.accepted
                accepted += spec.stats.accepted
    assert rejected > 0 and accepted > 0  # both rewinding and keeping were exercised


@pytest.mark.parametrize("which", ["eagle+ngram", "eagle"])
def test_a_one_token_prompt(eagle_pair, eagle_only, which):
    """The target has read nothing before the first step: the draft starts from it."""
    pair = eagle_pair if which == "eagle+ngram" else eagle_only
    for max_tokens in (1, 4, 12):
        plain = macspec.generate(pair, [20], max_tokens=max_tokens, speculative=False)
        spec = macspec.generate(pair, [20], max_tokens=max_tokens, num_draft=3, adaptive=False)
        assert spec.tokens == plain.tokens and len(spec.tokens) == max_tokens


def reference_logits(pair, parts, draft, context):
    """What the draft predicts after `context`, computed from scratch with real features."""
    feats = hidden_states(pair.target, mx.array(context[:-1]), None, draft.feature_layers)
    embeds = parts.embed(mx.array(context[1:]))
    return parts.logits(draft(feats[None], embeds[None])[0, -1:])


@pytest.mark.parametrize("which", ["final features", "tapped layers", "two layers"])
def test_cache_after_rounds_matches_fresh_recomputation(eagle_only, tapped_dirs, deep_dirs, which):
    """Drive the drafter through plain steps, partial and full acceptances and an abort; its
    first proposal each time must equal a from-scratch run of the draft over the context."""
    pair = (
        eagle_only
        if which == "final features"
        else other_pair(which, tapped_dirs, deep_dirs, drafter="model")
    )
    drafter = pair.make_drafter(False)
    draft, parts = drafter.draft, drafter.parts
    assert drafter.feature_layers == ((0, 1) if which == "tapped layers" else ())
    assert len(drafter.cache) == (2 if which == "two layers" else 1)
    soft = SOFTMAX
    context = [1, 10, 11, 12, 13, 14]

    def target_hidden(ids):
        return hidden_states(pair.target, mx.array(ids), None, drafter.feature_layers)

    drafter.start(context, target_hidden(context[:-1]))
    # A plain step: the target read context[-1] and produced 20.
    drafter.commit(0, 0, [20], target_hidden(context)[-1:])
    context.append(20)
    plan = [(4, 2), (3, 3), (2, 0), ("abort", 3), (4, 4), (1, 1)]
    key = mx.random.key(0)
    for step in plan:
        key, sub = mx.random.split(key)
        if step[0] == "abort":
            drafter.propose(step[1], soft, sub)
            drafter.abort(step[1])
            continue
        k, n = step
        proposal = drafter.propose(k, soft, sub)
        q0 = proposal.probs[0]
        ref = mx.softmax(_full(reference_logits(pair, parts, draft, context), parts, pair), -1)
        assert mx.allclose(q0, ref[0], atol=1e-4).item(), step
        drafts = proposal.tokens.tolist()
        emitted = drafts[:n] + [30 + n]
        kept = context[-1:] + drafts[:n]
        hid = target_hidden(context + drafts[:n])[-(n + 1) :]
        assert len(kept) == hid.shape[0]
        drafter.commit(k, n, emitted, hid)
        context += emitted


def test_a_long_prompt_is_fed_to_the_draft_in_chunks_at_start(eagle_only):
    """A 1,100-id prompt's pairs go into the draft's cache at start (512 at a time), all but
    the last; the first proposal still equals the draft run over the whole context at once."""
    pair = eagle_only
    drafter = pair.make_drafter(False)
    context = [(7 * i) % 60 + 1 for i in range(1100)]
    hidden = hidden_states(pair.target, mx.array(context[:-1]), None, drafter.feature_layers)
    drafter.start(context, hidden)
    assert drafter.cache[0].offset == len(context) - 2 and len(drafter.pending_ids) == 1
    soft = SOFTMAX
    q0 = drafter.propose(1, soft, mx.random.key(0)).probs[0]
    parts = drafter.parts
    ref = mx.softmax(_full(reference_logits(pair, parts, drafter.draft, context), parts, pair), -1)
    assert mx.allclose(q0, ref[0], atol=1e-4).item()


def _full(small, parts, pair):
    full = mx.full((1, pair.vocab_size), -mx.inf)
    return mx.put_along_axis(full, parts.vocab_ids[None], small, axis=-1)


OPTION_SETS = [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.3}]


@pytest.fixture(scope="module")
def small_eagle_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("small_eagle")
    kw = {"chars": "abcd", "scale": 8.0, "vocab_rows": 9, "tie": False}
    target = make_tiny_model(root / "target", seed=3, **kw)
    draft = make_draft(root / "draft", target, seed=2, vocab_ids=[0, 1, 3, 4, 5], noise=1.0)
    pair = macspec.load(target, draft)
    pair.eos_token_ids = frozenset()  # every sequence has the full length
    return pair


@pytest.fixture(scope="module")
def small_tapped_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("small_tapped")
    kw = {"chars": "abcd", "scale": 8.0, "vocab_rows": 9, "tie": False, "layers": 3}
    target = make_tiny_model(root / "target", seed=3, **kw)
    draft = make_draft(
        root / "draft", target, seed=2, vocab_ids=[0, 1, 3, 4, 5], noise=1.0, feature_layers=(1,)
    )
    pair = macspec.load(target, draft)
    pair.eos_token_ids = frozenset()
    return pair


@pytest.fixture(scope="module")
def small_deep_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("small_deep")
    kw = {"chars": "abcd", "scale": 8.0, "vocab_rows": 9, "tie": False}
    target = make_tiny_model(root / "target", seed=3, **kw)
    draft = make_draft(
        root / "draft", target, seed=2, vocab_ids=[0, 1, 3, 4, 5], noise=1.0, layers=2
    )
    pair = macspec.load(target, draft)
    pair.eos_token_ids = frozenset()
    return pair


@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: ",".join(map(str, o.values())))
@pytest.mark.parametrize("which", ["final features", "tapped layers", "two layers"])
def test_speculative_distribution_matches_target(
    small_eagle_pair, small_tapped_pair, small_deep_pair, which, options
):
    pairs = {"tapped layers": small_tapped_pair, "two layers": small_deep_pair}
    pair = pairs.get(which, small_eagle_pair)
    prompt = [3, 4, 5, 3]
    expected = exact_joint(pair, prompt, 4, **options)
    counts = sample_prefixes(pair, prompt, 4, 800, num_draft=2, **options)
    assert chi_square(expected, counts) > 1e-3


def test_hidden_states_taps_are_the_layer_outputs(tapped_dirs):
    """Tapped features: each layer's output, then the final normed features, and the model's
    layers are left as they were."""
    model = macspec.load(tapped_dirs[0]).target
    ids = mx.array([1, 5, 6, 7])
    layers = list(model.model.layers)
    got = hidden_states(model, ids, None, (0, 1))
    h, outs = model.model.embed_tokens(ids[None]), []
    mask = "causal"
    for layer in layers:
        h = layer(h, mask, cache=None)
        outs.append(h[0])
    want = mx.concatenate([outs[0], outs[1], model.model.norm(h)[0]], axis=-1)
    assert got.shape == (4, 3 * 48)
    assert mx.allclose(got, want, atol=1e-5).item()
    assert list(model.model.layers) == layers
    assert mx.array_equal(got[:, -48:], hidden_states(model, ids, None)).item()


def test_tapped_draft_of_a_shallower_target_is_refused(tapped_dirs, tmp_path):
    shallow = make_tiny_model(tmp_path / "shallow", seed=0, hidden=48, tie=False, layers=1)
    with pytest.raises(ModelError, match="reads target layers"):
        macspec.load(shallow, tapped_dirs[1])


def test_bad_draft_directories(eagle_dirs, tmp_path):
    target, draft = eagle_dirs
    broken = shutil.copytree(draft, tmp_path / "broken")
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="cannot read the eagle draft"):
        macspec.load(target, broken)
    unknown = shutil.copytree(draft, tmp_path / "unknown")
    (unknown / "draft.json").write_text(json.dumps({"kind": "medusa"}))
    with pytest.raises(ModelError, match="unknown draft kind"):
        macspec.load(target, unknown)
    other = make_tiny_model(tmp_path / "other", seed=0, hidden=32)
    with pytest.raises(ModelError, match="hidden size"):
        macspec.load(other, draft)


def test_target_parts_head_matches_the_target(eagle_pair):
    parts = TargetParts(eagle_pair.target, mx.array([3, 7, 9], dtype=mx.int32))
    h = hidden_states(eagle_pair.target, mx.array([1, 5, 6]), None)
    full = eagle_pair.target.lm_head(h)
    assert mx.allclose(parts.logits(h), full[:, mx.array([3, 7, 9])], atol=1e-4).item()


def test_a_state_of_another_depth_is_refused(eagle_only, deep_dirs):
    """A draft state resumes only a draft of as many layers (one KVCache each): a one-layer
    draft's state given to a two-layer draft raises instead of drafting from half a cache."""
    from macspec.base.errors import CacheError

    context = [1, 10, 11, 12, 13]
    shallow = eagle_only.make_drafter(False)
    shallow.start(context, hidden_states(eagle_only.target, mx.array(context[:-1]), None))
    state = shallow.snapshot()
    deep = macspec.load(*deep_dirs, drafter="model").make_drafter(False)
    with pytest.raises(CacheError, match="1 layers cannot resume a draft of 2"):
        deep.resume(state, context, len(context) - 1)
