"""stream_generate's on_prefill: a long prompt read in turns and told as it goes, with the same
bits as read at once, greedy speculation equal to plain decoding, and a stop from inside it."""

from __future__ import annotations

import pytest
from support.tinymodels import make_tiny_model

import macspec
from macspec.core.loop import READ_CHUNK


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    target = make_tiny_model(root / "t", seed=7, hidden=48, context=2048)
    draft = make_tiny_model(root / "d", seed=7, hidden=48, context=2048, perturb=0.05)
    return macspec.load(str(target), str(draft))


def _prompt(pair, n):
    vocab = pair.vocab_size
    return [(i * 7919 + 13) % (vocab - 3) + 3 for i in range(n)]


def _fresh(pair):
    if pair.prompt_cache is not None:
        pair.prompt_cache.clear()  # every run reads the whole prompt


def test_reading_is_told_every_chunk_and_at_the_end(pair):
    ids = _prompt(pair, 1300)
    told = []
    _fresh(pair)
    out = macspec.generate(
        pair, prompt=ids, max_tokens=6, temperature=0, on_prefill=lambda *a: told.append(a)
    )
    end = len(ids) - 1  # the target holds all but the last id before the first pass
    assert told == [(READ_CHUNK, end), (2 * READ_CHUNK, end), (end, end)]
    assert len(out.tokens) == 6
    # A short prompt: one turn, told once.
    told.clear()
    _fresh(pair)
    macspec.generate(pair, prompt=ids[:40], max_tokens=2, on_prefill=lambda *a: told.append(a))
    assert told == [(39, 39)]


@pytest.mark.parametrize("speculative", [False, True])
def test_the_same_bits_as_read_at_once(pair, speculative):
    ids = _prompt(pair, 1300)
    runs = []
    for progress in (None, lambda *a: None):
        _fresh(pair)
        r = macspec.generate(
            pair, prompt=ids, max_tokens=16, temperature=0, top_logprobs=2,
            speculative=speculative, on_prefill=progress,
        )  # fmt: skip
        runs.append(r)
    told, alone = runs[1], runs[0]
    assert told.tokens == alone.tokens
    _fresh(pair)
    plain = macspec.generate(pair, prompt=ids, max_tokens=16, temperature=0, speculative=False)
    assert told.tokens == plain.tokens  # greedy speculation equals plain decoding


def test_the_log_probabilities_are_bit_for_bit_the_same(pair):
    ids = _prompt(pair, 1100)
    seen = []
    for progress in (None, lambda *a: None):
        _fresh(pair)
        stream = macspec.stream_generate(
            pair, prompt=ids, max_tokens=8, temperature=0, top_logprobs=3, speculative=False,
            on_prefill=progress,
        )  # fmt: skip
        seen.append([(lp.id, lp.logprob, lp.top) for ev in stream for lp in ev.logprobs])
    assert seen[0] == seen[1]


class Stop(Exception):
    pass


def test_an_exception_from_on_prefill_ends_the_generation_and_the_pair_goes_on(pair):
    ids = _prompt(pair, 1300)

    def stop(read, total):
        if read >= READ_CHUNK:
            raise Stop

    _fresh(pair)
    with pytest.raises(Stop):
        macspec.generate(pair, prompt=ids, max_tokens=4, on_prefill=stop)
    _fresh(pair)
    after = macspec.generate(pair, prompt=ids, max_tokens=8, temperature=0)
    _fresh(pair)
    plain = macspec.generate(pair, prompt=ids, max_tokens=8, temperature=0, speculative=False)
    assert after.tokens == plain.tokens


def test_the_turns_are_whole_chunks_of_every_backends_reading():
    """A reported reading's turns start where a reading at once has a chunk start, on every
    backend's chunk (hooks.prefill_chunk: the CPU's, mlx's default), so its bits are the same."""
    from macspec import cpu
    from macspec.core import hooks

    for chunk in (hooks.Hooks().prefill_chunk, cpu.HOOKS.prefill_chunk):
        assert READ_CHUNK % chunk == 0
    assert hooks.prefill_chunk() == (cpu.HOOKS if cpu.installed() else hooks.Hooks()).prefill_chunk
