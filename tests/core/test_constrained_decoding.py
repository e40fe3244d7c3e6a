"""Constrained decoding through the core (core/constraint.py, verify.make_dist): the mask of each
position applies to the target's p and the draft's q alike, copied proposals are cut where the
grammar forbids them, and the state follows the committed ids.

Greedy: speculative equals plain constrained decoding token for token, for every drafter. T=1:
the first ids are distributed as the target's own masked sampling (chi-square against the
enumerated distribution), and a rule that divides by the unmasked q is shown to fail."""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from support.exactness import chi_square
from support.tinymodels import DEFAULT_CHARS, make_tiny_model

import macspec
from macspec.api.grammar import Grammar, Spec
from macspec.core.drafters.base import Proposal
from macspec.core.drafters.model import ModelDrafter
from macspec.core.sampling import Distribution, SamplingOptions, distribution

JSON_CHARS = DEFAULT_CHARS + '{}[]":-'
SCHEMAS = [
    {"type": "object"},
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["yes", "no"]}, "minItems": 1, "maxItems": 3},
]


@pytest.fixture(scope="module")
def json_dirs(tmp_path_factory):
    """A target over characters JSON needs, and a noisy copy of it as the draft."""
    root = tmp_path_factory.mktemp("json")
    kw = {"hidden": 48, "tie": False, "chars": JSON_CHARS}
    return make_tiny_model(root / "t", seed=0, **kw), make_tiny_model(
        root / "d", seed=0, perturb=0.3, **kw
    )


@pytest.fixture(scope="module", params=["model+ngram", "model", "ngram"])
def json_pair(request, json_dirs):
    if request.param == "ngram":
        return macspec.load(json_dirs[0], drafter="ngram")
    drafter = None if request.param == "model+ngram" else request.param
    return macspec.load(*json_dirs, drafter=drafter)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "person", "array"])
def test_greedy_speculation_equals_plain_constrained_decoding(json_pair, schema):
    kw = {"json_schema": schema, "max_tokens": 48, "num_draft": 3}
    for prompt in ("the answer is", "name age"):
        spec = macspec.generate(json_pair, prompt, adaptive=False, **kw)
        plain = macspec.generate(json_pair, prompt, speculative=False, **kw)
        assert spec.tokens == plain.tokens and spec.finish_reason == plain.finish_reason
        if spec.finish_reason == "stop":
            jsonschema.validate(json.loads(spec.text), schema)
        else:  # never an unfinished answer claimed complete
            assert spec.finish_reason == "length" and len(spec.tokens) == 48


@pytest.mark.parametrize("schema", SCHEMAS[1:], ids=["person", "array"])
def test_greedy_token_trees_equal_plain_constrained_decoding(json_dirs, schema):
    pair = macspec.load(*json_dirs, drafter="model")
    kw = {"json_schema": schema, "max_tokens": 48, "num_draft": 3}
    events = list(macspec.stream_generate(pair, "name age", adaptive=False, tree_nodes=6, **kw))
    plain = macspec.generate(pair, "name age", speculative=False, **kw)
    assert [t for ev in events for t in ev.emitted] == plain.tokens
    assert any(ev.rows > ev.num_draft + 1 for ev in events)  # trees: more rows than a chain


def test_every_sampled_answer_parses_and_validates(json_dirs):
    pair = macspec.load(*json_dirs)
    schema = SCHEMAS[1]
    finished = 0
    for seed in range(12):
        r = macspec.generate(
            pair, "who", json_schema=schema, temperature=1.0, seed=seed, max_tokens=64
        )
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), schema)
            finished += 1
        else:  # cut by max_tokens: unfinished, or finished with no room left for the stop
            assert r.finish_reason == "length" and len(r.tokens) == 64
            try:
                jsonschema.validate(json.loads(r.text), schema)
            except json.JSONDecodeError:
                pass
    assert finished >= 6  # most answers finish: the test checks real JSON


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(json_dirs):
    pair = macspec.load(*json_dirs)
    r = macspec.generate(pair, "x", grammar='start: "aaaaaaaaaa"', max_tokens=4)
    assert r.finish_reason == "length" and r.text == "aaaa"
    r = macspec.generate(pair, "x", grammar='start: "aaaa"', max_tokens=10)
    assert r.finish_reason == "stop" and r.text == "aaaa"


def test_a_copied_proposal_is_cut_where_the_grammar_forbids_it(json_dirs):
    """The prompt repeats 'abab', so the n-gram drafter copies it; the grammar allows 'aba'
    then only 'c's: copies are cut, and the output is plain decoding's."""
    pair = macspec.load(json_dirs[0], drafter="ngram")
    kw = {"grammar": "start: /abac+/", "max_tokens": 12, "num_draft": 4}
    spec = macspec.generate(pair, "abababababababab", adaptive=False, **kw)
    plain = macspec.generate(pair, "abababababababab", speculative=False, **kw)
    assert spec.tokens == plain.tokens and spec.text.startswith("abac")
    assert spec.stats.drafted < 4 * spec.stats.rounds  # some proposals were cut


# ------------------------------------------------------------- the distribution at T = 1

GRAMMAR = "start: /[ab][bc][ab][cd][a-d]*/"
DEPTH = 4
SAMPLES = 500


def exact_masked(pair, prompt: list[int], grammar: Grammar) -> dict[tuple, float]:
    """P(x_1..x_DEPTH) under the target's own sampling at T=1 with the grammar's masks."""
    opts = SamplingOptions(temperature=1.0)
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(DEPTH):
        nxt = {}
        for p, v in probs.items():
            logits = pair.target(mx.array([prompt + list(p)]))[:, -1, : pair.vocab_size]
            logits = mx.where(mx.array(grammar.allowed(list(p)))[None], logits, -mx.inf)
            row = np.array(distribution(logits, opts)[0])
            for t in np.nonzero(row > 0)[0]:
                nxt[p + (int(t),)] = v * float(row[t])
        probs = nxt
    return probs


def unmasked_ratio(monkeypatch):
    """The broken rule: drafts drawn from the masked q, but the acceptance ratio and the
    residual use the draft's unmasked q (the mask applied to p only in the rule)."""
    real = ModelDrafter.propose

    def propose(self, k, dist, key):
        raw = []

        class Spy(Distribution):
            def probs(self, logits, extra, first_row, columns=None):
                raw.append(distribution(logits, SamplingOptions(temperature=1.0)))
                return super().probs(logits, extra, first_row, columns)

        got = real(self, k, Spy(dist.options, dist.history, dist.constraint), key)
        return Proposal(got.tokens, mx.concatenate(raw))

    monkeypatch.setattr(ModelDrafter, "propose", propose)


@pytest.mark.parametrize(
    "broken, trees", [(False, 0), (False, 4), (True, 0)], ids=["chains", "trees", "broken"]
)
def test_output_is_the_targets_masked_distribution_at_t1(small_pair, monkeypatch, broken, trees):
    """`broken`: the rule with the unmasked q; `trees`: token trees of up to that many nodes."""
    prompt = [3, 4, 5]
    eos = sorted(small_pair.eos_token_ids)
    spec = Spec("grammar", GRAMMAR, "grammar")
    expected = exact_masked(
        small_pair, prompt, Grammar.for_pair(spec, small_pair.tokenizer, small_pair.vocab_size, eos)
    )
    if broken:
        unmasked_ratio(monkeypatch)
    counts: Counter = Counter()
    for seed in range(SAMPLES):
        r = macspec.generate(
            small_pair,
            prompt,
            grammar=GRAMMAR,
            max_tokens=DEPTH,
            seed=seed,
            temperature=1.0,
            num_draft=3,
            adaptive=False,
            tree_nodes=trees,
        )
        counts[tuple(r.tokens)] += 1
    p = chi_square(expected, counts)
    if broken:
        assert p < 1e-4
    else:
        assert p > 1e-3


# ------------------------------------------------------------- a drafter with fewer ids


@pytest.fixture(scope="module")
def eagle_pair(tmp_path_factory):
    """An EAGLE draft lacking every fifth id (among them 'a', 'f' and 'k'), chains only."""
    from support.drafts import make_draft

    root = tmp_path_factory.mktemp("eagle_json")
    target = make_tiny_model(root / "target", seed=0, hidden=48, tie=False, scale=2.0)
    vocab = [i for i in range(66) if i % 5 != 4]
    return macspec.load(target, make_draft(root / "draft", target, vocab_ids=vocab))


def test_a_drafter_without_the_allowed_ids_is_cut_not_wrong(eagle_pair):
    """Where the grammar allows only ids the EAGLE draft lacks, the draft stops there; greedy
    answers equal plain constrained decoding and sampled ones follow the grammar."""
    grammar = "start: /([afk][a-z])+/"
    kw = {"grammar": grammar, "max_tokens": 24, "num_draft": 3}
    for prompt in ("ab ab ab", "fk fk"):
        spec = macspec.generate(eagle_pair, prompt, adaptive=False, **kw)
        plain = macspec.generate(eagle_pair, prompt, speculative=False, **kw)
        assert spec.tokens == plain.tokens and spec.stats.drafted > 0
    for seed in range(6):
        r = macspec.generate(eagle_pair, "ab", temperature=1.0, seed=seed, **kw)
        assert all(c in "afk" for c in r.text[::2]) and r.text.isalpha()
        assert len(r.tokens) % 2 == 0 if r.finish_reason == "stop" else len(r.tokens) == 24
