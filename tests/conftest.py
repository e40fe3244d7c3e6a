import macspec  # noqa: I001  first, so that it loads OpenBLAS before anything imports mlx
import os

import pytest
from support.tinymodels import make_tiny_model

from macspec import cpu

# The CPU package's hooks in the core for every test, as macspec.load() installs them: many
# tests build models through mlx-lm and run the core's functions on them without a load.
cpu.install()

# Every load measures its own costs: long-context costs kept on disk (core/measure.py) would
# stand in for the ones a test sets, and fill the user's cache with tiny models' entries.
os.environ["MACSPEC_KEEP_COSTS"] = "0"

SMALL = "abcd"  # a 7-id vocabulary (3 specials + 4 chars) for distribution tests


@pytest.fixture(scope="session")
def chat_dirs(tmp_path_factory):
    """A target with a 2,048-token context and an unrelated draft (the chat and server tests:
    each loads its own pair, so prompt caches and policies stay apart)."""
    root = tmp_path_factory.mktemp("chat")
    target = make_tiny_model(root / "target", seed=0, context=2048)
    draft = make_tiny_model(root / "draft", seed=1)
    return target, draft


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """A random target and a noisy copy of it as the draft: they agree part of the time."""
    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_model(root / "target", seed=0, hidden=48, tie=False)
    draft = make_tiny_model(root / "draft", seed=0, hidden=48, tie=False, perturb=0.3)
    return target, draft


@pytest.fixture(scope="session")
def pair(tiny_dirs):
    return macspec.load(*tiny_dirs)


@pytest.fixture(scope="session")
def small_pair(tmp_path_factory):
    """Target and draft over a 7-token vocabulary, with distributions that clearly differ."""
    root = tmp_path_factory.mktemp("small")
    kw = {"chars": SMALL, "scale": 8.0, "vocab_rows": 9, "tie": False}
    target = make_tiny_model(root / "target", seed=3, **kw)
    draft = make_tiny_model(root / "draft", seed=3, perturb=0.2, **kw)
    p = macspec.load(target, draft)
    p.eos_token_ids = frozenset()  # every sequence has the full length: simpler exact tables
    return p


@pytest.fixture
def float32_kv(monkeypatch):
    """The CPU layers' KV caches in float32 (MACSPEC_KV_CACHE=float32): for tests that hold the
    kernels to mlx-lm's own numbers, which keep float32 caches (tests/cpu/test_kv_half.py holds
    the float16 caches, the default, to those)."""
    import mlx.core as mx

    from macspec.cpu.state import STATE

    monkeypatch.setattr(STATE, "kv_dtype", mx.float32)


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the native layer primitives the switched layers call, by name."""
    from collections import Counter

    from macspec.cpu import kernels, native

    ext, calls = native.load(), Counter()

    class Spy:
        def __getattr__(self, name):
            def call(*args, **kwargs):
                calls[name] += 1
                return getattr(ext, name)(*args, **kwargs)

            return call

    real = kernels.native_layers
    monkeypatch.setattr(kernels, "native_layers", lambda: Spy() if real() is not None else None)
    return calls
