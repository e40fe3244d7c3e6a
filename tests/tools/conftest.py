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
