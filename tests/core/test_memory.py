"""Metal hygiene (core/memory.py), as mlx-lm's generate.py does it: a generation runs inside
mlx-lm's wired_limit, and MLX's buffer cache is emptied every CLEAR_EVERY tokens on a GPU. On the
CPU backend both do nothing."""

from contextlib import contextmanager

import mlx.core as mx
import pytest

import macspec
from macspec.core import memory

pytestmark = pytest.mark.skipif(not mx.default_device() == mx.cpu, reason="the CPU backend's case")


def test_a_generation_runs_inside_the_wired_limit(pair, monkeypatch):
    events = []
    real = memory.wired_limit

    @contextmanager
    def spy(model):
        events.append(("enter", model is pair.target))
        try:
            with real(model):
                yield
        finally:  # a stream closes its generator at the last round
            events.append(("exit",))

    monkeypatch.setattr(memory, "wired_limit", spy)
    stream = macspec.stream_generate(pair, [5, 9, 14], max_tokens=8, seed=0)
    first = next(stream)
    assert events == [("enter", True)] and first.emitted
    rest = list(stream)
    assert events == [("enter", True), ("exit",)]
    assert sum(len(e.emitted) for e in [first, *rest]) == 8


def test_on_the_cpu_the_wired_limit_sets_nothing(monkeypatch):
    def refuse(*args):
        raise AssertionError("the wired limit was set on the CPU backend")

    monkeypatch.setattr(mx, "set_wired_limit", refuse)
    with memory.wired_limit(None):
        pass
    assert not memory.on_gpu()


def test_the_buffer_cache_is_emptied_every_so_many_tokens_on_a_gpu_only(monkeypatch, pair):
    calls = []
    monkeypatch.setattr(mx, "clear_cache", lambda: calls.append(1))
    gpu = memory.CacheClearing(gpu=True, every=4)
    for generated, cleared in ((3, 0), (5, 1), (7, 1), (8, 2), (20, 3), (21, 3)):
        gpu.after(generated)
        assert len(calls) == cleared, generated
    cpu = memory.CacheClearing()  # the default device here: the CPU
    cpu.after(10**6)
    memory.clear_on_gpu()
    macspec.generate(pair, [5, 9, 14], max_tokens=4, seed=0)
    assert len(calls) == 3
