"""A conversation as the target's prompt: its chat template applied, ready for the answer.

One function for every front end (the API's `messages=`, `macspec generate`, the chat, the
server), so that the same conversation always becomes the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..base.errors import PromptError
from .tool_calls import ToolError

ROLES = ("system", "user", "assistant", "tool", "developer")


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as plain dicts, or PromptError naming the first bad one. An assistant message
    may carry OpenAI's `tool_calls` (its content then may be None), a tool message its
    `tool_call_id` and `name`."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise PromptError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise PromptError(f"messages[{i}] must be a dict with 'role' and 'content', not {m!r}")
        if m["role"] not in ROLES:
            raise PromptError(f"messages[{i}] has role {m['role']!r}; roles are {', '.join(ROLES)}")
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        content = "" if m["content"] is None and calls else m["content"]
        if not isinstance(content, str):
            raise PromptError(f"messages[{i}]['content'] must be a string")
        message: dict[str, Any] = {"role": m["role"], "content": content}
        if calls:
            message["tool_calls"] = _calls(calls, i)
        for key in ("tool_call_id", "name") if m["role"] == "tool" else ():
            if isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def _calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """OpenAI's tool calls as templates read them: arguments as a mapping, not JSON text."""
    if not isinstance(calls, list):
        raise PromptError(f"messages[{i}]['tool_calls'] must be a list")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise PromptError(f"messages[{i}]['tool_calls']: each needs a function with a name")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise PromptError(
                    f"messages[{i}]['tool_calls']: arguments of {fn['name']!r} are not JSON"
                ) from None
        function = {"name": fn["name"], "arguments": arguments}
        out.append({"id": call.get("id"), "type": "function", "function": function})
    return out


def render(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict] | None = None
) -> str:
    """The target's chat template applied to `messages`, ready for the assistant's turn.

    Templates that reject a system role get it folded into the first user message; a tokenizer
    without any template gets a plain "role: text" transcript, so base models still answer.
    `tools` (OpenAI's) go to the template, which must take them (ToolError otherwise).
    """
    messages = check_messages(messages)
    if tools and not supports_tools(tokenizer):
        raise ToolError("this model's chat template has no tool support: send no tools", "tools")
    extra = {"tools": tools} if tools else {}
    if _has_template(tokenizer):
        folded = _fold(messages)
        errors = []
        for attempt in [messages] + ([folded] if folded != messages else []):
            try:
                return tokenizer.apply_chat_template(
                    attempt, add_generation_prompt=True, tokenize=False, **extra
                )
            except Exception as e:  # jinja raises its own errors, e.g. "System role not supported"
                errors.append(e)
                continue
        if tools or any(len(m) > 2 for m in messages):  # no plain transcript of tool calls
            raise PromptError(f"the chat template refused these messages: {errors[-1]}")
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant: "


def _has_template(tokenizer: Any) -> bool:
    has_template = getattr(tokenizer, "has_chat_template", None)
    if has_template is None:
        has_template = getattr(tokenizer, "chat_template", None) is not None
    return bool(has_template)


_PROBE = {
    "type": "function",
    "function": {
        "name": "macspec_probe_tool",
        "description": "a probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
_SUPPORTS: dict[str, bool] = {}  # template text -> whether it shows the tools it is given


def supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template puts the tools it is given into the prompt (one that ignores
    them would have the model answer as if it had none)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not _has_template(tokenizer):
        return False
    if template not in _SUPPORTS:
        probe = [{"role": "user", "content": "hi"}]
        try:
            text = tokenizer.apply_chat_template(
                probe, tools=[_PROBE], add_generation_prompt=True, tokenize=False
            )
        except Exception:  # a template that fails with tools does not take them
            text = ""
        _SUPPORTS[template] = "macspec_probe_tool" in text
    return _SUPPORTS[template]


def _fold(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system message folded into the first user message."""
    if not messages or messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
    for m in rest:
        if m["role"] == "user":
            m["content"] = f"{system}\n\n{m['content']}"
            break
    return rest
