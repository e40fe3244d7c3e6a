"""Tool calls: OpenAI's `tools` and `tool_choice` checked, the target's own tool-call output found
in its text (per template family), streamed as calls once each is complete, and the constraint
that makes a call certain ("required" or a named function).

The families and what their templates teach the model to write:
  hermes   Qwen 2.5 / Qwen 3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
           (Qwen2.5-Coder also fences it as ```json, or writes it bare as the whole answer)
  llama3   Llama 3.1-3.3: {"name": ..., "parameters": {...}}, the whole answer, maybe after
           <|python_tag|>
  mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}] (Nemo) or
           [TOOL_CALLS]name[ARGS]{...} (Small 3.2, Devstral)
  gemma    Gemma 4: <|tool_call>call:name{key:<|"|>text<|"|>,n:1}<tool_call|>
Parsing is written here: the serving stacks that do it (vLLM, llama.cpp) are not libraries one
can call from Python.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from ..base.errors import OptionError
from .grammar import Spec, json_schema_text

FAMILIES = ("hermes", "llama3", "mistral", "gemma")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names


class ToolError(OptionError):
    """A bad `tools` / `tool_choice` / tool message; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI gives it

    def openai(self, index: int) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": index, "id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class Choice:
    mode: str  # "none", "auto" or "required" (a named function is "required" with `name`)
    name: str | None = None


# ---------------------------------------------------------------- checking requests


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's tools, checked (each parameters schema compiled); ToolError naming the field."""
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(f"{where}.function must be an object with a name", where + ".function")
        name = fn["name"]
        if not _NAME.match(name) or name in seen:
            what = "repeats a name" if name in seen else "must be 1-64 of a-z, A-Z, 0-9, _ . -"
            raise ToolError(f"{where}.function.name {name!r} {what}", where + ".function.name")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        param = where + ".function.parameters"
        try:
            Spec("json_schema", json_schema_text(params, param), param).compile()
        except OptionError as e:
            raise ToolError(str(e), param) from None
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{where}.function.description must be a string", where + ".function")
        # templates read the description unguarded (Hermes'): an absent one is empty
        function = {**fn, "description": description or "", "parameters": params}
        out.append({"type": "function", "function": function})
    return out


def check_choice(choice: Any, tools: list[dict[str, Any]]) -> Choice:
    """`tool_choice` against the tools; default "auto" with tools, "none" without."""
    if choice is None:
        return Choice("auto" if tools else "none")
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise ToolError("tool_choice 'required' needs tools", "tool_choice")
        return Choice(choice)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise ToolError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise ToolError(
            f"tool_choice names the function {name!r}, which is not in tools", "tool_choice"
        )
    return Choice("required", name)


# ---------------------------------------------------------------- the template's family


def family_of(template: str | None) -> str | None:
    """The tool-call family a chat template teaches, or None (the template takes no tools)."""
    if not template or "tools" not in template:
        return None
    if "<|tool_call>" in template or "<start_function_call>" in template:
        return "gemma"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters"' in template or "<|python_tag|>" in template:
        return "llama3"
    return None


def new_id(family: str | None) -> str:
    # Mistral's templates refuse ids that are not 9 letters or digits
    if family == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


# ---------------------------------------------------------------- parsing complete calls


def _call(family: str, name: Any, arguments: Any) -> ToolCall | None:
    if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
        return None
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(new_id(family), name, json.dumps(arguments, ensure_ascii=False))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_body(family: str, body: str) -> list[ToolCall] | None:
    """The calls in one marked-out body (between the family's markers), or None if it is not
    a well-formed call (its text then stays content)."""
    body = body.strip()
    if family == "hermes":
        obj = _json(body)
        if obj is None and body.startswith("{{") and body.endswith("}}"):
            obj = _json(body[1:-1])  # the template's example shows its braces doubled
        calls = [_call(family, obj.get("name"), obj.get("arguments", {}))] if _is(obj) else [None]
    elif family == "llama3":
        objs = [_json(part) for part in _split_top(body, ";")]
        calls = [
            _call(family, o.get("name"), o.get("parameters", o.get("arguments", {})))
            if _is(o)
            else None
            for o in objs
        ]
    elif family == "mistral":
        calls = _mistral(body)
    else:
        calls = [_gemma(body)]
    return None if not calls or any(c is None for c in calls) else calls


def _is(obj: Any) -> bool:
    return isinstance(obj, dict) and "name" in obj


def _split_top(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside JSON strings and brackets."""
    parts, depth, quoted, escaped, start = [], 0, False, False, 0
    for i, c in enumerate(text):
        if quoted:
            escaped, quoted = (not escaped and c == "\\"), quoted and (escaped or c != '"')
            continue
        if c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _mistral(body: str) -> list[ToolCall | None]:
    calls: list[ToolCall | None] = []
    for part in (p.strip() for p in body.split("[TOOL_CALLS]") if p.strip()):
        if part.startswith("["):  # Nemo: a JSON list of {"name", "arguments"}
            items = _json(part)
            if not isinstance(items, list) or not items:
                return [None]
            calls += [
                _call("mistral", o.get("name"), o.get("arguments", {})) if _is(o) else None
                for o in items
            ]
            continue
        # Small 3.x: name[ARGS]{...}, or name[CALL_ID]id[ARGS]{...}
        name, sep, args = part.partition("[ARGS]")
        name = name.split("[CALL_ID]")[0].strip()
        calls.append(_call("mistral", name, _json(args)) if sep and _NAME.match(name) else None)
    return calls


_GEMMA_STRING = re.compile(r"<\|\"\|>(.*?)<\|\"\|>|<escape>(.*?)<escape>", re.S)
_GEMMA_KEY = re.compile(r"([{,]\s*)([A-Za-z_][A-Za-z0-9_]*)\s*:")


def _gemma(body: str) -> ToolCall | None:
    """call:name{key:value,...}, strings between <|"|> (Gemma 4) or <escape> (FunctionGemma),
    keys bare: rewritten to JSON, strings first so that their text is never touched."""
    m = re.fullmatch(r"call:([A-Za-z0-9_.-]+)(\{.*\})", body, re.S)
    if m is None:
        return None
    strings: list[str] = []

    def keep(s: re.Match) -> str:
        strings.append(s.group(1) if s.group(1) is not None else s.group(2))
        return f"\x00{len(strings) - 1}\x00"

    text = _GEMMA_STRING.sub(keep, m.group(2))
    text = _GEMMA_KEY.sub(lambda k: f'{k.group(1)}"{k.group(2)}":', text)
    text = re.sub(r"\x00(\d+)\x00", lambda s: json.dumps(strings[int(s.group(1))]), text)
    return _call("gemma", m.group(1), _json(text))


# ---------------------------------------------------------------- streaming

# The markers that open a call, each with the one that closes it (None: the answer's end).
# Hermes-style models also fence a call as a code block (Qwen2.5-Coder does; llama.cpp reads it).
_MARKERS: dict[str, dict[str, str | None]] = {
    "hermes": {"<tool_call>": "</tool_call>", "```json": "```", "```xml": "```"},
    "llama3": {"<|python_tag|>": None},
    "mistral": {"[TOOL_CALLS]": None},
    "gemma": {"<|tool_call>": "<tool_call|>", "<start_function_call>": "<end_function_call>"},
}


class ToolCallStream:
    """The answer's text in, as it comes: content to show now and calls once complete. Text that
    may begin a call marker is held back, and so is trailing whitespace (released with what
    follows it; dropped before a call and when only calls follow)."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.markers = _MARKERS[family]
        self._end: str | None = None  # the marker that closes the open call
        self._opened = 0  # the length of the marker that opened it
        self._gap = ""  # whitespace between the content and the open call
        self.calls: list[ToolCall] = []
        self._held = ""  # content not yet released
        self._body: str | None = None  # inside a call: its text so far, start marker included
        self._begun = False  # content released (a bare JSON call must come first)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._body is not None:
            self._body += text
        else:
            self._held += text
        out, calls = "", []
        while True:
            if self._body is None:
                i = self._start()
                if i is None:
                    out += self._release()
                    break
                before = self._held[:i].rstrip()
                out, self._begun = out + before, self._begun or bool(before)
                # the whitespace before a call is dropped, unless it turns out to be no call
                self._gap, self._body, self._held = self._held[len(before) : i], self._held[i:], ""
            closed = self._close()
            if closed is None:
                break
            text, parsed = closed
            out, calls = out + ("" if parsed else self._gap + text), calls + (parsed or [])
        self.calls += calls
        return out, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the answer: an open call is parsed (or given back as text)."""
        out, calls = "", []
        if self._body is not None:
            parsed = parse_body(self.family, self._inside(self._body))
            out, calls = ("", parsed) if parsed else (self._gap + self._body, [])
            self._body = None
        rest, self._held = self._held, ""
        if not (self.calls or calls) or rest.strip():
            out += rest
        self.calls += calls
        return out, calls

    def _start(self) -> int | None:
        """Where the held text opens a call; also a bare { that begins the answer (Llama 3's
        format; Qwen2.5-Coder writes its calls so too)."""
        at = [(self._held.find(s), s) for s in self.markers if s in self._held]
        if not at and self.family in ("llama3", "hermes") and not self._begun:
            if self._held.lstrip().startswith("{"):
                at = [(self._held.index("{"), "")]
        if not at:
            return None
        i, start = min(at)
        self._end, self._opened = self.markers.get(start), len(start)
        return i

    def _close(self) -> tuple[str, list[ToolCall] | None] | None:
        """The call's text and its calls (None: not well formed) once its end marker is in."""
        if self._end is None:
            return None
        # looked for after the opening marker (a fence opens and closes alike)
        i = self._body.find(self._end, self._opened)
        if i < 0:
            return None
        text, self._held = self._body[: i + len(self._end)], self._body[i + len(self._end) :]
        self._body = None
        return text, parse_body(self.family, self._inside(text))

    def _inside(self, text: str) -> str:
        """A call's text less its markers (and a hermes call's tags inside a fence)."""
        start = next((s for s in self.markers if text.startswith(s)), "")
        text = text[len(start) :]
        if self._end and text.endswith(self._end):
            text = text[: -len(self._end)]
        if self.family == "hermes":
            text = text.strip().removeprefix("<tool_call>").removesuffix("</tool_call>")
        return text

    def _release(self) -> str:
        """Held content that cannot begin a marker, less trailing whitespace."""
        text = self._held
        keep = max(
            (n for s in self.markers for n in range(1, len(s)) if text.endswith(s[:n])), default=0
        )
        cut = len(text) - keep
        while cut > 0 and text[cut - 1].isspace():
            cut -= 1
        if self.family in ("llama3", "hermes") and not self._begun and not text[:cut].strip():
            cut = 0  # nothing but whitespace yet: the answer may still be a bare JSON call
        self._begun = self._begun or bool(text[:cut].strip())
        self._held = text[cut:]
        return text[:cut]


# ---------------------------------------------------------------- "required" as a constraint


CALL_WHITESPACE = {"whitespace_flexible": True, "whitespace_pattern": "[ \\n]{0,2}"}


def _call_schema(function: dict[str, Any], key: str) -> dict[str, Any]:
    """One call of `function` as a JSON object: its name and, under `key`, its arguments."""
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, key: function["parameters"]},
        "required": ["name", key],
        "additionalProperties": False,
    }


def required_spec(
    template: str,
    tools: list[dict[str, Any]],
    choice: Choice,
    specials: set[str],
    parallel: bool = True,
) -> Spec:
    """The constraint that makes the answer calls in the template's own format, their arguments
    valid under the function's schema: one or more, or exactly one when a function is named or
    `parallel` is false (as OpenAI's parallel_tool_calls; an unending series of calls is what a
    small model writes otherwise). `specials`: the tokenizer's special tokens (a marker that is
    one is matched as that token, not as text)."""
    many = parallel and choice.name is None
    family = family_of(template)
    named = [t for t in tools if choice.name in (None, t["function"]["name"])]
    key = "parameters" if family == "llama3" else "arguments"
    calls = [_call_schema(t["function"], key) for t in named]
    one_of = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # Bounded whitespace (templates write ", " and ": "): free whitespace lets a model pad.
    call = "%json " + json.dumps({**one_of, "x-guidance": CALL_WHITESPACE})

    def mark(text: str) -> str:
        return text if text in specials else json.dumps(text)

    if family == "hermes":
        one = f'{mark("<tool_call>")} "\\n" call "\\n" {mark("</tool_call>")}'
        more = ' ("\\n" one)*' if many else ""
        lark = f"start: one{more}\none: {one}\ncall: {call}"
    elif family == "llama3":
        lark = f"start: call\ncall: {call}"
    elif family == "mistral" and "[ARGS]" in template:
        alternatives = " | ".join(
            f"{json.dumps(t['function']['name'])} {mark('[ARGS]')} %json "
            + json.dumps(t["function"]["parameters"])
            for t in named
        )
        lark = f"start: ({mark('[TOOL_CALLS]')} call){'+' if many else ''}\ncall: {alternatives}"
    elif family == "mistral":
        for c in calls:  # Nemo's template writes each call's id back after its arguments
            c["properties"]["id"] = {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}
        items = calls[0] if len(calls) == 1 else {"anyOf": calls}
        bounds = {"minItems": 1} if many else {"minItems": 1, "maxItems": 1}
        listed = json.dumps({"type": "array", "items": items, **bounds})
        lark = f"start: {mark('[TOOL_CALLS]')} calls\ncalls: %json {listed}"
    else:
        raise ToolError(
            f"tool_choice {'naming a function' if choice.name else 'required'} is not supported "
            f"for this model's tool-call format ({family or 'none'})",
            "tool_choice",
        )
    return Spec("grammar", lark, "tool_choice")
