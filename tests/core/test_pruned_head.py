"""A draft model's head over the most frequent ids only (core/drafters/pruned.py): the logits it
gives, when the pair uses it, and exactness of speculation with it at T=0 and T=1."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import SMALL
from support.exactness import chi_square, exact_joint, sample_prefixes
from support.tinymodels import llama_like, make_tiny_model

import macspec
import macspec.core.verify as engine
from macspec.base import switches
from macspec.base.errors import OptionError
from macspec.core.drafters import ModelDrafter, pruned
from macspec.core.sampling import SamplingOptions, sample
from macspec.core.target import hidden_states

PROMPT = [3, 4, 5, 3]
DEPTH = 4  # a plain step, then one round of K=2 (as test_exactness)
N = 1000


def tiny_llama(**over):
    """96 ids, widths that quantize in groups of 32."""
    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    return llama_like(hidden_size=64, vocab_size=96, **shape, **over)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("bits", [0, 4, 8], ids=["float", "q4", "q8"])
def test_pruned_logits_are_the_heads_rows(tie, bits):
    model = tiny_llama(tie_word_embeddings=tie)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    ids = pruned.frequent_ids(20, 96, keep=[93, 95, 200])
    assert ids.tolist() == [*range(20), 93, 95]
    head = pruned.PrunedHead(model, ids, 96)
    tokens = mx.array([5, 9, 2, 40])
    full = model(tokens[None])[0]
    small = head(hidden_states(model, tokens, None))
    assert small.shape == (4, 22)
    assert mx.allclose(small, full[:, ids], rtol=1e-5, atol=1e-5).item()
    assert head.matches(model, [1, 2, 3])
    # The tied input embedding stays whole: the copy took its rows.
    embed = model.model.embed_tokens
    assert embed.weight.shape[0] == 96
    # Columns map back: every id of S to its column, the rest to |S|.
    assert head.lookup[ids].tolist() == list(range(22))
    assert head.lookup[20].item() == head.lookup[94].item() == 22
    probs = head.full(mx.ones((1, 22)))
    assert probs.shape == (1, 96) and probs[0, ids].tolist() == [1.0] * 22
    assert probs.sum().item() == 22


def test_the_prompts_ids_join_the_head():
    model = tiny_llama()
    head = pruned.PrunedHead(model, pruned.frequent_ids(20, 96), 96)
    assert head.with_context([3, 5, 19]) is head  # nothing lacking: the same head
    wide = head.with_context([3, 40, 95, 40, 300, -1])
    assert wide.ids.tolist() == [*range(20), 40, 95] and head.size == 20
    assert wide.lookup[40].item() == 20 and wide.lookup[95].item() == 21
    assert wide.lookup[41].item() == 22
    tokens = mx.array([5, 9, 2, 40])
    full = model(tokens[None])[0]
    small = wide(hidden_states(model, tokens, None))
    assert mx.allclose(small, full[:, wide.ids], rtol=1e-5, atol=1e-5).item()


def test_logits_changed_after_the_head_keep_the_whole_head():
    model = tiny_llama()
    stock = type(model)

    class Capped(stock):  # a soft cap after the head, as Gemma 2's
        def __call__(self, inputs, cache=None):
            return 2.0 * mx.tanh(stock.__call__(self, inputs, cache) / 2.0)

    assert pruned.prune_head(model, 96, 20) is not None
    model.__class__ = Capped
    assert pruned.prune_head(model, 96, 20) is None
    assert pruned.prune_head(model, 96, 0) is None


def test_a_head_of_another_kind_is_kept_whole():
    class Odd(nn.Module):  # a head whose rows are not the rows of its arrays
        def __init__(self, w):
            super().__init__()
            self.w = w

        def __call__(self, x):
            return x @ self.w.T

    model = tiny_llama(tie_word_embeddings=False)
    model.lm_head = Odd(model.lm_head.weight)
    assert pruned.prune_head(model, 96, 20) is None


def test_default_size_and_switch():
    assert pruned.chosen_size(151_665, None) == pruned.DEFAULT_SIZE
    assert pruned.chosen_size(2 * pruned.DEFAULT_SIZE, None) == 0  # small vocabularies: whole
    assert pruned.chosen_size(151_665, 0) == 0
    assert pruned.chosen_size(151_665, 16384) == 16384
    assert pruned.chosen_size(1000, 4000) == 0  # asked for more than there is: whole
    env = {"MACSPEC_DRAFT_VOCAB": "16384"}
    assert switches.DRAFT_VOCAB.value(env) == 16384
    assert switches.DRAFT_VOCAB.value({}) is None
    assert switches.DRAFT_VOCAB.value({"MACSPEC_DRAFT_VOCAB": "0"}) == 0
    for bad in ("-1", "1.5", "many"):
        with pytest.raises(OptionError, match="MACSPEC_DRAFT_VOCAB"):
            switches.DRAFT_VOCAB.value({"MACSPEC_DRAFT_VOCAB": bad})


@pytest.fixture(scope="module")
def tied_dirs(tmp_path_factory):
    """A target and a noisy copy of it (the draft), both with tied heads, 72 ids."""
    root = tmp_path_factory.mktemp("pruned")
    target = make_tiny_model(root / "target", seed=0, hidden=48, tie=True)
    draft = make_tiny_model(root / "draft", seed=0, hidden=48, tie=True, perturb=0.3)
    return target, draft


def load_pruned(dirs, size):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MACSPEC_DRAFT_VOCAB", str(size))
        return macspec.load(*dirs, drafter="model")


def test_greedy_equals_plain_with_a_pruned_head(tied_dirs):
    pair = load_pruned(tied_dirs, 30)
    assert pair.draft_vocab == 30 and "its head over 30 ids" in pair.describe()
    assert pair.make_drafter(False).head.size == 30
    for extra in ({}, {"repetition_penalty": 1.3}):
        plain = macspec.generate(pair, "Once upon", max_tokens=60, speculative=False, **extra)
        spec = macspec.generate(
            pair, "Once upon", max_tokens=60, num_draft=3, adaptive=False, **extra
        )
        assert spec.tokens == plain.tokens
        assert 0 < spec.stats.accepted < spec.stats.drafted
        # Some of the target's ids lie outside the head's: the target's own token gives them.
        assert any(t >= 30 for t in plain.tokens)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_adaptive_length_cuts_the_same_chain(tied_dirs, temperature):
    """With adaptive length the drafter proposes a prefix of the chain it drafts without; every
    draft is an id of S (at T=0 its argmax over S, a point mass)."""
    pair = load_pruned(tied_dirs, 30)
    prompt = pair.tokenizer.encode("Once upon a time")
    dist = engine.make_dist(SamplingOptions(temperature=temperature), prompt)
    chains = []
    for stop_below in (0.0, 0.9):
        drafter = ModelDrafter(pair.draft, pair.vocab_size, stop_below, pair.make_drafter().head)
        drafter.start(prompt, max_step=7)
        proposal = drafter.propose(6, dist, mx.random.key(4))
        assert (proposal.probs is None) == (temperature == 0)
        chains.append(proposal.tokens.tolist())
    assert len(chains[0]) == 6 and 1 <= len(chains[1]) < 6
    assert chains[0][: len(chains[1])] == chains[1]
    # S: the 30 lowest ids and the prompt's ("O" is not among the 30 lowest)
    allowed = set(range(30)) | set(prompt)
    assert drafter.head.ids.tolist() == [*range(30), *sorted(set(prompt) - set(range(30)))]
    assert set(chains[0]) <= allowed


def test_a_grammar_allowing_only_ids_outside_the_head_is_cut_not_wrong(tied_dirs):
    """Capitals lie outside the 30 lowest ids: where the grammar allows only them, the draft
    is cut there; greedy answers equal plain constrained decoding, sampled ones follow it."""
    pair = load_pruned(tied_dirs, 30)
    kw = {"grammar": "start: /([A-Z][a-z])+/", "max_tokens": 24, "num_draft": 3}
    for prompt in ("Ab Cd", "Once"):
        spec = macspec.generate(pair, prompt, adaptive=False, **kw)
        plain = macspec.generate(pair, prompt, speculative=False, **kw)
        assert spec.tokens == plain.tokens and spec.stats.drafted > 0
    for seed in range(4):
        r = macspec.generate(pair, "Ab", temperature=1.0, seed=seed, adaptive=False, **kw)
        assert r.text[::2].isupper() and r.text[1::2].islower()


def test_switch_off_keeps_the_whole_head(tied_dirs):
    pair = load_pruned(tied_dirs, 0)
    assert pair.draft_vocab == 0 and pair.make_drafter(False).head is None
    assert "its head" not in pair.describe()


@pytest.fixture(scope="module")
def small_pruned(tmp_path_factory):
    """Over 7 ids (3 specials + "abcd"): the draft's head scores the specials and "ab", and
    "c" (5) as the prompt holds it, so "d" (6) comes from the residual alone."""
    root = tmp_path_factory.mktemp("small_pruned")
    kw = {"chars": SMALL, "scale": 8.0, "vocab_rows": 9, "tie": False}
    target = make_tiny_model(root / "target", seed=3, **kw)
    draft = make_tiny_model(root / "draft", seed=3, perturb=0.2, **kw)
    pair = load_pruned((target, draft), 5)
    pair.eos_token_ids = frozenset()
    assert pair.make_drafter(False).head.ids.tolist() == [0, 1, 2, 3, 4]
    return pair


@pytest.mark.parametrize("options", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 3}])
def test_pruned_head_distribution_matches_target(small_pruned, options):
    expected = exact_joint(small_pruned, PROMPT, DEPTH, **options)
    counts = sample_prefixes(small_pruned, PROMPT, DEPTH, N, num_draft=2, adaptive=False, **options)
    assert chi_square(expected, counts) > 1e-3
    assert any(6 in seq[1:] for seq in counts)  # the id outside S comes


def residual_over_s(p, q, drafts, key):
    """A broken rule: the residual taken over S only (the target's ids outside S dropped)."""
    in_s = (mx.sum(q, axis=0, keepdims=True) > 0).astype(p.dtype)
    n, _ = correct_accept(p, q, drafts, key)
    q = mx.concatenate([q, mx.zeros((1, q.shape[1]), q.dtype)])
    residual = mx.maximum(mx.take(p, n, axis=0) * in_s[0] - mx.take(q, n, axis=0), 0.0)
    residual = mx.where(mx.sum(residual) > 0, residual, mx.take(p, n, axis=0) * in_s[0])
    return n, sample(residual[None], mx.random.split(key)[1])[0]


correct_accept = engine.accept


def test_the_test_detects_a_residual_over_s_only(small_pruned, monkeypatch):
    monkeypatch.setattr(engine, "accept", residual_over_s)
    expected = exact_joint(small_pruned, PROMPT, DEPTH, temperature=1.0)
    counts = sample_prefixes(
        small_pruned, PROMPT, DEPTH, N, num_draft=2, adaptive=False, temperature=1.0
    )
    assert chi_square(expected, counts) < 1e-5


def test_the_test_detects_q_renormalised_over_the_vocabulary(small_pruned, monkeypatch):
    """A broken q: the draft's probabilities over S reported as a softmax over every id would
    give them (the mass of the ids outside S counted), not the distribution it drew from."""
    stock = pruned.PrunedHead.full

    def shrunk(self, small):
        return stock(self, small) * 0.6

    monkeypatch.setattr(pruned.PrunedHead, "full", shrunk)
    expected = exact_joint(small_pruned, PROMPT, DEPTH, temperature=1.0)
    counts = sample_prefixes(
        small_pruned, PROMPT, DEPTH, N, num_draft=2, adaptive=False, temperature=1.0
    )
    assert chi_square(expected, counts) < 1e-5
