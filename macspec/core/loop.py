"""The speculative decoding loop: one function per round, and a step generator of plain data.

Exactness (Leviathan et al. 2023, Chen et al. 2023): draft x ~ q, accept with probability
min(1, p(x)/q(x)); at the first rejection draw from norm(max(0, p - q)); if all k drafts are
accepted draw a bonus token from p at the last position. Every emitted token is then distributed
exactly as if the target had sampled it alone, at every temperature and sampling option.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from statistics import median
from time import perf_counter

import mlx.core as mx
import mlx.nn as nn

from ..errors import CacheError
from . import caches, hooks
from .caches import PromptCache
from .drafters import DistFn, Drafter, prefill
from .policy import FixedK, Policy
from .sampling import SamplingOptions, distribution, penalty_windows, sample
from .tree import TreeShape, fit, tree_round


@dataclass
class Round:
    """What one round did, as plain data (ids and seconds)."""

    accepted: list[int]  # drafts kept
    rejected: list[int]  # drafts thrown away
    emitted: list[int]  # ids added to the output this round (after stops)
    target_token: int | None  # the id the target sampled (correction or bonus), if emitted
    num_draft: int  # drafts proposed along a path (a tree: its depth; 0 = a plain step)
    draft_time: float
    verify_time: float
    round_time: float
    plain_step_time: float  # current estimate of one plain target step on this machine
    finish_reason: str | None  # "stop", "length", "context" or None
    prefill_time: float = 0.0  # prompt processing, reported with the first round
    rows: int = 1  # ids the target's pass verified (a chain: drafts + 1; a tree: its nodes + 1)
    cached_tokens: int = 0  # prompt ids the prompt cache held (not read again), first round
    comm_time: float = 0.0  # distributed: rank 0's seconds in messages and all-reduces


class Timing:
    """Measured cost of one plain target step, kept across generations of a loaded pair:
    the median of the latest plain steps, so one slow step (a busy machine) does not swing it."""

    def __init__(self, window: int = 16) -> None:
        self.recent: deque[float] = deque(maxlen=window)

    @property
    def plain_step(self) -> float | None:
        return median(self.recent) if self.recent else None

    def observe_plain_step(self, seconds: float) -> None:
        self.recent.append(seconds)


class Target:
    """The target model and its cache; logits are cut to the ids both models share.

    With `keep_hidden`, every forward pass also leaves the last hidden states of the positions
    it read in `self.hidden` (for drafters that build on the target's features, as EAGLE does);
    with `taps`, the outputs of those decoder layers come first, the final features last."""

    # launch() can feed an id still being computed, so plain steps run one pass ahead.
    takes_lazy_ids = True

    def __init__(
        self,
        model: nn.Module,
        vocab_size: int,
        keep_hidden: bool = False,
        taps: tuple[int, ...] = (),
        name: str = "the target",
    ):
        self.model = model
        self.vocab_size = vocab_size
        self.cache: list = []
        self.keep_hidden = keep_hidden
        self.taps = tuple(taps)
        self.name = name  # for errors
        # (positions, (len(taps) + 1) * hidden_size) of the last forward pass
        self.hidden: mx.array | None = None
        # A pass launched ahead: (its logits, its hidden states, the id it fed).
        self.ahead: tuple[mx.array, mx.array | None, mx.array] | None = None

    def start(self, prompt: list[int], max_step: int = 1, cache: list | None = None) -> None:
        """Prefill all but the prompt's last id; later passes of up to `max_step` ids can be
        taken back (caches.make_cache). `cache`: one already holding the prompt's first ids
        (the prompt cache's); only the rest is read, and `hidden` covers only them."""
        self.cache = cache if cache is not None else caches.make_cache(self.model, max_step)
        done = caches.length(self.cache) if cache is not None else 0
        if self.keep_hidden:
            body, chunks = prompt[done:-1], []
            for i in range(0, len(body), 512):  # chunked, as prefill(): bounded graphs
                ids = mx.array(body[i : i + 512])
                with caches.forward(self.cache, ids.size):
                    chunks.append(hidden_states(self.model, ids, self.cache, self.taps))
                mx.eval(chunks[-1])
            self.hidden = mx.concatenate(chunks) if chunks else None
        else:
            prefill(self.model, self.cache, prompt[done:-1])

    @property
    def offset(self) -> int:
        """Ids the context holds (an id launched ahead is not yet part of it)."""
        try:
            return caches.length(self.cache) - (self.ahead is not None)
        except CacheError as e:
            raise CacheError(f"{self.name}: {e}") from None

    def launch(self, last: mx.array) -> None:
        """Start the pass over `last` (one id, possibly still being computed) now: the next
        logits() whose first id it is uses this pass for its first row (rows are computed
        alone, so the logits are those of one pass). Taken back by trim_to()."""
        kept, self.hidden = self.hidden, None
        logits = self._pass(last, rewindable=True)
        self.ahead, self.hidden = (logits, self.hidden, last), kept
        mx.async_eval(logits)

    def logits(self, tokens: mx.array, rewindable: bool = False) -> mx.array:
        """Logits for `tokens` fed after the context; a `rewindable` pass can be taken back."""
        if self.ahead is None:
            return self._pass(tokens, rewindable)
        head, hidden, fed = self.ahead
        self.ahead = None
        rest = self._pass(tokens[1:], rewindable) if tokens.size > 1 else None
        # Read once the rest is built: the ids may be drafts still computing.
        if fed.item() != tokens[0].item():
            raise CacheError(
                f"{self.name}: a pass launched ahead fed id {fed.item()}, not {tokens[0].item()}"
            )
        if rest is None:
            self.hidden = hidden
            return head
        if self.keep_hidden:
            self.hidden = mx.concatenate([hidden, self.hidden])
        return mx.concatenate([head, rest])

    def _pass(self, tokens: mx.array, rewindable: bool) -> mx.array:
        with caches.forward(self.cache, tokens.size, rewindable):
            if not self.keep_hidden:
                return self.model(tokens[None], cache=self.cache)[0, :, : self.vocab_size]
            self.hidden = hidden_states(self.model, tokens, self.cache, self.taps)
        final = self.hidden[:, -self.model.args.hidden_size :] if self.taps else self.hidden
        return output_head(self.model, final)[:, : self.vocab_size]

    def drop_launch(self) -> None:
        """Take back a pass launched ahead, if any: the layers hold the context again."""
        if self.ahead is not None:
            self.trim_to(self.offset)

    def trim_to(self, length: int) -> None:
        """Every layer back to exactly `length` tokens (a pass launched ahead dropped), or
        CacheError naming the model."""
        self.ahead = None
        try:
            caches.rewind(self.cache, length)
        except CacheError as e:
            raise CacheError(f"{self.name}: {e}") from None


def hidden_states(
    model: nn.Module, tokens: mx.array, cache: list, taps: tuple[int, ...] = ()
) -> mx.array:
    """Final (normed) hidden states (n, hidden) of an mlx-lm decoder: `model.model` is the trunk.

    With `taps`, the outputs of those decoder layers are joined before them: (n, (len(taps) + 1)
    * hidden). The layers are wrapped for the call rather than re-implementing the trunk, so any
    mlx-lm architecture whose trunk runs `model.model.layers` in order is tapped exactly."""
    width = model.args.hidden_size * (len(taps) + 1)
    if tokens.size == 0:
        return mx.zeros((0, width))
    if not taps:
        return model.model(tokens[None], cache=cache)[0]
    layers, tapped = model.model.layers, []
    originals = {i: layers[i] for i in taps}
    try:
        for i, layer in originals.items():
            layers[i] = _Tap(layer, tapped)
        final = model.model(tokens[None], cache=cache)[0]
    finally:
        for i, layer in originals.items():
            layers[i] = layer
    return mx.concatenate([*(t[0] for t in tapped), final], axis=-1)


class _Tap:
    """Calls a decoder layer and keeps its output (hidden_states' taps)."""

    def __init__(self, layer: nn.Module, out: list) -> None:
        self.layer, self.out = layer, out

    def __getattr__(self, name: str):  # the trunk may read a layer's attributes (use_sliding)
        return getattr(self.layer, name)

    def __call__(self, *args, **kwargs) -> mx.array:
        h = self.layer(*args, **kwargs)
        self.out.append(h)
        return h


def output_head(model: nn.Module, hidden: mx.array) -> mx.array:
    """Logits from hidden states: the untied lm_head, or the tied input embedding."""
    if getattr(model, "lm_head", None) is not None:
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)


def make_dist(opts: SamplingOptions, history: list[int]) -> DistFn:
    """The sampling distribution for rows that follow `history` + extra[:first_row + r].

    `columns` (optional) says the logits cover only some ids: it maps every id to its column,
    or to len(columns of logits) for an id they lack (a drafter with its own smaller
    vocabulary); the missing ids then have probability 0, as they would with logits of -inf."""

    def dist(
        logits: mx.array, extra: mx.array | None, first_row: int, columns: mx.array | None = None
    ) -> mx.array:
        if opts.repetition_penalty == 1.0:
            return distribution(logits, opts)
        rows = first_row + logits.shape[0]
        windows = penalty_windows(history, extra, rows, opts.repetition_context)[first_row:]
        if columns is None:
            return distribution(logits, opts, windows)
        # Ids outside the logits point at one extra column of -inf, dropped afterwards.
        pad = mx.full((logits.shape[0], 1), -mx.inf, dtype=logits.dtype)
        probs = distribution(mx.concatenate([logits, pad], axis=1), opts, columns[windows])
        return probs[:, :-1]

    dist.needs_history = opts.repetition_penalty != 1.0  # rows depend on the ids before them
    return dist


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


def one_hot(tokens: mx.array, vocab: int) -> mx.array:
    return (mx.arange(vocab)[None] == tokens[:, None]).astype(mx.float32)


def speculative_round(
    target: Target, drafter: Drafter, last: int, k: int, dist: DistFn, key: mx.array
) -> tuple[list[int], int, int, float, float]:
    """Draft up to k tokens, verify them and the next position in one target pass, accept.

    Returns (drafts, n_accepted, target_token, draft_seconds, verify_seconds). Both caches end
    holding exactly the accepted context, also when something fails half-way."""
    draft_key, accept_key = mx.random.split(key)
    start, done = target.offset, False
    drafts: list[int] = []
    n = 0
    try:
        t0 = perf_counter()
        proposal = drafter.propose(k, dist, draft_key)
        # The drafts compute while Python builds the verification graph (~3 ms a pass), which
        # is 1-2% of a round on a 2-core CPU; the draft time then ends when the drafts are ready.
        # Built whole (hooks.serial): evaluated while built, the pass would count as drafting.
        mx.async_eval(proposal.tokens)
        k = proposal.tokens.size
        with hooks.serial():
            logits = target.logits(mx.concatenate([mx.array([last]), proposal.tokens]), True)
        p = dist(logits, proposal.tokens, 0)
        q = proposal.probs if proposal.probs is not None else one_hot(proposal.tokens, p.shape[1])
        n_arr, token_arr = accept(p, q, proposal.tokens, accept_key)
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


def plain_step(target: Target, last: int, dist: DistFn, key: mx.array, ahead: bool = False) -> int:
    """One ordinary decoding step with the same sampling distribution. `ahead`: the pass over
    the sampled id starts before the id is read (Target.launch), while Python waits for it."""
    token = sample(dist(target.logits(mx.array([last])), None, 0), key)
    if ahead:
        mx.async_eval(token)  # computed while Python builds the next pass
        target.launch(token)
    return token.item()


def decode(
    target: Target,
    drafter: Drafter | None,
    prompt: list[int],
    opts: SamplingOptions,
    *,
    max_tokens: int,
    num_draft: int,
    key: mx.array,
    eos_ids: set[int],
    context_length: int,
    timing: Timing,
    policy: Policy | None = None,
    prompt_cache: PromptCache | None = None,
) -> Iterator[Round]:
    """Yield one Round per target forward pass until a stop. No I/O, no text: ids and seconds.

    The first token always comes from a plain step, which also measures what a plain step costs
    now; with no drafter every step is plain. `policy` picks K per round (0 = a plain step)
    from the drafter's label of its next proposal; without one, K = num_draft every round.
    `prompt_cache` (engine/prefix.py): start from kept states, and keep the final ones."""
    policy = policy or FixedK(num_draft)
    history = list(prompt)
    t0 = perf_counter()
    # The widest pass a round may take back (one more: a launched pass, if the round fails).
    max_step = policy.max_k + 1 + target.takes_lazy_ids
    kept = None
    if prompt_cache is not None:
        max_step = max(max_step, prompt_cache.min_step)  # window rings that rewind further
        kept = prompt_cache.restore(prompt, drafter, max_step)
    if kept is not None:
        target.start(prompt, max_step, kept.target)
        if drafter is not None:
            drafter.resume(kept.draft, prompt, kept.draft_length, target.hidden, max_step)
    else:  # (a sharded target's start takes no cache: it has no prompt cache)
        target.start(prompt, max_step)
        if drafter is not None:
            drafter.start(prompt, target.hidden, max_step)
    if prompt_cache is not None and prompt_cache.wants_checkpoint(target.cache):
        prompt_cache.save(prompt, target.cache, drafter)
    prefill_time = perf_counter() - t0
    generated = 0
    steady = True  # the states hold `history` (less its last id): they may be kept
    # A plain step starts the pass over its id before reading it (Target.launch), as mlx-lm
    # does, when the next round is expected to be plain too: that pass is then its first row.
    can_launch = target.takes_lazy_ids
    ready = perf_counter()  # when the latest ids were read
    try:
        while True:
            room = min(max_tokens - generated, context_length - len(history))
            # Never draft past max_tokens or the context: a round emits at most k + 1 ids.
            k: int | TreeShape = 0
            if drafter is not None and generated > 0:
                k = policy.next_k(drafter.label(), target.ahead is not None, target.offset)
                k = fit(k, room - 1) if isinstance(k, TreeShape) else min(k, room - 1)
            key, subkey = mx.random.split(key)
            dist = make_dist(opts, history)
            steady = False
            # A launched pass has run since the last ids were read: its time is this round's.
            t0 = ready if target.ahead is not None else perf_counter()
            rows = 0
            if isinstance(k, TreeShape):
                target.drop_launch()  # a tree's root is in its own pass
                tr, path, token, draft_time, verify_time = tree_round(
                    target, drafter, history[-1], k, dist, subkey
                )
                policy.observe_tree(tr, path, perf_counter() - t0)
                # As a chain: the accepted path, then the candidates where the target diverged.
                below = path[-1] if path else -1
                drafts = [tr.tokens[i] for i in path] + [tr.tokens[i] for i in tr.children(below)]
                n, rows = len(path), len(tr) + 1
            elif k > 0:
                drafts, n, token, draft_time, verify_time = speculative_round(
                    target, drafter, history[-1], k, dist, subkey
                )
                policy.observe(len(drafts), n)
            else:
                ahead = can_launch and room > 1 and (drafter is None or policy.expects_plain())
                token = plain_step(target, history[-1], dist, subkey, ahead)
                drafts, n, draft_time = [], 0, 0.0
                verify_time = perf_counter() - t0
                timing.observe_plain_step(verify_time)
                if drafter is not None:
                    drafter.commit(0, 0, [token], target.hidden)
            ready = perf_counter()
            round_time = ready - t0

            emitted = (drafts[:n] + [token])[:room]
            history += emitted
            steady = True
            finish = None
            hit = next((i for i, t in enumerate(emitted) if t in eos_ids), None)
            if hit is not None:
                emitted, finish = emitted[:hit], "stop"  # the EOS id itself is not output
            elif generated + len(emitted) >= max_tokens:
                finish = "length"
            elif len(history) >= context_length:
                finish = "context"
            first = generated == 0
            generated += len(emitted)
            yield Round(
                accepted=drafts[:n],
                rejected=drafts[n:],
                emitted=emitted,
                target_token=token if len(emitted) == n + 1 else None,
                num_draft=max(tr.depths, default=0) if rows else len(drafts),
                rows=rows or (len(drafts) + 1 if drafts else 1),
                draft_time=draft_time,
                verify_time=verify_time,
                round_time=round_time,
                plain_step_time=timing.plain_step or round_time,
                finish_reason=finish,
                prefill_time=prefill_time if first else 0.0,
                cached_tokens=(kept.length if kept else 0) if first else 0,
            )
            if finish:
                return
    finally:
        if steady:  # a pass launched past the end is never read
            target.drop_launch()
        # Finished, or closed between rounds: keep the states for the next prompt.
        if prompt_cache is not None and steady:
            prompt_cache.save(history, target.cache, drafter)
