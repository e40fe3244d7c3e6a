"""A draft model that reads only a long prompt's end (load(draft_context=N)): its prefill is
N ids, not the whole prompt, and the answer is exactly the target's: greedy equal to plain
decoding, sampled as the target's distribution (a broken rule fails the same test), and across
a conversation's turns the prompt cache resumes the shortened draft state exactly."""

from __future__ import annotations

import mlx.core as mx
import pytest
from support.exactness import DEPTH, N, chi_square, exact_joint, resample_from_p, sample_prefixes

import macspec
import macspec.core.verify as verify
from macspec.base.errors import OptionError
from macspec.core import caches
from macspec.core.sampling import SamplingOptions
from macspec.core.verify import make_dist

LONG = "The quick brown fox jumps over the lazy dog. " * 3  # 135 ids


@pytest.fixture(scope="module")
def windowed(tiny_dirs):
    return macspec.load(*tiny_dirs, drafter="model", draft_context=16)


def _first_proposal(d, ids):
    d.propose(1, make_dist(SamplingOptions(), ids), mx.random.key(0))
    d.abort(1)


def test_the_draft_reads_only_the_prompts_end(windowed):
    """start() reads nothing (the answer's first token is the target's alone); the first
    proposal reads the prompt's last 16 ids, and only those."""
    ids = windowed.tokenizer.encode(LONG)
    d = windowed.make_drafter(False)
    d.start(ids)
    assert caches.length(d.cache) == 0 and d.pending == ids[len(ids) - 1 - 16 :]
    _first_proposal(d, ids)
    assert caches.length(d.cache) == 16 and d.pending == ids[-1:]
    state = d.snapshot()
    assert (state.start, state.length) == (len(ids) - 1 - 16, len(ids) - 1)
    short = windowed.tokenizer.encode("The quick")  # shorter than the window: all of it
    d.start(short)
    _first_proposal(d, short)
    assert caches.length(d.cache) == len(short) - 1 and d.snapshot().start == 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_with_a_short_draft_context_equals_plain_decoding(windowed, adaptive):
    plain = macspec.generate(windowed, LONG, max_tokens=60, speculative=False)
    r = macspec.generate(windowed, LONG, max_tokens=60, num_draft=4, adaptive=adaptive)
    assert r.tokens == plain.tokens
    if not adaptive:
        assert r.stats.drafted > r.stats.accepted > 0  # drafts kept and thrown away


def test_the_next_turn_resumes_the_shortened_draft_exactly(tiny_dirs):
    """Turn 2 starts from turn 1's kept states (the draft's holds only the end of turn 1's
    prompt); its answer equals a fresh pair's, and the draft read only the new ids."""
    pair = macspec.load(*tiny_dirs, drafter="model", draft_context=16)
    fresh = macspec.load(*tiny_dirs, drafter="model", draft_context=16)
    first = macspec.generate(pair, LONG, max_tokens=20, num_draft=3, adaptive=False)
    follow = LONG + first.text + " Then"
    again = macspec.generate(pair, follow, max_tokens=30, num_draft=3, adaptive=False)
    assert again.stats.cached_tokens > len(LONG)  # turn 1's states were resumed
    want = macspec.generate(fresh, follow, max_tokens=30, num_draft=3, adaptive=False)
    plain = macspec.generate(fresh, follow, max_tokens=30, speculative=False)
    assert again.tokens == want.tokens == plain.tokens


@pytest.fixture(scope="module")
def small_windowed(small_pair):
    p = macspec.load(small_pair.target_path, small_pair.draft_path, draft_context=1)
    p.eos_token_ids = frozenset()
    return p


# a prompt longer than the draft's context of 1 id: the draft drafts from less than the target
PROMPT = [3, 4, 5, 3, 4]


def test_sampling_with_a_short_draft_context_is_the_targets_distribution(small_windowed):
    expected = exact_joint(small_windowed, PROMPT, DEPTH, temperature=1.0)
    counts = sample_prefixes(
        small_windowed, PROMPT, DEPTH, N, num_draft=2, adaptive=False, temperature=1.0
    )
    assert chi_square(expected, counts) > 1e-3


def test_the_distribution_test_fails_on_a_broken_rule(small_windowed, monkeypatch):
    monkeypatch.setattr(verify, "accept", resample_from_p)
    expected = exact_joint(small_windowed, PROMPT, DEPTH, temperature=1.0)
    counts = sample_prefixes(
        small_windowed, PROMPT, DEPTH, N, num_draft=2, adaptive=False, temperature=1.0
    )
    assert chi_square(expected, counts) < 1e-5


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_a_bad_draft_context_is_refused(tiny_dirs, bad):
    with pytest.raises(OptionError, match="draft_context"):
        macspec.load(*tiny_dirs, draft_context=bad)
