"""Turning a conversation into the target's prompt string, shared by the app and the plain mode."""

from __future__ import annotations

import inspect
from typing import Any

# options the engine's generate()/stream_generate() take; the chat passes only these through
GENERATION_OPTIONS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "num_draft",
    "seed",
    "adaptive",
)


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The target's chat template applied to `messages`, ready for the assistant's turn.

    Templates that reject a system role get it folded into the first user message; a tokenizer
    without any template gets a plain "role: text" transcript, so base models still answer.
    """
    has_template = getattr(tokenizer, "has_chat_template", None)
    if has_template is None:
        has_template = getattr(tokenizer, "chat_template", None) is not None
    if has_template:
        try:
            return tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception:  # jinja raises its own errors, e.g. "System role not supported"
            folded = _fold_system(messages)
            if folded != messages:
                try:
                    return tokenizer.apply_chat_template(
                        folded, add_generation_prompt=True, tokenize=False
                    )
                except Exception:
                    pass
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant: "


def _fold_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    if not messages or messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
    for m in rest:
        if m["role"] == "user":
            m["content"] = f"{system}\n\n{m['content']}"
            break
    return rest


def engine_defaults() -> dict[str, Any]:
    """The engine's own defaults for the generation options (shown in the UI before any change)."""
    import macspec

    params = inspect.signature(macspec.stream_generate).parameters
    if not any(name in params for name in GENERATION_OPTIONS):  # **kwargs wrapper: ask generate()
        params = inspect.signature(macspec.generate).parameters
    return {
        name: p.default
        for name, p in params.items()
        if name in GENERATION_OPTIONS and p.default is not inspect.Parameter.empty
    }
