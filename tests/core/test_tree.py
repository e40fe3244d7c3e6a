"""Token trees (macspec/core/tree.py): one pass scores every node as its path alone would be
scored, the caches keep exactly the accepted path, and tree speculation is exact."""

import mlx.core as mx
import numpy as np
import pytest
from support import archzoo

import macspec
from macspec.base.errors import CacheError
from macspec.core import caches, tree
from macspec.core.tree import Tree

PROMPT = [5, 17, 30, 8, 44, 12, 9]
# root (the prompt's last id) -> 20, 21; 20 -> 22, 23; 21 -> 24; 22 -> 25
TREE = Tree(tokens=[20, 21, 22, 23, 24, 25], parents=[-1, -1, 0, 0, 1, 2])


def path_logits(model, ids):
    cache = caches.make_cache(model)
    with caches.forward(cache, len(ids)):
        return model(mx.array(ids)[None], cache=cache)[0, -1]


@pytest.mark.parametrize("kernels", [True, False])
def test_a_tree_pass_scores_each_node_as_its_path(tiny_dirs, kernels):
    model = macspec.load(tiny_dirs[0], kernels=kernels).target
    cache = caches.make_cache(model, 8)
    context = PROMPT[:-1]
    with caches.forward(cache, len(context)):
        model(mx.array(context)[None], cache=cache)
    start = caches.length(cache)
    rows = [-1, *range(len(TREE))]
    mask = tree.attend(TREE, start, rows, rows)
    with tree.tree_pass(model, cache, mask, [0, *TREE.depths], start):
        with caches.forward(cache, len(rows), rewindable=True):
            logits = model(mx.array([PROMPT[-1], *TREE.tokens])[None], cache=cache)[0]
    want = [path_logits(model, PROMPT)]
    want += [path_logits(model, PROMPT + [TREE.tokens[n] for n in TREE.path(i)]) for i in range(6)]
    np.testing.assert_allclose(np.array(logits), np.array(mx.stack(want)), atol=1e-4)
    # keep the path root -> 20 -> 22: the cache then continues as if only it had been fed
    tree.compact(cache, start, [0, 1, 3])
    assert caches.length(cache) == start + 3
    with caches.forward(cache, 1):
        nxt = model(mx.array([25])[None], cache=cache)[0, -1]
    want = path_logits(model, PROMPT + [20, 22, 25])
    np.testing.assert_allclose(np.array(nxt), np.array(want), atol=1e-4)


def test_windows_and_recurrent_states_refuse_trees(tmp_path):
    for arch in ("gemma3_text", "qwen3_5"):
        model = archzoo.build_model(arch)
        cache = caches.make_cache(model, 8)
        with pytest.raises(CacheError, match="cannot verify a token tree"):
            with tree.tree_pass(model, cache, mx.ones((1, 1), dtype=mx.bool_), [0], 0):
                pass


def test_the_walk_follows_the_samples():
    # root's sample 21 -> node 1; node 1's sample 24 -> node 4 (a leaf): its sample is the bonus
    assert tree.walk(TREE, [21, 0, 24, 0, 0, 9, 0]) == ([1, 4], 9)
    assert tree.walk(TREE, [7, 0, 0, 0, 0, 0, 0]) == ([], 7)  # no candidate drawn
    assert tree.walk(TREE, [20, 23, 0, 0, 0, 0, 0]) == ([0, 3], 0)


def generate_with(pair, policy, monkeypatch, prompt, **options):
    """macspec.generate with this policy instead of the options' (fixed K or adaptive)."""
    from macspec.api import stream as api

    monkeypatch.setattr(api, "FixedK", lambda k: policy)
    return macspec.generate(pair, prompt, adaptive=False, **options)


@pytest.mark.parametrize("shape", [(3, 2, 6), (4, 3, 10), (2, 1, 2)])
def test_greedy_tree_speculation_equals_target_only(pair, monkeypatch, shape):
    from macspec.core.policy import FixedTree
    from macspec.core.tree import TreeShape

    policy = FixedTree(TreeShape(*shape))
    rejected = accepted = 0
    for prompt in ["Once upon", "The cat sat on the", [1, 20, 30, 40, 5]]:
        plain = macspec.generate(pair, prompt, max_tokens=40, speculative=False)
        spec = generate_with(pair, policy, monkeypatch, prompt, max_tokens=40)
        assert spec.tokens == plain.tokens
        accepted += spec.stats.accepted
        rejected += spec.stats.drafted - spec.stats.accepted
    assert accepted > 0 and rejected > 0


@pytest.fixture(scope="module")
def eagle_dirs(tmp_path_factory):
    from support.drafts import make_draft
    from support.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("eagle")
    target = make_tiny_model(root / "target", seed=0, hidden=48, tie=False, scale=2.0, layers=3)
    vocab = [i for i in range(66) if i % 5 != 4]
    tapped = make_draft(root / "draft", target, vocab_ids=vocab, feature_layers=(0, 1))
    return target, tapped, make_draft(root / "deep", target, vocab_ids=vocab, layers=2)


@pytest.mark.parametrize("which", ["eagle", "eagle+ngram", "eagle, two layers"])
def test_greedy_tree_speculation_with_an_eagle_draft(eagle_dirs, monkeypatch, which):
    from macspec.core.policy import FixedTree
    from macspec.core.tree import TreeShape

    target, tapped, deep = eagle_dirs
    draft = deep if which == "eagle, two layers" else tapped
    pair = macspec.load(target, draft, drafter=None if which == "eagle+ngram" else "model")
    policy = FixedTree(TreeShape(3, 2, 6))
    accepted = 0
    for prompt in ["Once upon", "The cat sat on the", [20]]:
        plain = macspec.generate(pair, prompt, max_tokens=40, speculative=False)
        spec = generate_with(pair, policy, monkeypatch, prompt, max_tokens=40)
        assert spec.tokens == plain.tokens
        accepted += spec.stats.accepted
    assert accepted > 0


# ---------------------------------------------------------------- the output distribution

SMALL_PROMPT = [3, 4, 5, 3]
OPTION_SETS = [
    {"temperature": 1.0},
    {"temperature": 1.0, "top_p": 0.9, "top_k": 4, "min_p": 0.05, "repetition_penalty": 1.4},
]


# Power (simulated from the broken rule's distribution, measured at N=1000): with N=400 the
# favourite-child rule gives p < 1e-5 in every one of 400 simulated seed sets (N=200: 87%).
N = 400


def tree_counts(pair, monkeypatch, options, n=N):
    from support.exactness import sample_prefixes

    from macspec.api import stream as api
    from macspec.core.policy import FixedTree
    from macspec.core.tree import TreeShape

    policy = FixedTree(TreeShape(depth=2, width=2, max_nodes=4))
    monkeypatch.setattr(api, "FixedK", lambda k: policy)
    return sample_prefixes(pair, SMALL_PROMPT, 4, n, adaptive=False, **options)


@pytest.mark.parametrize("options", OPTION_SETS, ids=["T=1", "T=1,top-p,top-k,min-p,penalty"])
def test_tree_distribution_matches_the_target(small_pair, monkeypatch, options):
    from support.exactness import chi_square, exact_joint

    expected = exact_joint(small_pair, SMALL_PROMPT, 4, **options)
    counts = tree_counts(small_pair, monkeypatch, options)
    assert chi_square(expected, counts) > 1e-3


def favourite_child(t, samples):
    """A broken multi-candidate rule: when the target's draw is any candidate, take the
    draft's favourite candidate instead of the one drawn."""
    node, accepted = -1, []
    while True:
        y = samples[node + 1]
        children = t.children(node)
        if not any(t.tokens[c] == y for c in children):
            return accepted, y
        node = max(children, key=lambda c: t.scores[c])
        accepted.append(node)


def test_the_test_detects_a_broken_multi_candidate_rule(small_pair, monkeypatch):
    from support.exactness import chi_square, exact_joint

    monkeypatch.setattr(tree, "walk", favourite_child)
    expected = exact_joint(small_pair, SMALL_PROMPT, 4, temperature=1.0)
    counts = tree_counts(small_pair, monkeypatch, {"temperature": 1.0})
    assert chi_square(expected, counts) < 1e-5


# ---------------------------------------------------------------- the option


def test_tree_nodes_option_fixed_and_adaptive(pair, monkeypatch):
    """tree_nodes=N drafts trees of depth K (fixed), or lets the policy weigh them against
    chains (adaptive: with cheap wide passes, as on a GPU, it drafts trees)."""
    from macspec.core.adaptive import Trees
    from macspec.core.observed import Observed
    from macspec.core.policy import Costs

    flat = Costs(plain_step=1.0, draft_step=0.01, extra=0.0, verify=((1, 1.0), (16, 1.05)))
    monkeypatch.setattr(pair, "costs", flat)
    made = []
    real = Trees.__post_init__

    def spy(self):
        made.append(self)
        real(self)

    monkeypatch.setattr(Trees, "__post_init__", spy)
    # The observed check would weigh this CPU's real round times against the flat costs given
    # here; the costs alone choose, as on a machine whose passes are that cheap.
    monkeypatch.setattr(Observed, "choose", lambda self, label, priced: priced)
    for prompt in ["Once upon", "The cat sat on the"]:
        plain = macspec.generate(pair, prompt, max_tokens=40, speculative=False)
        fixed = macspec.generate(pair, prompt, max_tokens=40, tree_nodes=6, adaptive=False)
        adaptive = macspec.generate(pair, prompt, max_tokens=40, tree_nodes=6)
        assert fixed.tokens == adaptive.tokens == plain.tokens
    assert made and any(made[-1].speed.values())  # the adaptive policy did draft trees


def test_trees_are_refused_where_they_cannot_be_exact(tiny_dirs, tmp_path):
    ngram = macspec.load(tiny_dirs[0], drafter="ngram")
    with pytest.raises(macspec.OptionError, match="needs a draft model"):
        macspec.generate(ngram, "hi", tree_nodes=4)
    for arch, kind in (("gemma3_text", "window"), ("qwen3_5", "recurrent")):
        target = archzoo.make_arch_model(tmp_path / arch, arch)
        pair = macspec.load(target, target, drafter="model")
        with pytest.raises(macspec.OptionError, match=f"{kind} layers cannot verify a token tree"):
            macspec.generate(pair, archzoo.make_prompt(), tree_nodes=4)
        assert macspec.generate(pair, archzoo.make_prompt(), max_tokens=4).tokens  # chains run
