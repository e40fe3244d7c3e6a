"""A conversation as the target's prompt: its chat template applied, ready for the answer.

One function for every front end (the API's `messages=`, `macspec generate`, the chat, the
server), so that the same conversation always becomes the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import PromptError

ROLES = ("system", "user", "assistant", "tool", "developer")


def check_messages(messages: Any) -> list[dict[str, str]]:
    """The messages as plain dicts, or PromptError naming the first bad one."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise PromptError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise PromptError(f"messages[{i}] must be a dict with 'role' and 'content', not {m!r}")
        if m["role"] not in ROLES:
            raise PromptError(f"messages[{i}] has role {m['role']!r}; roles are {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise PromptError(f"messages[{i}]['content'] must be a string")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def render(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """The target's chat template applied to `messages`, ready for the assistant's turn.

    Templates that reject a system role get it folded into the first user message; a tokenizer
    without any template gets a plain "role: text" transcript, so base models still answer.
    """
    messages = check_messages(messages)
    has_template = getattr(tokenizer, "has_chat_template", None)
    if has_template is None:
        has_template = getattr(tokenizer, "chat_template", None) is not None
    if has_template:
        folded = _fold(messages)
        for attempt in [messages] + ([folded] if folded != messages else []):
            try:
                return tokenizer.apply_chat_template(
                    attempt, add_generation_prompt=True, tokenize=False
                )
            except Exception:  # jinja raises its own errors, e.g. "System role not supported"
                continue
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant: "


def _fold(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The system message folded into the first user message."""
    if not messages or messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
    for m in rest:
        if m["role"] == "user":
            m["content"] = f"{system}\n\n{m['content']}"
            break
    return rest
