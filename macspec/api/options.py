"""The generation options, each defined once: name, default, check and help.

They are `stream_generate`'s and `generate`'s keywords, the flags of `macspec generate`,
`macspec chat` and `macspec serve`, and the fields the server's requests may set.
"""

from __future__ import annotations

import argparse
import inspect
import json
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..base.errors import OptionError
from ..core.logprobs import MAX_TOP
from ..core.sampling import SamplingOptions
from . import grammar as constraints


def _opt(default: Any, help: str, **cli: Any) -> Any:
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class GenerationOptions:
    max_tokens: int = _opt(256, "the most tokens to generate")
    temperature: float = _opt(0.0, "0 = greedy; higher = more random")
    top_p: float = _opt(1.0, "nucleus sampling: the smallest set of tokens with this probability")
    top_k: int = _opt(0, "sample among the k most likely tokens (0 = all)")
    min_p: float = _opt(0.0, "drop tokens less likely than min_p x the most likely one")
    repetition_penalty: float = _opt(1.0, "divide the logits of recent tokens by this (1 = off)")
    num_draft: int = _opt(4, "K: the most draft tokens a round (copied n-grams: up to 4 K)")
    tree_nodes: int = _opt(
        0, "draft token trees of up to this many candidates (depth K) where they pay; 0 = chains"
    )
    seed: int | None = _opt(None, "random seed (adaptive K follows timings: fix K to repeat)")
    stop: tuple[str, ...] = _opt((), "stop at this string (repeatable)", flag="--stop")
    speculative: bool = _opt(True, "decode plainly, with no drafts", flag="--no-speculation")
    adaptive: bool = _opt(
        True,
        "draft exactly K every round (default: K adapts to acceptance and measured speed)",
        flag="--no-adaptive",
    )
    grammar: str | None = _opt(
        None, "constrain the output to this grammar (a file: Lark or llama.cpp's GBNF)", file="text"
    )
    json_schema: dict | bool | None = _opt(
        None, "constrain the output to JSON valid under this schema (a file)", file="json"
    )
    top_logprobs: int | None = _opt(
        None,
        "report each token's log probability and its N most likely alternatives (0-20)",
        flag=None,
    )

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> OptionError:
            return OptionError(f"invalid {name}={getattr(self, name)!r}: {rule}")

        for name in ("max_tokens", "num_draft"):
            check_count(name, getattr(self, name), 1)
        nodes = self.tree_nodes
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 0 <= nodes <= 16:
            raise bad("tree_nodes", "must be an integer from 0 (chains) to 16")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise bad("seed", "must be an integer")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        for s in stop:
            if not isinstance(s, str) or not s:
                raise OptionError(f"invalid stop={s!r}: stop strings must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        top = self.top_logprobs
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
            raise bad("top_logprobs", f"must be an integer from 0 to {MAX_TOP}")
        if top is not None and not 0 <= top <= MAX_TOP:
            raise bad("top_logprobs", f"must be an integer from 0 to {MAX_TOP}")
        for name in ("speculative", "adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        _ = self.sampling  # SamplingOptions checks temperature, top_p, top_k, min_p, penalty
        spec = self.constraint
        if spec is not None:
            spec.compile()  # an invalid or unsupported schema or grammar fails here, named
            if spec.kind == "json_schema":
                object.__setattr__(self, "json_schema", json.loads(spec.text))

    @property
    def sampling(self) -> SamplingOptions:
        return SamplingOptions(
            self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty
        )

    @property
    def constraint(self) -> constraints.Spec | None:
        """The grammar or JSON schema the output must follow (None: unconstrained)."""
        return constraints.spec_of(self.grammar, self.json_schema)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> GenerationOptions:
        unknown = set(kwargs) - set(NAMES)
        if unknown:
            raise OptionError(
                f"unknown option(s) {', '.join(sorted(unknown))}; the options are "
                f"{', '.join(NAMES)}"
            )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_count(name: str, value: Any, least: int) -> None:
    """An OptionError unless `value` is an integer (not a bool) >= `least`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise OptionError(f"invalid {name}={value!r}: must be an integer >= {least}")


NAMES = tuple(f.name for f in fields(GenerationOptions))
# Options of the API and the server only (no command shows what they report).
API_ONLY = tuple(f.name for f in fields(GenerationOptions) if f.metadata.get("flag", "") is None)
DEFAULTS = GenerationOptions()
HINTS = typing.get_type_hints(GenerationOptions)


def _types(hint: Any) -> tuple:
    return typing.get_args(hint) or (hint,)


def signature(prefix: list[inspect.Parameter]) -> inspect.Signature:
    """A function's signature with the options as keyword arguments (for help() and IDEs)."""
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(f.name, kw, default=f.default) for f in fields(GenerationOptions)]
    return inspect.Signature([*prefix, *params])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per option (--max-tokens for max_tokens). Unset flags stay None, so that the
    default is the options' own (the help shows it)."""
    for f in fields(GenerationOptions):
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        if flag is None:  # an API and server option only: no command shows it
            continue
        help_text = f.metadata["help"]
        if isinstance(f.default, bool):
            parser.add_argument(
                flag, dest=f.name, action="store_false", default=None, help=help_text
            )
        elif f.name == "stop":
            parser.add_argument(flag, dest=f.name, action="append", default=None, help=help_text)
        elif "file" in f.metadata:
            read = _read_json if f.metadata["file"] == "json" else _read_text
            parser.add_argument(
                flag, dest=f.name, type=read, default=None, metavar="FILE", help=help_text
            )
        else:
            kind = next(t for t in (int, float) if t in _types(HINTS[f.name]))
            default = "" if f.default is None else f" (default {f.default})"
            parser.add_argument(
                flag, dest=f.name, type=kind, default=None, help=help_text + default
            )


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e}") from None


def _read_json(path: str) -> object:
    try:
        return json.loads(_read_text(path))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{path} is not JSON: {e}") from None


def from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options a command line set (unset ones are left to their defaults)."""
    return {name: getattr(args, name) for name in NAMES if getattr(args, name, None) is not None}
