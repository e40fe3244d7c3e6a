"""Verification: the acceptance rule, a speculative round and a plain step.

Exactness (Leviathan et al. 2023, Chen et al. 2023): draft x ~ q, accept with probability
min(1, p(x)/q(x)); at the first rejection draw from norm(max(0, p - q)); if all k drafts are
accepted draw a bonus token from p at the last position. Every emitted token is then distributed
exactly as if the target had sampled it alone, at every temperature and sampling option.
"""

from __future__ import annotations

from time import perf_counter

import mlx.core as mx

from . import hooks
from .constraint import Constraint
from .drafters.base import Drafter, Proposal
from .sampling import Distribution, SamplingOptions, sample
from .target import Target


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


def speculative_round(
    target: Target,
    drafter: Drafter,
    last: int,
    k: int,
    dist: Distribution,
    key: mx.array,
    seen: list | None = None,
) -> tuple[list[int], int, int, float, float]:
    """Draft up to k tokens, verify them and the next position in one target pass, accept.

    Returns (drafts, n_accepted, target_token, draft_seconds, verify_seconds). Both caches end
    holding exactly the accepted context, also when something fails half-way. `seen`: gets the
    target's (logits, drafts, p) of the pass appended (for log probabilities)."""
    draft_key, accept_key = mx.random.split(key)
    start, done = target.offset, False
    drafts: list[int] = []
    n = 0
    try:
        t0 = perf_counter()
        proposal = drafter.propose(k, dist, draft_key)
        # The drafter is told of all it proposed (it fed them), the target sees the allowed part.
        k = proposal.tokens.size
        proposal = allowed_part(proposal, dist)
        # The drafts compute while Python builds the verification graph (a small share of a
        # round); the draft time then ends when the drafts are ready.
        # Built whole (hooks.serial): evaluated while built, the pass would count as drafting.
        mx.async_eval(proposal.tokens)
        with hooks.serial():
            logits = target.logits(mx.concatenate([mx.array([last]), proposal.tokens]), True)
        n_arr, token_arr = judge(logits, proposal, dist, accept_key, seen)
        mx.eval(proposal.tokens)
        t1 = perf_counter()
        mx.eval(n_arr, token_arr)
        drafts, n, token = proposal.tokens.tolist(), n_arr.item(), token_arr.item()
        done = True
        return drafts, n, token, t1 - t0, perf_counter() - t1
    finally:
        # Rewind: the target keeps `last` and the n accepted drafts; a failed round keeps nothing.
        target.trim_to(start + 1 + n if done else start)
        if done:
            kept_hidden = target.hidden[: n + 1] if target.hidden is not None else None
            drafter.commit(k, n, drafts[:n] + [token], kept_hidden)
        else:
            drafter.abort(k)


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


def plain_step(
    target: Target,
    last: int,
    dist: Distribution,
    key: mx.array,
    ahead: bool = False,
    seen: list | None = None,
) -> int:
    """One ordinary decoding step with the same sampling distribution. `ahead`: the pass over
    the sampled id starts before the id is read (Target.launch), while Python waits for it.
    `seen`: as speculative_round's."""
    logits = target.logits(mx.array([last]))
    if dist.greedy and seen is None:
        token = dist.best(logits, None, 0).astype(mx.uint32)  # the one-hot's id: sample()'s draw
    else:
        p = dist.probs(logits, None, 0)
        if seen is not None:
            seen.append((logits, None, p))
        token = sample(p, key)
    if ahead:
        mx.async_eval(token)  # computed while Python builds the next pass
        target.launch(token)
    return token.item()
