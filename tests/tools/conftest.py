"""Fixtures shared by the tools' tests."""

import pytest
from support.tinymodels import make_tiny_model


@pytest.fixture(scope="module")
def same_pair(tmp_path_factory):
    """Draft == target: at temperature 0 every draft must be accepted."""
    root = tmp_path_factory.mktemp("bench")
    target = make_tiny_model(root / "t", seed=5, hidden=48, context=2048)
    draft = make_tiny_model(root / "d", seed=5, hidden=48, context=2048)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def gguf_target(tmp_path_factory):
    """A tiny BPE target as a GGUF file and as the store model converted from it."""
    from support.gguf_helpers import hf_to_gguf, make_bpe_model

    from macspec.models.convert import convert

    root = tmp_path_factory.mktemp("peer")
    gguf = root / "target.gguf"
    hf_to_gguf(make_bpe_model(root / "src", seed=4, context=2048), gguf, "f32")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MACSPEC_HOME", str(root / "home"))
        target = convert(str(gguf), output="peer", dtype="float32")
    return str(target), str(gguf)
