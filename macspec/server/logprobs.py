"""Log probabilities in OpenAI's shapes, from what the core reports per emitted token.

`TokenLogprob` is the data: the token, its log probability under the target's sampling
distribution (the sampling transforms and any constraint mask applied; the core's own
definition), and the top-N ids with theirs. The chat shape is
`choices[].logprobs.content[] {token, logprob, bytes, top_logprobs[] {token, logprob, bytes}}`;
the completions (legacy) shape is `{tokens, token_logprobs, top_logprobs[] {token: logprob},
text_offset}`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..core.logprobs import MAX_TOP, TokenLogprob

__all__ = ["MAX_TOP", "Pieces", "TokenLogprob", "chat", "legacy"]

MAX_LEGACY = 5  # OpenAI's limit for logprobs on /v1/completions
FLOOR = -9999.0  # OpenAI's stand-in for log(0): JSON has no -inf


def _finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


class Pieces:
    """Each id's text and bytes, as OpenAI reports a token: the bytes it adds alone (a piece of
    a character for byte-level tokens), the text being those bytes as far as they decode."""

    def __init__(self, token_bytes: Any) -> None:
        self._bytes = token_bytes  # id -> bytes (llguidance's LLTokenizer.decode_bytes)
        self._cache: dict[int, bytes] = {}

    def bytes(self, i: int) -> bytes:
        if i not in self._cache:
            self._cache[i] = self._bytes([i])
        return self._cache[i]

    def text(self, i: int) -> str:
        return self.bytes(i).decode("utf-8", errors="replace")


def chat(entries: Sequence[TokenLogprob], pieces: Pieces, top: int) -> dict[str, Any]:
    """`choices[].logprobs` of a chat answer (or of one streamed chunk)."""

    def one(i: int, lp: float) -> dict[str, Any]:
        return {"token": pieces.text(i), "logprob": _finite(lp), "bytes": list(pieces.bytes(i))}

    return {
        "content": [
            {**one(e.id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top[:top]]}
            for e in entries
        ],
        "refusal": None,
    }


def legacy(
    entries: Sequence[TokenLogprob], pieces: Pieces, top: int, offset: int = 0
) -> dict[str, Any]:
    """`choices[].logprobs` of /v1/completions; `offset`: characters of the answer before these."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(pieces.text(e.id))
    return {
        "tokens": [pieces.text(e.id) for e in entries],
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": [
            {pieces.text(i): _finite(lp) for i, lp in e.top[:top]} if top else None for e in entries
        ],
        "text_offset": offsets,
    }
