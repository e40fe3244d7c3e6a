"""Caches that rewind exactly (macspec/core/caches/), checked without any model first."""

import random

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

from macspec.base.errors import CacheError
from macspec.core import caches


def attend(q, k, v, mask):
    """Single-head attention with mlx-lm's mask conventions (None, "causal", bool array)."""
    scores = q @ k.swapaxes(-1, -2)
    if isinstance(mask, str):
        mask = create_causal_mask(q.shape[2], k.shape[2] - q.shape[2])
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ v


def reference(history_k, history_v, q, start, window):
    """What a query block at positions start.. sees: the window over the full history."""
    n = q.shape[2]
    end = start + n
    mask = create_causal_mask(n, start, window_size=window)
    return attend(q, history_k[..., :end, :], history_v[..., :end, :], mask)


@pytest.mark.parametrize("window,max_step", [(4, 1), (5, 3), (8, 5), (3, 9)])
def test_window_cache_attends_exactly_the_window_through_forwards_and_rewinds(window, max_step):
    """Random forwards (1..max_step tokens, sometimes a long chunk) and rewinds (up to
    max_step): every attention output equals the window attention over the true history."""
    rng = random.Random(window * 31 + max_step)
    cache = caches.WindowKVCache(window, max_step)
    dim = 4
    true_k = mx.zeros((1, 1, 0, dim))
    true_v = mx.zeros((1, 1, 0, dim))
    key = mx.random.key(window + max_step)
    for step in range(120):
        n = rng.choice([1] * 4 + list(range(1, max_step + 1)) + [max_step + 7, 2 * window])
        key, k1, k2, k3 = mx.random.split(key, 4)
        k = mx.random.normal((1, 1, n, dim), key=k1)
        v = mx.random.normal((1, 1, n, dim), key=k2)
        q = mx.random.normal((1, 1, n, dim), key=k3)
        start = cache.offset
        mask = cache.make_mask(n, window_size=window)
        keys, values = cache.update_and_fetch(k, v)
        true_k = mx.concatenate([true_k[..., :start, :], k], axis=2)
        true_v = mx.concatenate([true_v[..., :start, :], v], axis=2)
        got = attend(q, keys, values, mask)
        want = reference(true_k, true_v, q, start, window)
        assert mx.allclose(got, want, atol=1e-5).item(), (step, n, start)
        assert cache.keys.shape[2] <= window + max_step - 1 or n > max_step
        back = rng.randint(0, min(n, max_step)) if n <= max_step else 0
        if back:
            caches.rewind([cache], cache.offset - back)
            assert cache.offset == start + n - back


def test_window_cache_memory_is_the_window_plus_max_step():
    cache = caches.WindowKVCache(16, 5)
    for _ in range(100):
        cache.update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
    assert cache.keys.shape[2] == 16 + 5 - 1


def test_window_rewind_beyond_what_was_kept_raises():
    cache = caches.WindowKVCache(4, 2)
    for _ in range(10):
        cache.update_and_fetch(mx.ones((1, 1, 1, 2)), mx.ones((1, 1, 1, 2)))
    with pytest.raises(CacheError, match="cannot go back from 10 to 6"):
        caches.rewind([cache], 6)
    caches.rewind([cache], 8)  # two steps back are kept
    assert cache.offset == 8


def test_a_cache_that_refuses_to_trim_raises():
    class Stubborn(KVCache):
        def trim(self, n):
            return 0

    cache = [KVCache(), Stubborn()]
    for c in cache:
        c.update_and_fetch(mx.ones((1, 1, 3, 2)), mx.ones((1, 1, 3, 2)))
    with pytest.raises(CacheError, match="layer 1's Stubborn went back to 3 tokens, not 1"):
        caches.rewind(cache, 1)


def test_layers_that_disagree_on_their_length_raise():
    a, b = KVCache(), KVCache()
    a.update_and_fetch(mx.ones((1, 1, 3, 2)), mx.ones((1, 1, 3, 2)))
    b.update_and_fetch(mx.ones((1, 1, 2, 2)), mx.ones((1, 1, 2, 2)))
    with pytest.raises(CacheError, match="different lengths"):
        caches.length([a, b])


def test_recurrent_cache_rewinds_to_the_state_before_a_forward_and_no_further():
    cache = caches.RecurrentCache(2)
    with caches.forward([cache], 3):
        cache[0], cache[1] = mx.array([1.0]), mx.array([2.0])
    before = list(cache.cache)
    with caches.forward([cache], 1, rewindable=True):
        cache[0], cache[1] = mx.array([3.0]), mx.array([4.0])
    caches.rewind([cache], 3)
    assert cache.offset == 3 and all(a is b for a, b in zip(cache.cache, before, strict=True))
    with pytest.raises(CacheError, match="only the states since token 3 were kept"):
        caches.rewind([cache], 2)


def test_recurrent_rewind_into_a_forward_of_an_unknown_layer_raises():
    """A slot whose new value is neither a recorded recurrence's output nor a convolution
    window cannot be taken back to the middle of the forward."""
    cache = caches.RecurrentCache(1)
    with caches.forward([cache], 1):
        cache[0] = mx.zeros((1, 4))
    with caches.forward([cache], 3, rewindable=True):
        cache[0] = mx.ones((1, 4))
    with pytest.raises(CacheError, match="cannot tell how recurrent state slot 0"):
        caches.rewind([cache], 2)
