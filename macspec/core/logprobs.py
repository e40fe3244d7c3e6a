"""Log probabilities of the emitted ids under the target's sampling distribution (the penalty,
the constraint mask, the temperature and the filters applied): the same rows the acceptance rule
reads, so they are the same with and without speculation."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

MAX_TOP = 20  # the most alternatives reported per token (OpenAI's limit)


@dataclass(frozen=True)
class TokenLogprob:
    id: int
    logprob: float  # -inf where the distribution gives the id nothing
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob), most likely first, none of prob 0


def token_logprobs(probs: mx.array, ids: list[int], top: int) -> list[TokenLogprob]:
    """Row i of `probs` (rows >= len(ids), V) is the distribution ids[i] was drawn from."""
    if not ids:
        return []
    logp = mx.log(probs[: len(ids)].astype(mx.float32))
    chosen = mx.take_along_axis(logp, mx.array(ids)[:, None], axis=-1)[:, 0]
    if top:
        best = mx.argsort(-logp, axis=-1)[:, :top]
        best_lp = mx.take_along_axis(logp, best, axis=-1)
        tops = [
            tuple((i, lp) for i, lp in zip(row_ids, row_lp, strict=True) if lp > -float("inf"))
            for row_ids, row_lp in zip(best.tolist(), best_lp.tolist(), strict=True)
        ]
    else:
        tops = [()] * len(ids)
    return [TokenLogprob(i, lp, t) for i, lp, t in zip(ids, chosen.tolist(), tops, strict=True)]
