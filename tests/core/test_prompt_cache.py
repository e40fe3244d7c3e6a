"""The prompt cache (core/caches/): a generation that starts from kept states gives exactly
the tokens a fresh prefill gives, on full-attention, sliding-window and hybrid recurrent models
and with every drafter kind; it falls back where a cache kind cannot go back; entries never
share buffers with a generation that writes into its caches."""

import pytest
from support import archzoo
from support.drafts import make_draft
from support.tinymodels import make_tiny_model

import macspec
from macspec.core.caches import PromptCache

GREEDY = {"max_tokens": 24, "temperature": 0.0, "num_draft": 3, "adaptive": False}
ARCHS = {"llama": "full", "gemma3_text": "sliding", "qwen3_5": "hybrid"}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_pair(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    target = archzoo.make_arch_model(root / "target", arch, seed=3)
    draft = archzoo.make_arch_model(root / "draft", arch, seed=3, perturb=0.1)
    pair = macspec.load(target, draft)
    pair.eos_token_ids = frozenset()  # every answer has its full length
    return arch, pair


def run(pair, ids, cache, **options):
    pair.prompt_cache = cache
    return macspec.generate(pair, ids, **{**GREEDY, **options})


def fresh(pair, ids, **options):
    return run(pair, ids, None, **options).tokens


# Plain decoding launches each step before it reads the last id: a step launched past the end
# must be taken back before the states are kept.
@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plain"])
def test_turns_reuse_the_cache_and_give_the_fresh_tokens(arch_pair, speculative):
    arch, pair = arch_pair
    cache = PromptCache()
    prompt = archzoo.make_prompt(0)
    first = run(pair, prompt, cache, speculative=speculative)
    assert first.tokens == fresh(pair, prompt)
    assert first.stats.cached_tokens == 0
    # The next turn extends the whole context: every layer kind goes on from where it was.
    turn = prompt + first.tokens + archzoo.make_prompt(1, 10)
    second = run(pair, turn, cache, speculative=speculative)
    assert second.tokens == fresh(pair, turn)
    assert second.stats.cached_tokens == len(prompt) + len(first.tokens) - 1
    # The same prompt again: the prefill's checkpoint (window, recurrent) or a rewind.
    again = run(pair, prompt, cache, speculative=speculative)
    assert again.tokens == first.tokens
    assert again.stats.cached_tokens == len(prompt) - 1


def test_a_prompt_that_leaves_the_answer_early(arch_pair):
    """Diverging 12 ids into the previous answer: attention rewinds there; the others go back
    only as far as they can (the window's spare slots, the recurrent checkpoints)."""
    arch, pair = arch_pair
    cache = PromptCache(min_step=4)
    prompt = archzoo.make_prompt(2)
    first = run(pair, prompt, cache, max_tokens=40)
    other = prompt + first.tokens[:12] + archzoo.make_prompt(3, 6)
    got = run(pair, other, cache)
    assert got.tokens == fresh(pair, other)
    if ARCHS[arch] == "full":
        assert got.stats.cached_tokens == len(prompt) + 12
    else:  # back to the prompt's checkpoint: the answer's states are gone
        assert got.stats.cached_tokens == len(prompt) - 1


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plain"])
def test_interleaved_generations_from_one_entry(arch_pair, speculative):
    """Two generations restored from the same entry, advanced round by round in turn, write into
    their own caches only (plain ones with a step launched ahead in each): each gives the tokens
    it gives alone."""
    _, pair = arch_pair
    cache = PromptCache()
    prompt = archzoo.make_prompt(4)
    first = run(pair, prompt, cache)
    a = prompt + first.tokens + archzoo.make_prompt(5, 8)
    b = prompt + first.tokens + archzoo.make_prompt(6, 8)
    pair.prompt_cache = cache
    options = {**GREEDY, "speculative": speculative}
    streams = [macspec.stream_generate(pair, ids, **options) for ids in (a, b)]
    out = [[], []]
    live = [0, 1]
    while live:
        for i in list(live):
            try:
                out[i] += next(streams[i]).emitted
            except StopIteration:
                live.remove(i)
    # (b may also start from a's prefill checkpoint, where they share an id more)
    assert min(s.stats().cached_tokens for s in streams) >= len(prompt) + len(first.tokens) - 1
    assert out == [fresh(pair, a), fresh(pair, b)]


def test_a_plain_entry_serves_a_draft_model_which_reads_the_prompt_itself(arch_pair):
    """An answer decoded plainly keeps the target's states only; a draft model's answer next
    (a chat's K 0, then the default; a server's plain and speculative clients) restores them,
    its draft reading the prompt on its own, and gives the tokens a fresh prefill gives."""
    _, pair = arch_pair
    prompt = archzoo.make_prompt(11)
    for context in (0, 4):  # the draft reads the whole prompt, or its last 4 ids
        cache = PromptCache()
        first = run(pair, prompt, cache, speculative=False)
        turn = prompt + first.tokens + archzoo.make_prompt(12, 6)
        pair.draft_context = context
        got = run(pair, turn, cache)
        assert got.tokens == fresh(pair, turn)
        assert got.stats.drafted > 0
        assert got.stats.cached_tokens == len(prompt) + len(first.tokens) - 1
    pair.draft_context = 0


@pytest.fixture(scope="module")
def eagle_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-cache")
    target = make_tiny_model(root / "target", seed=0, hidden=48, tie=False, scale=2.0)
    pair = macspec.load(target, make_draft(root / "draft", target))
    pair.eos_token_ids = frozenset()
    return pair


@pytest.mark.parametrize("drafter", ["eagle", "eagle, two layers", "ngram", "plain"])
def test_eagle_ngram_and_plain_resume_exactly(eagle_pair, drafter, tmp_path):
    pair = eagle_pair
    options = {"speculative": False} if drafter == "plain" else {}
    if drafter == "ngram":
        pair = macspec.load(pair.target_path, drafter="ngram")
        pair.eos_token_ids = frozenset()
    if drafter == "eagle, two layers":
        pair = macspec.load(
            pair.target_path, make_draft(tmp_path / "deep", pair.target_path, layers=2)
        )
        pair.eos_token_ids = frozenset()
    cache = PromptCache()
    prompt = archzoo.make_prompt(7)
    first = run(pair, prompt, cache, **options)
    for cut in (len(first.tokens), 5):  # the whole answer; a rewind into it
        turn = prompt + first.tokens[:cut] + archzoo.make_prompt(8, 6)
        got = run(pair, turn, cache, **options)
        assert got.tokens == fresh(pair, turn, **options)
        assert got.stats.cached_tokens >= len(prompt) + min(cut, len(first.tokens) - 1) - 1


def test_a_plain_entry_does_not_serve_a_drafter_that_needs_its_state(eagle_pair):
    cache = PromptCache()
    prompt = archzoo.make_prompt(9)
    run(eagle_pair, prompt, cache, speculative=False)  # kept without the eagle's features
    got = run(eagle_pair, prompt + archzoo.make_prompt(10, 5), cache)
    assert got.stats.cached_tokens == 0


def test_lru_caps_and_covered_entries(eagle_pair):
    cache = PromptCache(max_entries=2)
    prompts = [archzoo.make_prompt(s, 20) for s in (11, 12, 13)]
    for p in prompts:
        run(eagle_pair, p, cache, max_tokens=4)
    assert len(cache) == 2  # the oldest went
    assert run(eagle_pair, prompts[0], cache, max_tokens=4).stats.cached_tokens == 0
    # A turn that extends an entry replaces it: the new entry restores all it did.
    first = run(eagle_pair, prompts[2], cache, max_tokens=4)
    run(eagle_pair, prompts[2] + first.tokens + [5, 6], cache, max_tokens=4)
    assert len(cache) == 2
    small = PromptCache(max_bytes=1)  # nothing fits: nothing kept, nothing breaks
    assert run(eagle_pair, prompts[1], small).tokens == fresh(eagle_pair, prompts[1])
    assert len(small) == 0


def test_load_makes_one_and_the_environment_sizes_it(tmp_path, monkeypatch):
    target = make_tiny_model(tmp_path / "t", seed=0)
    assert macspec.load(target).prompt_cache is not None
    monkeypatch.setenv("MACSPEC_PROMPT_CACHE_MB", "0")
    assert macspec.load(target).prompt_cache is None
    monkeypatch.setenv("MACSPEC_PROMPT_CACHE_MB", "lots")
    with pytest.raises(macspec.OptionError):
        macspec.load(target)
