"""OpenAI's request and response shapes: a request body checked field by field into the generation
options (macspec/api/options.py), and the answers, chunks, usage and error objects built from
RoundEvents and GenerationStats."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..api import chat_template, tool_calls
from ..api.options import NAMES, GenerationOptions
from ..api.stream import GenerationStats
from ..api.tool_calls import Choice, ToolCall
from ..base.errors import MacspecError, OptionError, PromptError
from .logprobs import MAX_TOP


class HTTPError(MacspecError):
    """A request the server answers with an OpenAI-style error object and this status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind


def error_body(e: BaseException) -> tuple[int, dict[str, Any]]:
    """(status, {"error": {...}}) for any exception: the one place errors become HTTP."""
    if isinstance(e, HTTPError):
        status, param, code, kind = e.status, e.param, e.code, e.kind
    elif isinstance(e, OptionError):  # a ToolError names its field
        status, param, code = 400, getattr(e, "param", None), "invalid_value"
        kind = "invalid_request_error"
    elif isinstance(e, PromptError):
        code = "context_length_exceeded" if "context" in str(e) else "invalid_prompt"
        status, param, kind = 400, "messages", "invalid_request_error"
    elif isinstance(e, MacspecError):
        status, param, code, kind = 500, None, type(e).__name__, "server_error"
    else:
        status, param, code, kind = 500, None, "internal_error", "server_error"
    message = str(e) if isinstance(e, MacspecError) else f"{type(e).__name__}: {e}"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def parse_json(body: bytes) -> dict[str, Any]:
    def no_constant(name: str) -> None:  # NaN and Infinity are not JSON
        raise ValueError(f"{name} is not valid JSON")

    try:
        data = json.loads(body, parse_constant=no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise HTTPError("the request body must be a JSON object", code="invalid_json")
    return data


# Fields OpenAI defines that the server accepts only at their "off" value.
_OFF = {
    "n": (1,),
    "best_of": (1,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "echo": (False,),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
}
# Fields a request may set, under OpenAI's names, mapped onto GenerationOptions.
_ALIASES = {"max_completion_tokens": "max_tokens"}
ROLES = {"system", "user", "assistant", "developer", "tool"}


@dataclass
class Request:
    endpoint: str  # "chat" or "completion"
    model: str | None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    # llama.cpp's server's `return_progress`: a streamed answer's chunks tell the prompt's
    # reading as it goes (prompt_progress), so a client can show it and knows the server lives
    progress: bool = False
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Choice = Choice("none")
    parallel_tool_calls: bool = True  # false: a required call is exactly one
    logprobs: int | None = None  # top ids to report with each token's logprob; None: off


def parse_request(data: dict[str, Any], endpoint: str, defaults: dict[str, Any]) -> Request:
    """A checked Request from a JSON body; HTTPError names the first bad field."""
    for name, allowed in _OFF.items():
        if data.get(name) is not None and data[name] not in allowed:
            raise HTTPError(
                f"{name}={data[name]!r} is not supported by this server",
                param=name,
                code="unsupported",
            )
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise HTTPError("model must be a string", param="model")
    req = Request(endpoint, model)
    req.stream = _flag(data, "stream")
    req.progress = _flag(data, "return_progress")
    stream_options = data.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise HTTPError("stream_options must be an object", param="stream_options")
        req.include_usage = _flag(stream_options, "include_usage", "stream_options.include_usage")
    if endpoint == "chat":
        req.messages = _messages(data.get("messages"))
    else:
        req.prompt = _prompt(data.get("prompt"))
    req.options = {**defaults, **_options(data)}
    _response_format(data.get("response_format"), req.options)
    _tools(data, req)
    req.logprobs = _logprobs(data, endpoint)
    req.options.pop("top_logprobs", None)  # the body's own field, read by _logprobs
    if req.logprobs is not None:
        req.options["top_logprobs"] = req.logprobs
    return req


def _response_format(fmt: Any, options: dict[str, Any]) -> None:
    """response_format as the json_schema option (json_object: any JSON object)."""
    if fmt is None or fmt == {"type": "text"}:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        inner = fmt.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise HTTPError(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                param="response_format",
            )
    else:
        raise HTTPError(
            "response_format type must be 'text', 'json_object' or 'json_schema'",
            param="response_format",
        )
    if options.get("grammar") is not None:
        raise HTTPError("give response_format or grammar, not both", param="response_format")
    try:
        GenerationOptions.from_kwargs(json_schema=schema)
    except OptionError as e:
        raise HTTPError(str(e), param="response_format", code="invalid_value") from None
    options["json_schema"] = schema


def _tools(data: dict[str, Any], req: Request) -> None:
    tools, choice = data.get("tools"), data.get("tool_choice")
    if req.endpoint == "completion" and (tools or choice is not None):
        raise HTTPError("tools are for /v1/chat/completions", param="tools")
    try:
        req.tools = tool_calls.check_tools(tools) if tools is not None else []
        req.tool_choice = tool_calls.check_choice(choice, req.tools)
        if data.get("parallel_tool_calls") is not None:
            req.parallel_tool_calls = _flag(data, "parallel_tool_calls")
    except tool_calls.ToolError as e:
        raise HTTPError(str(e), param=e.param, code="invalid_value") from None
    if req.tool_choice.mode == "required" and req.options.get("json_schema") is not None:
        raise HTTPError("a required tool call and a JSON answer exclude each other", "tool_choice")


def _logprobs(data: dict[str, Any], endpoint: str) -> int | None:
    """How many top ids to report per token (0: only the token's own logprob); None: off."""
    if endpoint == "completion":  # the legacy field is the count itself
        top = data.get("logprobs")
        param = "logprobs"
    else:
        if not _flag(data, "logprobs"):
            if data.get("top_logprobs") not in (None, 0):
                raise HTTPError("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        top, param = data.get("top_logprobs") or 0, "top_logprobs"
    if top is None:
        return None
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP:
        raise HTTPError(f"{param} must be an integer from 0 to {MAX_TOP}", param=param)
    return top


def _flag(data: dict, name: str, param: str | None = None) -> bool:
    value = data.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HTTPError(f"{param or name} must be true or false", param=param or name)
    return value


def _options(data: dict[str, Any]) -> dict[str, Any]:
    """The generation options a body sets, each checked alone so that the error names it."""
    out: dict[str, Any] = {}
    for name in (*NAMES, *_ALIASES):
        if data.get(name) is None:
            continue
        value, option = data[name], _ALIASES.get(name, name)
        if option == "stop":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise HTTPError("stop must be a string or a list of strings", param=name)
        try:
            GenerationOptions.from_kwargs(**{option: value})
        except OptionError as e:
            raise HTTPError(str(e), param=name, code="invalid_value") from None
        out[option] = value
    return out


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise HTTPError("messages must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise HTTPError(f"{where} must be an object with role and content", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise HTTPError(f"{where}.role must be one of {', '.join(sorted(ROLES))}", param=where)
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise HTTPError(f"{where}.content: only text parts are supported", param=where)
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise HTTPError(f"{where}.content must be a string", param=where)
        # "developer" is OpenAI's newer name for system; chat templates know system
        message = {"role": "system" if role == "developer" else role, "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                message[key] = m[key]
        try:  # tool calls as templates read them (arguments as mappings), checked
            out += chat_template.check_messages([message])
        except PromptError as e:
            raise HTTPError(f"{where}: {e}".replace("messages[0]", "it"), param=where) from None
    return out


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return prompt
    raise HTTPError(
        "prompt must be a non-empty string or list of token ids (one prompt)", param="prompt"
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---------------------------------------------------------------- answers


def new_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


FINISH = {"stop": "stop", "stop_string": "stop", "length": "length", "context": "length"}


def finish_reason(reason: str | None) -> str:
    """OpenAI's finish_reason; an answer cut short (a shutdown) counts as "length"."""
    return FINISH.get(reason or "", "length")


def usage(stats: GenerationStats | None, prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's usage, with the speculative decoding that made the answer."""
    if stats is None:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "total_tokens": prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
    plain = 1 / stats.plain_step_time if stats.plain_step_time else None
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "speculative": {
            "rounds": stats.rounds,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "tokens_per_second": round(stats.tokens_per_second, 2),
            "plain_tokens_per_second": round(plain, 2) if plain else None,
            "speedup": round(stats.speedup, 3) if stats.speedup else None,
            "prefill_seconds": round(stats.prefill_time, 4),
        },
    }


def answer(
    req: Request,
    rid: str,
    model: str,
    text: str,
    reason: str,
    use: dict,
    calls: Sequence[ToolCall] = (),
    logprobs: dict | None = None,
) -> dict:
    """The whole (non-streamed) answer; `logprobs`: the choice's, already in OpenAI's shape."""
    head = {"id": rid, "created": int(time.time()), "model": model, "usage": use}
    if req.endpoint == "chat":
        message: dict[str, Any] = {
            "role": "assistant",
            "content": (text or None) if calls else text,
        }
        if calls:
            message["tool_calls"] = [c.openai(i) for i, c in enumerate(calls)]
        reason = "tool_calls" if calls and reason == "stop" else reason
        choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs}
        return {**head, "object": "chat.completion", "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
    return {**head, "object": "text_completion", "choices": [choice]}


def chunk(
    req: Request,
    rid: str,
    model: str,
    created: int,
    text: str | None,
    reason: str | None = None,
    use: dict | None = None,
    extra: dict | None = None,
    calls: Sequence[tuple[int, ToolCall]] = (),
    logprobs: dict | None = None,
    progress: dict | None = None,
) -> bytes:
    """One server-sent event: a text delta (and tool calls complete in it, with their index in
    the answer), the finish, or (choices empty) the usage. `extra`: this round's drafts
    (drafted, accepted), under "macspec"; `progress` (text None): how far the prompt is read,
    under "prompt_progress" as llama.cpp's server sends it (prompt_progress())."""
    head: dict[str, Any] = {"id": rid, "created": created, "model": model}
    if req.endpoint == "chat":
        head["object"] = "chat.completion.chunk"
        delta: dict[str, Any] = {} if text is None else {"content": text}
        if text == "" and reason is None and not calls:  # the first chunk names the role
            delta["role"] = "assistant"
        if calls:
            delta["tool_calls"] = [c.openai(i) for i, c in calls]
        choices = [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}]
    else:
        head["object"] = "text_completion"
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        choices = [choice]
    if use is not None:
        choices = []
    body = {**head, "choices": choices}
    if req.include_usage:
        body["usage"] = use
    if extra is not None:
        body["macspec"] = extra
    if progress is not None:
        body["prompt_progress"] = progress
    return sse(body)


def prompt_progress(processed: int, total: int, cached: int, seconds: float) -> dict[str, int]:
    """llama.cpp's prompt_progress: the prompt's ids (total), those its cache held (cache),
    those held so far, cached ones included (processed), and the milliseconds spent reading."""
    return {
        "total": total,
        "cache": cached,
        "processed": processed,
        "time_ms": round(seconds * 1000),
    }


def sse(body: Any) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
