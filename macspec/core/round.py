"""One round: draft, verify in one target pass, accept, then commit (or, failing, undo).

Written once for every caller: a lone generation, a batched row, a sharded target (its pass
is rank 0's lead, target.py and sharded.py alike) and token trees. A round is a generator:
its target pass is run here (`shared=False`) or yielded as a `Feed` for a pass shared with
other rows (batch_rounds.py), which sends the logits back; either way the same keys, the same
acceptance (verify.judge) and the same rewinds (`Rewind`). No I/O, no text.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from time import perf_counter
from types import TracebackType

import mlx.core as mx

from ..base.errors import CacheError
from . import hooks, tree
from .drafters.base import Drafter, Proposal
from .sampling import Distribution, sample
from .target import Target
from .tree import Tree, TreeShape
from .verify import allowed_part, judge, plain_token

# What a shared pass sends back to a row's Feed: its logits (w, V) and hidden states (or None).
Verified = tuple[mx.array, mx.array | None]


@dataclass
class Feed:
    """A row's ids for the shared pass: `tokens` (w,) fed after the ids `cache` holds;
    `hidden`: the row's target keeps the pass's hidden states (a drafter reads them)."""

    cache: list
    tokens: mx.array
    hidden: bool = False


@dataclass(frozen=True)
class Step:
    """What one round is given: the context's last id, the drafts to propose (0: a plain step;
    a TreeShape: a token tree), the sampling distribution and the round's random key.
    `t0`: when the round began (a pass launched ahead began it earlier); `launch`: a plain step
    starts the pass over its id before the id is read (Target.launch); `seen`: gets the
    target's (logits, drafts, p) rows for log probabilities."""

    last: int
    k: int | TreeShape
    dist: Distribution
    key: mx.array
    t0: float
    launch: bool = False
    seen: list | None = None


@dataclass
class Verdict:
    """A round before stops: drafts in chain order (the kept ones first), how many were kept,
    the target's token, the seconds spent, drafts along a path and rows verified."""

    drafts: list[int]
    n: int
    token: int
    draft_time: float
    verify_time: float
    num_draft: int
    rows: int
    drafter: str = ""


class Rewind:
    """A round's transaction over the target's and the drafter's states. commit: the target
    keeps the context's last id and the accepted drafts, the drafter hears what was kept. A
    round that fails half-way (or is closed) keeps nothing: both go back to the round's start.
    `padded`: the pass may leave padding after the round's ids (a shared pass, batch.py)."""

    def __init__(self, target: Target, drafter: Drafter | None, padded: bool = False) -> None:
        self.target, self.drafter, self.padded = target, drafter, padded
        self.start = target.offset
        self.proposed: int | None = None  # drafts the drafter was asked for, then proposed

    def __enter__(self) -> Rewind:
        return self

    def __exit__(
        self, kind: type | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if error is None:
            return
        self.target.trim_to(self.start)
        if self.drafter is not None and self.proposed is not None:
            self.drafter.abort(self.proposed)

    def propose(self, k: int, dist: Distribution, key: mx.array) -> Proposal:
        """The drafter's proposal of up to k drafts, cut to the part the constraint allows
        (the drafter is told of all it proposed: it fed them)."""
        self.proposed = k
        proposal = self.drafter.propose(k, dist, key)
        self.proposed = proposal.tokens.size
        return allowed_part(proposal, dist)

    def propose_tree(self, shape: TreeShape) -> Tree:
        self.proposed = 0
        t = self.drafter.propose_tree(shape)
        self.proposed = len(t)
        return t

    def commit(self, n: int, emitted: list[int]) -> None:
        """A chain (or a plain step) verified: n drafts kept, then the target's token."""
        # A plain step's own pass leaves its id alone (and maybe a pass launched after it).
        if self.proposed is not None or self.padded:
            self.target.trim_to(self.start + 1 + n)
        if self.drafter is not None:
            hidden = self.target.hidden
            kept = hidden[: n + 1] if hidden is not None else None
            self.drafter.commit(self.proposed or 0, n, emitted, kept)

    def commit_tree(self, t: Tree, accepted: list[int], token: int) -> None:
        """A tree verified: the accepted path's entries move to the positions they belong to."""
        keep = [0, *(a + 1 for a in accepted)]
        tree.compact(self.target.cache, self.start, keep)
        hidden = self.target.hidden
        kept = hidden[mx.array(keep)] if hidden is not None else None
        emitted = [t.tokens[a] for a in accepted] + [token]
        self.drafter.commit_tree(t, accepted, emitted, kept)


def chain_round(
    target: Target, drafter: Drafter | None, step: Step, shared: bool = False
) -> Generator[Feed, Verified, Verdict]:
    """A chain of up to k drafts, or a plain step (k = 0), verified in one target pass."""
    k = step.k
    draft_key, accept_key = mx.random.split(step.key) if k else (None, step.key)
    with Rewind(target, drafter, shared) as tx:
        t0 = perf_counter()
        if not k:  # a plain step: the target samples alone
            logits = yield from _target_pass(target, mx.array([step.last]), shared, False)
            token = _plain(target, step, logits, accept_key)
            seconds = perf_counter() - step.t0
            tx.commit(0, [token])
            return Verdict([], 0, token, 0.0, seconds, 0, 1)
        proposal = tx.propose(k, step.dist, draft_key)  # (k,) drafts, q (k, V) or None
        drafts = proposal.tokens
        mx.async_eval(drafts)  # computed while Python builds the pass
        t1 = perf_counter()  # drafted (lazily: the ids may still compute within the pass)
        fed = mx.concatenate([mx.array([step.last]), drafts])  # (k+1,)
        logits = yield from _target_pass(target, fed, shared, True)  # (k+1, V)
        # Accept draft i with probability min(1, p(x_i) / q(x_i)); at the first rejection
        # draw from norm(max(0, p - q)), after k acceptances from p (verify.accept).
        n_arr, token_arr = judge(logits, proposal, step.dist, accept_key, step.seen)
        if not shared:  # the drafts computed while the pass was built: drafting ends now
            mx.eval(drafts)
            t1 = perf_counter()
        mx.eval(n_arr, token_arr)
        ids, n, token = drafts.tolist(), n_arr.item(), token_arr.item()
        t2 = perf_counter()
        tx.commit(n, ids[:n] + [token])
    name = drafter.drafted_by() if ids else ""
    return Verdict(ids, n, token, t1 - t0, t2 - t1, len(ids), len(ids) + 1, name)


def alone(round_: Generator[Feed, Verified, Verdict]) -> Verdict:
    """The verdict of a round run with its own pass (shared=False: it never yields)."""
    try:
        next(round_)
    except StopIteration as done:
        return done.value
    raise CacheError("a round run alone asked for a shared pass")


def _target_pass(
    target: Target, fed: mx.array, shared: bool, drafted: bool
) -> Generator[Feed, Verified, mx.array]:
    """The target's logits (w, V) for the fed ids: from a shared pass (a Feed yielded to the
    driver), else from the target's own pass."""
    if shared:
        logits, target.hidden = yield Feed(target.cache, fed, target.keep_hidden)
        return logits
    if not drafted:
        return target.logits(fed)  # a plain step (may use a pass launched ahead)
    # Built whole (hooks.serial): evaluated while built, the pass would count as drafting.
    with hooks.serial():
        return target.logits(fed, True)


def _plain(target: Target, step: Step, logits: mx.array, key: mx.array) -> int:
    """A plain step's id, the target's own draw; with `launch` the pass over it starts first."""
    token = plain_token(logits, step.dist, key, step.seen)
    if step.launch:
        mx.async_eval(token)  # computed while Python builds the next pass
        target.launch(token)
    return token.item()


def tree_round(target: Target, drafter: Drafter, step: Step) -> tuple[Tree, list[int], Verdict]:
    """Draft a token tree, verify it in one target pass (each row sees its own path only),
    walk it (tree.py). Returns the tree, its accepted nodes and the round as a chain: the
    accepted path, then the candidates where the target diverged."""
    target.drop_launch()  # a tree's root is in its own pass
    with Rewind(target, drafter) as tx:
        t0 = perf_counter()
        t = tx.propose_tree(step.k)  # the tree's ids are read: the drafts are done
        t1 = perf_counter()
        rows = [-1, *range(len(t))]
        mask = tree.attend(t, tx.start, rows, rows)
        with tree.tree_pass(target.model, target.cache, mask, [0, *t.depths], tx.start):
            logits = target.logits(mx.array([step.last, *t.tokens]), True)  # (nodes + 1, V)
        samples = sample(tree.row_distributions(step.dist, logits, t), step.key)
        path, token = tree.walk(t, samples.tolist())
        t2 = perf_counter()
        tx.commit_tree(t, path, token)
    below = path[-1] if path else -1
    drafts = [t.tokens[i] for i in path] + [t.tokens[i] for i in t.children(below)]
    depth = max(t.depths, default=0)
    v = Verdict(drafts, len(path), token, t1 - t0, t2 - t1, depth, len(t) + 1, drafter.drafted_by())
    return t, path, v
