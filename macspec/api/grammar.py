"""Constraints on what a generation may say: a JSON schema or a grammar, as token masks.

The speculative core sees only the `Constraint` protocol (core/constraint.py: the ids a position
allows, after the committed ids and some drafts); it never imports the constraint library.
`Grammar` implements it with llguidance (the constraint engine of llama.cpp and vLLM).

Why llguidance rather than outlines-core: llguidance reads the tokenizer.json every pair already
has (GGUF conversions included) and takes any context-free grammar (Lark, or llama.cpp's GBNF), so
`{"type": "json_object"}` is exact JSON at any nesting depth; it computes each mask lazily in tens
of microseconds and rolls back. outlines-core compiles a regex to an automaton over the whole
vocabulary up front (15 s for "any JSON object" on a 49k vocabulary, nesting bounded), needs each
tokenizer's byte encoding rebuilt by hand, and takes no recursive grammar.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base.errors import ConstraintError, OptionError
from ..core.constraint import Constraint

__all__ = ["ANY_JSON_OBJECT", "Constraint", "Grammar", "Spec", "json_schema_text", "spec_of"]

log = logging.getLogger(__name__)

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Spec:
    """A constraint before it meets a tokenizer: `kind` "json_schema" (`text`: the schema as JSON)
    or "grammar" (Lark or GBNF text); `param`: the option or request field it came from."""

    kind: str
    text: str
    param: str

    def compile(self) -> str:
        """llguidance's grammar definition, checked: OptionError naming `param` if it is bad."""
        from llguidance import LLMatcher, grammar_from

        text = self.text
        if self.kind == "json_schema":
            text = _compact(text)
        try:
            definition = grammar_from(self.kind, text)
        except ValueError as e:
            raise OptionError(f"invalid {self.param}: {e}") from None
        error = " ".join(LLMatcher.validate_grammar(definition, None).split())  # one line
        if error:
            what = "schema" if self.kind == "json_schema" else "grammar"
            raise OptionError(f"invalid {self.param}: unsupported or invalid {what}: {error}")
        return definition


def _compact(schema_text: str) -> str:
    """The schema with JSON's whitespace fixed (", " and ": ", no newlines) unless it says
    otherwise ("x-guidance"): as OpenAI's structured output; free whitespace lets a model pad
    an answer until max_tokens (llama.cpp's JSON grammars bound it for the same reason)."""
    schema = json.loads(schema_text)
    if schema is True:
        schema = {}
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return json.dumps(schema)


def json_schema_text(schema: Any, param: str = "json_schema") -> str:
    """A JSON schema (dict, bool or JSON text) as JSON text; OptionError if it is none."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise OptionError(f"invalid {param}: not JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        kind = type(schema).__name__
        raise OptionError(f"invalid {param}: a JSON schema is an object, not a {kind}")
    try:
        return json.dumps(schema, allow_nan=False)  # key order kept: properties come in it
    except (TypeError, ValueError) as e:
        raise OptionError(f"invalid {param}: {e}") from None


def spec_of(grammar: str | None, json_schema: Any) -> Spec | None:
    """The Spec the generation options ask for (at most one of the two), unchecked."""
    if grammar is not None and json_schema is not None:
        raise OptionError("give grammar or json_schema, not both")
    if json_schema is not None:
        return Spec("json_schema", json_schema_text(json_schema), "json_schema")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise OptionError(f"invalid grammar={grammar!r}: must be a Lark or GBNF grammar's text")
        return Spec("grammar", grammar, "grammar")
    return None


# ---------------------------------------------------------------- tokenizers

# One LLTokenizer per tokenizer object: building one reads the whole vocabulary (1-2 s).
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: Any, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of a pair's tokenizer (mlx-lm's TokenizerWrapper or a HF fast tokenizer),
    with every id that ends a generation as its end-of-sequence ids."""
    import llguidance.hf
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
    key = (tuple(sorted(eos_ids)),)
    with _LOCK:
        per = _TOKENIZERS.setdefault(hf, {})
        if key not in per:
            try:
                per[key] = llguidance.hf.from_tokenizer(hf, eos_token=sorted(eos_ids))
            except ValueError as e:
                log.info("llguidance cannot read this tokenizer (%s): decoding its ids", e)
                ids = _DecodedIds(hf, sorted(eos_ids))
                wrapped = llguidance.TokenizerWrapper(ids)
                per[key] = llguidance.LLTokenizer(wrapped, eos_token=sorted(eos_ids) or None)
        return per[key]


class _DecodedIds:
    """A tokenizer as llguidance's TokenizerWrapper takes it, each id's bytes being its text
    decoded alone: for tokenizer.json kinds llguidance does not read (WordLevel, as the test
    models' characters), where no id holds part of a character, so decoding alone is exact."""

    def __init__(self, hf: Any, eos_ids: list[int]) -> None:
        self._hf = hf
        self.tokens = [hf.decode([i]).encode() for i in range(len(hf))]
        self.special_token_ids = list(hf.all_special_ids)
        self.eos_token_id = eos_ids[0] if eos_ids else hf.eos_token_id
        self.bos_token_id = hf.bos_token_id

    def __call__(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- the constraint


class Grammar:
    """A Spec applied to one tokenizer: llguidance's matcher holds the committed ids; masks for
    positions after drafts are computed by consuming the drafts and rolling them back, and kept
    until the committed ids move past them, so the draft's and the verification's masks of one
    position are computed once."""

    def __init__(self, spec: Spec, lltok: Any, vocab_size: int, stops: Sequence[int] = ()) -> None:
        from llguidance import LLMatcher

        self.spec, self.vocab_size = spec, vocab_size
        # Nothing follows a stop id: drafts after one are masked to the stops alone (those rows
        # are never part of the output, and p and q see the same mask).
        self.stops = frozenset(stops)
        self._after_stop = np.zeros(vocab_size, dtype=bool)
        self._after_stop[[i for i in self.stops if i < vocab_size]] = True
        self._matcher = LLMatcher(lltok, spec.compile(), log_level=0)
        if self._matcher.is_error():
            raise OptionError(f"invalid {spec.param}: {self._matcher.get_error()}")
        self._masks: dict[tuple[int, ...], np.ndarray] = {}
        self.committed = 0
        self.computed = 0  # masks computed (not taken from the cache), for statistics

    @classmethod
    def for_pair(cls, spec: Spec, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]):
        return cls(spec, ll_tokenizer(tokenizer, eos_ids), vocab_size, eos_ids)

    def allowed(self, prefix: Sequence[int] = ()) -> np.ndarray:
        key = tuple(prefix)
        if self.stops and not self.stops.isdisjoint(key):
            return self._after_stop
        mask = self._masks.get(key)
        if mask is None:
            mask = self._compute(key)
            self._masks[key] = mask
        return mask

    def _compute(self, prefix: tuple[int, ...]) -> np.ndarray:
        m = self._matcher
        taken = m.try_consume_tokens(list(prefix)) if prefix else 0
        try:
            if taken != len(prefix):
                raise ConstraintError(
                    f"{self.spec.param}: draft id {prefix[taken]} at position {taken} is not "
                    "allowed: cut proposals with valid_prefix() before asking for masks after them"
                )
            words = m.compute_bitmask()
        finally:
            if taken:
                m.rollback(taken)
        self.computed += 1
        bits = np.unpackbits(np.frombuffer(words, dtype=np.uint8), bitorder="little")
        mask = np.zeros(self.vocab_size, dtype=bool)
        n = min(self.vocab_size, bits.size)
        mask[:n] = bits[:n]
        if not mask.any():
            raise ConstraintError(f"{self.spec.param}: no token is allowed ({self._state()})")
        return mask

    def valid_prefix(self, ids: Sequence[int]) -> int:
        return self._matcher.validate_tokens(list(ids)) if ids else 0

    def commit(self, ids: Sequence[int]) -> None:
        ids = list(ids)
        if not ids:
            return
        if not self._matcher.consume_tokens(ids):
            raise ConstraintError(
                f"{self.spec.param}: ids {ids} break the constraint ({self._state()})"
            )
        self.committed += len(ids)
        n = len(ids)
        # Masks after the committed ids stay valid, re-keyed from the new state.
        self._masks = {k[n:]: v for k, v in self._masks.items() if k[:n] == tuple(ids)}

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.committed or (n and not self._matcher.rollback(n)):
            raise ConstraintError(
                f"{self.spec.param}: cannot take back {n} of {self.committed} ids"
            )
        self.committed -= n
        self._masks = {}

    def accepting(self) -> bool:
        return self._matcher.is_accepting()

    def done(self) -> bool:
        return self._matcher.is_stopped()

    def _state(self) -> str:
        return self._matcher.get_error() or f"stop reason {self._matcher.stop_reason()}"
