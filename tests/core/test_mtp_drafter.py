"""Drafting with a model's own MTP heads (`macspec.load(target, drafter="mtp")`): greedy
equality with plain decoding on every layout, the heads' caches against a recomputation from the
kept context (several heads, a hybrid target), the output distribution at T=1 (and a broken rule
caught), and what is refused."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from support.drafter_models import make_mtp_checkpoint
from support.exactness import chi_square, exact_joint, sample_prefixes
from support.policies import SOFTMAX
from support.tinymodels import make_tiny_model

import macspec
from macspec.base.errors import ModelError, OptionError
from macspec.core import caches
from macspec.core import target as target_module
from macspec.core.drafters import MtpDrafter, drafter_class
from macspec.core.target import hidden_states
from macspec.models import mtp
from macspec.models.convert import convert
from macspec.models.store import store_root

# (architecture, heads): every layout, hybrid targets (qwen3_next, qwen3_5) among them
TARGETS = {"deepseek_v3": 2, "glm4_moe": 1, "qwen3_next": 2, "qwen3_5": 1, "mimo": 3}


def _convert(root, arch: str, count: int, **over) -> object:
    src = make_mtp_checkpoint(root / f"src-{arch}", arch, count=count, seed=3, **over)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MACSPEC_HOME", str(root / "home"))
        return convert(str(src), output=arch, dtype="float32")


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-targets")
    return {arch: _convert(root, arch, count) for arch, count in TARGETS.items()}


def tame(heads, noise: float = 0.1) -> None:
    """Random heads accept almost nothing; these guess "the token after next is the next one"
    (the fusion passes the target's state through, the block adds small terms), which tiny
    random targets make true often enough to exercise both keeping and rewinding."""
    for head in heads:
        h = head.out_norm.weight.shape[0]
        eye, zero = mx.eye(h), mx.zeros((h, h))
        pick = [eye, zero] if head.hidden_first else [zero, eye]
        head.proj.weight = mx.concatenate(pick, axis=1) + noise * head.proj.weight
        small = [
            (k, noise * v)
            for k, v in tree_flatten(head.block.parameters())
            if k.endswith(("o_proj.weight", "down_proj.weight"))
        ]
        head.block.load_weights(small, strict=False)


def mtp_pair(path, **kw):
    pair = macspec.load(path, drafter="mtp", measure=False, **kw)
    tame(pair.make_drafter(False).heads)  # the factory's heads, shared by every drafter
    pair.eos_token_ids = frozenset()  # full-length answers: more rounds
    return pair


def test_registered_and_described(targets):
    assert drafter_class("mtp") is MtpDrafter
    assert "mtp" in macspec.api.drafters.DRAFTERS
    pair = macspec.load(targets["deepseek_v3"], drafter="mtp", measure=False)
    assert pair.drafter_kind == "mtp"
    assert pair.describe() == "deepseek_v3, mtp drafting (2 MTP heads (deepseek layout))"
    hybrid = macspec.load(targets["qwen3_5"], drafter="mtp", measure=False)
    assert "recurrent" in hybrid.describe() and "(1 MTP head (qwen3_next layout))" in (
        hybrid.describe()
    )
    drafter = pair.make_drafter(True)
    assert isinstance(drafter, MtpDrafter) and drafter.needs_hidden and drafter.count == 2
    assert drafter.stop_below > 0 and pair.make_drafter(False).stop_below == 0


@pytest.mark.parametrize("arch", list(TARGETS))
def test_greedy_speculative_equals_plain(targets, arch):
    pair = mtp_pair(targets[arch])
    accepted = rejected = 0
    for prompt in ["Once upon", "ab ab ab ab"]:
        plain = macspec.generate(pair, prompt, max_tokens=24, speculative=False)
        for k in (1, 2, 3, 5):
            for adaptive in (False, True):
                spec = macspec.generate(pair, prompt, max_tokens=24, num_draft=k, adaptive=adaptive)
                assert spec.tokens == plain.tokens, f"{prompt!r} K={k} adaptive={adaptive}"
                accepted += spec.stats.accepted
                rejected += spec.stats.drafted - spec.stats.accepted
    assert rejected > 0 and accepted > 0, (accepted, rejected)  # keeping and rewinding both ran


def reference_logits(pair, drafter, context, drafted):
    """Each head's logits at the last position computed from scratch over the whole context:
    head 0 on the target's states, head j on head j-1's recycled outputs and ids j further."""
    n = len(context)
    seq = mx.array(context + drafted, dtype=mx.int32)
    states = hidden_states(pair.target, mx.array(context[:-1]), None)
    out = []
    for j, head in enumerate(drafter.heads[: len(drafted) + 1]):
        x = states[None]
        o = head(x, drafter._embed(j, seq[1 + j : n + j])[None], mtp.MtpHead.make_mask(x))[0]
        out.append(drafter._logits(j, o[-1:]))
        states = drafter._recycle(j, o)
    return out


soft = SOFTMAX


@pytest.mark.parametrize("arch", ["deepseek_v3", "mimo", "qwen3_next"])
def test_head_caches_after_rounds_match_a_recomputation(targets, arch):
    """Plain steps, partial, full and no acceptance, an abort: every head's proposal (depths
    1..count, which read every cached row of every head) equals the heads run afresh over the
    kept context."""
    pair = mtp_pair(targets[arch])
    drafter = pair.make_drafter(False)
    context = [1, 10, 11, 12, 13, 14, 15]

    def target_hidden(ids):
        return hidden_states(pair.target, mx.array(ids), None)

    drafter.start(context, target_hidden(context[:-1]))
    drafter.commit(0, 0, [20], target_hidden(context)[-1:])  # a plain step
    context.append(20)
    plan = [(4, 2), (3, 3), (2, 0), ("abort", 3), (4, 1), (1, 1), (5, 4), (3, 0), (2, 2)]
    key = mx.random.key(0)
    for step in plan:
        key, sub = mx.random.split(key)
        if step[0] == "abort":
            drafter.propose(step[1], soft, sub)
            drafter.abort(step[1])
            continue
        k, n = step
        proposal = drafter.propose(k, soft, sub)
        drafts = proposal.tokens.tolist()
        assert len(drafts) == k
        depth = min(k, drafter.count)
        refs = reference_logits(pair, drafter, context, drafts[: depth - 1])
        for j, ref in enumerate(refs):
            want = mx.softmax(ref, axis=-1)[0]
            assert mx.allclose(proposal.probs[j], want, atol=1e-4).item(), (step, j)
        emitted = drafts[:n] + [(drafts[n] + 1) % 60 if n < k else 30]
        drafter.commit(k, n, emitted, target_hidden(context + drafts[:n])[-(n + 1) :])
        context += emitted
        # head 0 holds or has pending every position the target read
        assert drafter.caches[0].offset + drafter.pend[0].shape[0] == len(context) - 1


def test_rewinds_on_a_hybrid_target(targets):
    """Qwen3-Next: recurrent layers in the target, attention in the head. Rounds with
    rejections leave the target's states as a fresh read of the kept ids (and rewinding into a
    forward matches a forward of the kept ids alone)."""
    pair = mtp_pair(targets["qwen3_next"])
    assert pair.cache_kinds.get("recurrent")
    caches.verify(pair.target, [3, 9, 14, 20, 27, 33])
    spec = macspec.generate(pair, "ab ab ab", max_tokens=30, num_draft=3, adaptive=False)
    plain = macspec.generate(pair, "ab ab ab", max_tokens=30, speculative=False)
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > spec.stats.accepted  # some rounds were rewound


def test_a_long_prompt_is_fed_in_chunks(targets):
    pair = mtp_pair(targets["deepseek_v3"])
    drafter = pair.make_drafter(False)
    context = [(7 * i) % 60 + 1 for i in range(1100)]
    drafter.start(context, hidden_states(pair.target, mx.array(context[:-1]), None))
    # head 0 keeps its last pair (position N-2) pending; head 1 is fed to its last real
    # position, N-3 (its id there is x_{N-1})
    assert drafter.caches[0].offset == len(context) - 2 and drafter.pend[0].shape[0] == 1
    assert drafter.caches[1].offset == len(context) - 2 and drafter.pend[1] is None
    proposal = drafter.propose(2, soft, mx.random.key(0))
    refs = reference_logits(pair, drafter, context, proposal.tokens.tolist()[:1])
    for j, ref in enumerate(refs):
        assert mx.allclose(proposal.probs[j], mx.softmax(ref, -1)[0], atol=1e-4).item()


def test_one_head_resumes_from_the_prompt_cache(targets):
    """One head keeps a prompt-cache state (as EAGLE's); a second prompt sharing the first's
    start skips it and still decodes as plain decoding does."""
    pair = mtp_pair(targets["glm4_moe"])
    assert pair.make_drafter(False).state_kind == "mtp"
    assert pair.make_drafter(False).state_kind == "mtp"
    first = "ab ab ab cd cd cd ef"
    macspec.generate(pair, first, max_tokens=8, num_draft=3)
    second = first + " gh"
    spec = macspec.generate(pair, second, max_tokens=16, num_draft=3)
    assert spec.stats.cached_tokens > 0
    plain = macspec.generate(pair, second, max_tokens=16, speculative=False)
    assert spec.tokens == plain.tokens
    several = macspec.load(targets["mimo"], drafter="mtp", measure=False)
    assert several.make_drafter(False).state_kind is False  # several heads: no kept state


# ------------------------------------------------------------------ the distribution at T=1


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Targets of 9 output rows (the joint of 3 tokens enumerable), one single-head hybrid and
    one with two heads, their heads left random (q far from p: a broken rule shows)."""
    root = tmp_path_factory.mktemp("mtp-small")
    pairs = {}
    for arch, count in (("qwen3_5", 1), ("deepseek_v3", 2)):
        path = _convert(root, arch, count, vocab_size=9)
        pair = macspec.load(path, drafter="mtp", measure=False)
        pair.eos_token_ids = frozenset()  # every sequence has the full length
        pairs[arch] = pair
    return pairs


def _sample_argmax(q, key):
    """A broken drafter: it reports q but always drafts q's most likely id."""
    return mx.argmax(q, axis=-1)


# T=1 over the whole vocabulary; and T=1 cut to the 3 likeliest ids, where the joint of three
# tokens has 27 cells and 600 answers show a broken rule plainly.
OPTIONS = {"T=1": {"temperature": 1.0}, "T=1,top_k=3": {"temperature": 1.0, "top_k": 3}}


@pytest.mark.parametrize(
    ("options", "broken"), [("T=1", False), ("T=1,top_k=3", False), ("T=1,top_k=3", True)]
)
@pytest.mark.parametrize("arch", ["qwen3_5", "deepseek_v3"])
def test_distribution_at_temperature_one(small, arch, options, broken, monkeypatch):
    pair = small[arch]
    assert pair.vocab_size == 9
    if broken:
        monkeypatch.setattr("macspec.core.drafters.mtp.sample", _sample_argmax)
    prompt, opts = [3, 4, 5, 3], OPTIONS[options]
    expected = exact_joint(pair, prompt, 3, **opts)
    counts = sample_prefixes(pair, prompt, 3, 600, num_draft=2, adaptive=False, **opts)
    p = chi_square(expected, counts)
    assert (p < 1e-3) if broken else (p > 1e-3), p


# ------------------------------------------------------------------ refused


def _store_is_empty() -> bool:
    root = store_root()
    return not root.exists() or not any(root.iterdir())


def test_a_model_without_heads_is_refused_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    plain = make_tiny_model(tmp_path / "plain", seed=1)
    with pytest.raises(ModelError, match=r"plain keeps no MTP heads \(mtp.json is missing\)"):
        macspec.load(plain, drafter="mtp", measure=False)
    with pytest.raises(OptionError, match="drafter='mtp' uses no draft model"):
        macspec.load(plain, plain, drafter="mtp")
    assert _store_is_empty()


def test_truncated_stored_heads_are_refused_by_key(targets, tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    broken = shutil.copytree(targets["mimo"], tmp_path / "mimo")
    weights = mx.load(str(broken / mtp.WEIGHTS))
    weights.pop("heads.2.out_norm.weight")
    mx.save_safetensors(str(broken / mtp.WEIGHTS), weights)
    with pytest.raises(ModelError, match=r"mtp.safetensors lacks 'heads.2.out_norm.weight'"):
        macspec.load(broken, drafter="mtp", measure=False)
    (broken / mtp.WEIGHTS).write_bytes(b"not a safetensors file")
    with pytest.raises(ModelError, match="cannot read .*mtp.safetensors"):
        macspec.load(broken, drafter="mtp", measure=False)
    assert _store_is_empty()


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_one_head_drafts_token_trees(tmp_path_factory, targets, arch):
    """Trees on attention-only targets with one head (GQA: GLM-4.5; MLA: DeepSeek-V3)."""
    path = targets[arch]
    if arch == "deepseek_v3":  # the module's DeepSeek target has two heads: one of its own
        path = _convert(tmp_path_factory.mktemp("one-head"), arch, 1)
    pair = mtp_pair(path)
    accepted = rejected = 0
    for prompt in ["Once upon", "ab ab ab ab"]:
        plain = macspec.generate(pair, prompt, max_tokens=24, speculative=False)
        for nodes in (4, 8):
            spec = macspec.generate(
                pair, prompt, max_tokens=24, num_draft=3, tree_nodes=nodes, adaptive=False
            )
            assert spec.tokens == plain.tokens, (prompt, nodes)
            accepted += spec.stats.accepted
            rejected += spec.stats.drafted - spec.stats.accepted
    assert accepted > 0 and rejected > 0, (accepted, rejected)


def test_trees_are_refused_with_several_heads_or_a_hybrid_target(targets):
    pair = macspec.load(targets["deepseek_v3"], drafter="mtp", measure=False)
    with pytest.raises(OptionError, match="several MTP heads draft chains only"):
        macspec.generate(pair, "ab", max_tokens=4, tree_nodes=4)
    hybrid = macspec.load(targets["qwen3_5"], drafter="mtp", measure=False)
    with pytest.raises(OptionError, match="recurrent layers cannot verify a token tree"):
        macspec.generate(hybrid, "ab", max_tokens=4, tree_nodes=4)


def test_costs_are_measured_on_the_heads(targets, tmp_path, monkeypatch):
    """The adaptive policy's draft cost is measured on MTP rounds (the head's layer and output
    product per token, not a draft model), and the verification passes keep hidden states as
    the drafter makes the target do."""
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    calls = {"propose": 0, "hidden": 0}
    propose, hidden = MtpDrafter.propose, target_module.hidden_states

    def counted_propose(self, *args, **kwargs):
        calls["propose"] += 1
        return propose(self, *args, **kwargs)

    def counted_hidden(*args, **kwargs):
        calls["hidden"] += 1
        return hidden(*args, **kwargs)

    monkeypatch.setattr(MtpDrafter, "propose", counted_propose)
    monkeypatch.setattr(target_module, "hidden_states", counted_hidden)
    pair = macspec.load(targets["glm4_moe"], drafter="mtp")
    assert pair.costs is not None and pair.costs.draft_step > 0
    assert calls["propose"] >= 3 and calls["hidden"] > 0


def test_a_head_left_unused_is_fed_before_its_states_pile_up(targets):
    """One-draft proposals never reach head 1: its pending states are fed once they pass PILE,
    and the next deeper proposal still equals a recomputation."""
    from macspec.core.drafters.mtp import PILE

    pair = mtp_pair(targets["deepseek_v3"])
    drafter = pair.make_drafter(False)
    context = [1, 10, 11, 12]
    drafter.start(context, hidden_states(pair.target, mx.array(context[:-1]), None))
    key = mx.random.key(1)
    for i in range(PILE + 20):
        key, sub = mx.random.split(key)
        drafts = drafter.propose(1, soft, sub).tokens.tolist()
        n = i % 2
        emitted = drafts[:n] + [(7 * i) % 60 + 1]
        hid = hidden_states(pair.target, mx.array(context + drafts[:n]), None)[-(n + 1) :]
        drafter.commit(1, n, emitted, hid)
        context += emitted
        assert drafter.pend[1] is None or drafter.pend[1].shape[0] <= PILE
    proposal = drafter.propose(2, soft, key)
    refs = reference_logits(pair, drafter, context, proposal.tokens.tolist()[:1])
    for j, ref in enumerate(refs):
        assert mx.allclose(proposal.probs[j], mx.softmax(ref, -1)[0], atol=1e-4).item(), j
