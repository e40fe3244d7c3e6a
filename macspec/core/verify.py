"""Verification: the acceptance rule over a pass's rows, and a plain step's draw (round.py runs
the rounds).

Exactness (Leviathan et al. 2023, Chen et al. 2023): draft x ~ q, accept with probability
min(1, p(x)/q(x)); at the first rejection draw from norm(max(0, p - q)); if all k drafts are
accepted draw a bonus token from p at the last position. Every emitted token is then distributed
exactly as if the target had sampled it alone, at every temperature and sampling option.
"""

from __future__ import annotations

import mlx.core as mx

from .constraint import Constraint
from .drafters.base import Proposal
from .sampling import Distribution, SamplingOptions, sample


def make_dist(
    opts: SamplingOptions, history: list[int], constraint: Constraint | None = None
) -> Distribution:
    """The sampling distribution for rows that follow `history` (sampling.Distribution)."""
    return Distribution(opts, history, constraint)


def accept(p: mx.array, q: mx.array, drafts: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    """Modified rejection sampling over k drafts: p (k+1, V) target, q (k, V) draft.

    Returns (n, token): the length of the accepted prefix and the target's next token."""
    k = drafts.size
    u_key, r_key = mx.random.split(key)
    rows = mx.arange(k)
    px, qx = p[rows, drafts], q[rows, drafts]
    # Accept x_i with probability min(1, p(x_i)/q(x_i)), i.e. u * q < p with u ~ U[0, 1).
    ok = (mx.random.uniform(shape=(k,), key=u_key) * qx < px).astype(mx.int32)
    n = mx.sum(mx.cumprod(ok))
    # Rejected at n: draw from norm(max(0, p_n - q_n)). All accepted (n == k): q_k = 0, so from p_k.
    q = mx.concatenate([q, mx.zeros((1, q.shape[1]), q.dtype)])
    residual = mx.maximum(mx.take(p, n, axis=0) - mx.take(q, n, axis=0), 0.0)
    residual = mx.where(mx.sum(residual) > 0, residual, mx.take(p, n, axis=0))
    return n, sample(residual[None], r_key)[0]


def accept_greedy(ids: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """accept() where p's rows are one-hot at `ids` (k+1,): then u * q(x) < p(x) holds exactly
    when x is its row's id, and at the first miss max(0, p - q) is p's one-hot again. So the
    same (n, token), without the (k+1, V) rows."""
    k = drafts.size
    n = mx.sum(mx.cumprod((ids[:k] == drafts).astype(mx.int32)))
    return n, ids[n]


def judge(
    logits: mx.array,
    proposal: Proposal,
    dist: Distribution,
    key: mx.array,
    seen: list | None = None,
) -> tuple[mx.array, mx.array]:
    """(n accepted, next token) of a pass's logits (k+1, V) over `proposal`'s k drafts; `seen`
    gets (logits, drafts, p) appended (log probabilities need the rows: no greedy short cut)."""
    if dist.greedy and seen is None:
        return accept_greedy(dist.best(logits, proposal.tokens, 0), proposal.tokens)
    p = dist.probs(logits, proposal.tokens, 0)
    if seen is not None:
        seen.append((logits, proposal.tokens, p))
    q = proposal.probs if proposal.probs is not None else one_hot(proposal.tokens, p.shape[1])
    return accept(p, q, proposal.tokens, key)


def one_hot(tokens: mx.array, vocab: int) -> mx.array:
    return (mx.arange(vocab)[None] == tokens[:, None]).astype(mx.float32)


def allowed_part(proposal: Proposal, dist: Distribution) -> Proposal:
    """A proposal cut before the first id the constraint forbids: a copy (q = None) may hold
    any id, a drafter with its own smaller vocabulary may have none allowed at a position
    (constraint.masked). Possibly empty: the round is then a plain step."""
    constraint = dist.constraint
    if constraint is None or not proposal.tokens.size:
        return proposal
    n = constraint.valid_prefix(proposal.tokens.tolist())
    if n == proposal.tokens.size:
        return proposal
    probs = proposal.probs[:n] if proposal.probs is not None else None
    return Proposal(proposal.tokens[:n], probs)


def plain_token(
    logits: mx.array, dist: Distribution, key: mx.array, seen: list | None = None
) -> mx.array:
    """A plain step's id (1,) from the target's row (1, V): drawn from p with `key`, or at
    temperature 0 the id p's one-hot holds (what sample() draws). `seen`: as judge's."""
    if dist.greedy and seen is None:
        return dist.best(logits, None, 0).astype(mx.uint32)
    p = dist.probs(logits, None, 0)
    if seen is not None:
        seen.append((logits, None, p))
    return sample(p, key)
