"""Speculation is exact on every architecture mlx-lm runs, whatever its layers cache: full
attention, sliding windows (wrapped: windows are shorter than the prompt), recurrent states.

Each model is a tiny random one built with mlx-lm's own class (tests/support/archzoo.py); the
reference is mlx-lm's own greedy `generate_step`. Architectures whose caches cannot be rewound are
refused at load, before any output, and still decode plainly.
"""

import pytest
from support import archzoo
from support.archs import REFUSED

import macspec
from macspec.base.errors import ModelError
from macspec.core.caches import recurrent

PROMPT = archzoo.make_prompt()  # 36 ids, longer than every window (8)
N = 40

# Refused, and why: their recurrences are not ones macspec can replay (mamba v1's per-token
# scan, RWKV-7, RG-LRU, Baichuan's key/value convolutions) or their cache is chunked (Llama 4).
SUPPORTED = [a for a in archzoo.ZOO if a not in REFUSED]
NAMED = [  # the architectures the cache issue names: all must be covered
    *"gemma3_text gemma4_text gpt_oss olmo3 cohere2 exaone4 gemma3 gemma4".split(),
    *"qwen3_next qwen3_5 qwen3_5_moe lfm2 mamba2 falcon_h1 granitemoehybrid nemotron_h".split(),
    *"llama mistral qwen2 qwen3 qwen3_moe gemma2 phi3 olmo2 granite starcoder2 cohere".split(),
    *"deepseek_v3 ministral3 mistral3 glm4_moe".split(),
]


def test_the_zoo_covers_every_named_architecture_and_25_in_all():
    assert set(NAMED) <= set(SUPPORTED)
    assert len(SUPPORTED) >= 25


@pytest.fixture(scope="module")
def zoo_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    made: dict[str, dict] = {}

    def get(arch: str) -> dict:
        if arch not in made:
            spec = archzoo.ZOO[arch]
            target = archzoo.make_arch_model(root / f"{arch}-target", arch)
            made[arch] = {
                "target": target,
                "near": archzoo.make_arch_model(
                    root / f"{arch}-near", arch, perturb=spec.draft_perturb
                ),
                "random": archzoo.make_arch_model(root / f"{arch}-random", arch, seed=1),
                "reference": archzoo.mlx_greedy(target, PROMPT, N),
            }
        return made[arch]

    return get


def _equal_to_reference(pair, reference, **options):
    r = macspec.generate(pair, PROMPT, max_tokens=N, **options)
    assert r.tokens == reference[: len(r.tokens)]
    assert len(r.tokens) == N or r.finish_reason == "stop"
    return r


@pytest.mark.parametrize("arch", SUPPORTED)
def test_greedy_speculation_equals_mlx_lm_greedy(zoo_dirs, arch):
    d = zoo_dirs(arch)
    target, ref = d["target"], d["reference"]
    # The model as its own draft: every draft accepted, whatever the caches had to do.
    same = macspec.load(target, target, drafter="model")
    r = _equal_to_reference(same, ref, num_draft=3, adaptive=False)
    assert r.stats.acceptance_rate == 1.0
    # A nearly-equal draft of the same architecture (its own windows / recurrent states):
    # partial acceptance, so both caches rewind into the middle of a pass.
    near = macspec.load(target, d["near"], drafter="model")
    _equal_to_reference(near, ref, num_draft=1, adaptive=False)
    _equal_to_reference(near, ref)  # adaptive K
    r = _equal_to_reference(near, ref, num_draft=3, adaptive=False)
    assert 0 < r.stats.acceptance_rate < 1
    # A random draft: almost everything rejected.
    _equal_to_reference(macspec.load(target, d["random"], drafter="model"), ref, num_draft=3)
    # n-gram drafting, fixed and adaptive (copies up to 16 ids: wider passes to take back).
    ngram = macspec.load(target, drafter="ngram")
    _equal_to_reference(ngram, ref, num_draft=3, adaptive=False)
    _equal_to_reference(ngram, ref)
    # Plain decoding, each step launched before the last id is read; again from the states the
    # first left in the prompt cache (the step launched past the end taken back).
    plain = macspec.load(target)
    _equal_to_reference(plain, ref, speculative=False)
    assert _equal_to_reference(plain, ref, speculative=False).stats.cached_tokens > 0


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_what_cannot_rewind_is_refused_at_load_and_decodes_plainly(zoo_dirs, arch):
    d = zoo_dirs(arch)
    for kwargs in ({"drafter": "ngram"}, {"draft": d["near"]}):
        with pytest.raises(ModelError, match=f"cannot speculate exactly.*{REFUSED[arch]}"):
            macspec.load(d["target"], **kwargs)
    plain = macspec.load(d["target"])
    assert plain.drafter_kind is None
    _equal_to_reference(plain, d["reference"])


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_5"])
def test_a_one_token_prompt_speculates_with_every_drafter(zoo_dirs, arch):
    d = zoo_dirs(arch)
    prompt = PROMPT[:1]
    want = archzoo.mlx_greedy(d["target"], prompt, 8)
    want = want[: want.index(2)] if 2 in want else want  # the EOS id ends an answer
    for kwargs in ({"draft": d["near"], "drafter": "model"}, {"draft": d["near"]}, {}):
        pair = macspec.load(d["target"], drafter="ngram") if not kwargs else None
        pair = pair or macspec.load(d["target"], **kwargs)
        for max_tokens in (1, 8):
            r = macspec.generate(pair, prompt, max_tokens=max_tokens)
            assert r.tokens == want[:max_tokens]


def test_load_says_which_cache_kinds_a_model_has(zoo_dirs):
    pair = macspec.load(zoo_dirs("qwen3_5")["target"], drafter="ngram")
    assert pair.cache_kinds == {"recurrent": 1, "attention": 1}
    assert "(1 recurrent, 1 full attention)" in pair.describe()
    pair = macspec.load(zoo_dirs("gemma3_text")["target"], drafter="ngram")
    assert set(pair.cache_kinds) == {"window", "attention"}


def test_a_wrong_recurrent_rewind_is_caught_at_load(zoo_dirs, monkeypatch):
    """The load-time probe compares a rewound state with fresh computation: a rewind that
    kept the drafts' state (the old silent bug) is refused, not run."""
    monkeypatch.setattr(recurrent._Segment, "state_at", lambda self, slot, m: self.assigned[slot])
    with pytest.raises(ModelError, match="would not be exact on this model"):
        macspec.load(zoo_dirs("qwen3_next")["target"], drafter="ngram")
