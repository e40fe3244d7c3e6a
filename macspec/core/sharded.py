"""A target sharded over several processes or Macs with MLX distributed (`mlx.launch`).

Rank 0 leads: it runs the whole speculative loop (draft model, acceptance, sampling, stops, text)
and, before each target operation, sends the other ranks one small message: the operation
(start a sequence, forward these ids) and the cache length to rewind to first. Every rank then
runs the same `target.Target` code on its shard, so the collectives inside the model match one
for one, and the caches rewind to the same lengths. Every accept/reject decision and every
sampled id is taken once, on rank 0: no rank can disagree, even where float all-reduce results
differ in the last bit, and the random stream only exists on rank 0.

Why the draft lives on rank 0 only: the target needs the drafts before it can verify, so drafting
is on the critical path wherever it runs, and rank 0 must send one message per round anyway (the
rewind length follows from rank 0's decision). The drafts ride in that message for free: a
replicated draft would save no message, and would cost every rank the draft's memory and a risk of
drafts that differ between machines (the message's cost is measured in the README).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..base import switches
from ..base.errors import CacheError, MacspecError, ModelError
from .drafters.base import Drafter
from .loaded import LoadedPair
from .loop import Round
from .target import Target

# Seconds rank 0 waits for the other ranks in one round (or one prompt's prefill), and while
# loading, before it reports a dead or hung rank. MACSPEC_DIST_TIMEOUT overrides the first.
log = logging.getLogger("macspec.core")

ROUND_TIMEOUT = 120.0
LOAD_TIMEOUT = 900.0
EXIT_HUNG = 3  # exit code when the watchdog ends a hung run (the main thread cannot be freed)

OP_START, OP_FORWARD, OP_QUIT = 1, 2, 3
HEADER = 4  # op, rewind-to length (-1: none; OP_START: the max_step), number of ids, flags
INLINE = 36  # ids carried in the fixed-size message; longer payloads follow in a second one
FLAG_HIDDEN = 1
FLAG_REWINDABLE = 2  # a forward that may be taken back (caches.forward)


class DistributedError(MacspecError):
    """A rank died, hung or disagrees; or the model cannot be sharded over the group."""


def init_group() -> mx.distributed.Group | None:
    """The group when this process was started by mlx.launch (or mpirun), else None.

    The backend follows from what the launcher set: ring (MLX_HOSTFILE), JACCL (MLX_IBV_DEVICES),
    MPI (OMPI_* variables), NCCL (NCCL_HOST_IP)."""
    env = os.environ
    if "MLX_IBV_DEVICES" in env or "MLX_JACCL_COORDINATOR" in env:
        backend = "jaccl"
    elif "MLX_HOSTFILE" in env and "MLX_RANK" in env:
        backend = "ring"
    elif "OMPI_COMM_WORLD_SIZE" in env:
        backend = "mpi"
    elif "NCCL_HOST_IP" in env and "MLX_WORLD_SIZE" in env:
        backend = "nccl"
    else:
        return None
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except Exception as e:  # the backend raises RuntimeError/ValueError with its own text
        raise DistributedError(f"cannot join the {backend} group: {e}") from e
    return group if group.size() > 1 else None


def rank(pair: LoadedPair) -> int:
    return pair.group.rank() if pair.group is not None else 0


def is_leader(pair: LoadedPair) -> bool:
    """True on rank 0 (and without a group): the rank that generates, prints and streams."""
    return rank(pair) == 0


class Watchdog:
    """Ends the process with a clear message if a collective does not finish in time.

    A collective blocked on a dead or stopped peer cannot be interrupted from Python, so the
    only bounded way out is to report and exit from a second thread."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self._deadline: float | None = None
        self._what = ""
        self._seconds = 0.0
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="macspec-watchdog", daemon=True).start()

    def arm(self, what: str, seconds: float) -> None:
        with self._cond:
            self._deadline, self._what, self._seconds = time.monotonic() + seconds, what, seconds
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def save(self) -> tuple[float | None, str, float]:
        return self._deadline, self._what, self._seconds

    def restore(self, state: tuple[float | None, str, float]) -> None:
        """Back to an outer deadline (a round's) after an inner collective."""
        with self._cond:
            self._deadline, self._what, self._seconds = state
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                others = "rank 0" if self.rank else "rank 1"
                others = others if self.rank or self.size == 2 else f"ranks 1-{self.size - 1}"
                # The main thread is stuck in the collective: this is the only word it gets out.
                log.critical(
                    "rank %d: no answer from %s for %.0fs while %s: a rank has died or hangs "
                    "(check its machine and output); stopping",
                    self.rank,
                    others,
                    self._seconds,
                    self._what,
                )
                os._exit(EXIT_HUNG)


class Link:
    """Rank 0's messages to the other ranks, with timing and failure detection."""

    def __init__(self, group: mx.distributed.Group, timeout: float | None = None):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.timeout = timeout or switches.DIST_TIMEOUT.value() or ROUND_TIMEOUT
        self.watchdog = Watchdog(self.rank, self.size)
        self.comm_time = 0.0  # seconds rank 0 spent in messages and collectives, for the bench
        # Also time the all-reduces inside the forward pass: one sync per layer, so only when
        # asked (MACSPEC_COMM_TIMING=1 or time_communication(); the bench wants it).
        self.time_collectives = switches.COMM_TIMING.value()
        self.broken = False
        self.quit_sent = False
        self.target: Target | None = None  # this rank's target of the latest generation

    def collective(self, x: mx.array, what: str, seconds: float | None = None) -> mx.array:
        """all_sum(x) over the group, bounded by the watchdog; errors name the failure."""
        outer = self.watchdog.save()
        self.watchdog.arm(what, seconds or self.timeout)
        try:
            y = mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)
            mx.eval(y)
        except RuntimeError as e:
            self.broken = True
            raise DistributedError(
                f"rank {self.rank}: lost the connection to another rank while {what} "
                f"(a rank exited or its machine went away): {e}"
            ) from e
        finally:
            self.watchdog.restore(outer)
        return y

    def send(self, op: int, ids: list[int], trim: int = -1, flags: int = 0) -> None:
        """Rank 0: broadcast one operation (a sum where every other rank adds zeros)."""
        if self.broken:
            raise DistributedError(
                "rank 0: an earlier failure left the ranks out of step; restart all of them"
            )
        t0 = time.perf_counter()
        msg = [op, trim, len(ids), flags] + ids[:INLINE]
        msg += [0] * (HEADER + INLINE - len(msg))
        self.collective(mx.array(msg, dtype=mx.int32), "sending the next operation")
        if len(ids) > INLINE:
            self.collective(mx.array(ids[INLINE:], dtype=mx.int32), "sending the prompt")
        self.comm_time += time.perf_counter() - t0

    def receive(self) -> tuple[int, list[int], int, int]:
        """Other ranks: wait (without a deadline: rank 0 may sit idle in a chat) for one op."""
        zeros = mx.zeros((HEADER + INLINE,), dtype=mx.int32)
        try:
            msg = mx.distributed.all_sum(zeros, group=self.group, stream=mx.cpu).tolist()
        except RuntimeError as e:
            raise DistributedError(
                f"rank {self.rank}: lost the connection to rank 0 (it exited or its machine "
                f"went away): {e}"
            ) from e
        op, trim, n, flags = msg[:HEADER]
        ids = msg[HEADER : HEADER + min(n, INLINE)]
        if n > INLINE:
            rest = self.collective(mx.zeros((n - INLINE,), dtype=mx.int32), "receiving the prompt")
            ids += rest.tolist()
        return op, ids, trim, flags

    def quit(self) -> None:
        """Rank 0: release the other ranks (at exit). Skipped once the group is broken."""
        if self.rank == 0 and not self.broken and not self.quit_sent:
            self.quit_sent = True
            try:
                self.send(OP_QUIT, [])
            except DistributedError:
                pass  # already exiting; the other ranks see the closed connection


_LINKS: dict[int, Link] = {}


def link_of(pair: LoadedPair) -> Link:
    return _LINKS[id(pair.group)]


def time_communication(pair: LoadedPair, on: bool = True) -> None:
    """Make RoundEvent.comm_time include the model's all-reduces, not only rank 0's messages
    (costs one sync per layer: for benchmarks). No-op without a group."""
    if pair.group is not None:
        link_of(pair).time_collectives = on


# ---------------------------------------------------------------- loading


def load_sharded(
    path: Path, group: mx.distributed.Group
) -> tuple[nn.Module, TokenizerWrapper, dict]:
    """Load this rank's part of the target: tensor parallel where the model supports it, else
    pipeline stages. Returns (model, tokenizer, config) like mlx-lm's load."""
    from mlx_lm.utils import load_model, load_tokenizer

    link = _LINKS.get(id(group))
    if link is None:  # one link (and watchdog) per group, however many pairs load over it
        link = _LINKS[id(group)] = Link(group)
        if link.rank == 0:
            atexit.register(link.quit)
    try:
        # Lazy: the file is mapped, and only the slices this rank keeps are ever read into memory.
        model, config = load_model(path, lazy=True)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # mlx-lm raises ValueError/KeyError/FileNotFoundError from inside
        raise ModelError(f"cannot load the model in {path}: {type(e).__name__}: {e}") from e
    _check_divisible(model, path, link.size)
    # foreign: mlx-lm's models offer tensor parallelism (shard) or pipeline stages, or neither
    if hasattr(model, "shard"):
        model.shard(group)
    elif hasattr(getattr(model, "model", None), "pipeline"):  # foreign: as above
        model.model.pipeline(group)
    else:
        raise ModelError(
            f"{path}: mlx-lm cannot shard this architecture ({config.get('model_type')}) "
            "over several ranks; run it on one machine"
        )
    # Layer by layer: at most one full weight is in memory before it is cut to this rank's part.
    for layer in getattr(model, "layers", []) or []:  # foreign: mlx-lm's layers, where listed
        if layer is not None:
            mx.eval(layer.parameters())
    mx.eval(model.parameters())
    # Every rank must be here before the first message: slow loaders get LOAD_TIMEOUT.
    link.collective(mx.array([1], dtype=mx.int32), "loading the model", LOAD_TIMEOUT)
    return model, tokenizer, config


def _check_divisible(model: nn.Module, path: Path, size: int) -> None:
    """Tensor parallelism splits attention heads: refuse a group size that does not divide them."""
    if not hasattr(model, "shard"):  # foreign: mlx-lm's tensor parallelism, where offered
        return
    args = getattr(model, "args", None)  # foreign: mlx-lm's ModelArgs differ by architecture
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(args, name, None)  # foreign: as above
        if isinstance(heads, int) and heads % size:
            raise ModelError(
                f"{path}: {name}={heads} cannot be split over {size} ranks; "
                f"use a number of ranks that divides it"
            )


# ---------------------------------------------------------------- generation


class LeaderTarget(Target):
    """Rank 0's target: each operation is first sent to the other ranks, which mirror it."""

    takes_lazy_ids = False  # the ids travel to the other ranks as a list

    def __init__(
        self,
        link: Link,
        model: nn.Module,
        vocab_size: int,
        keep_hidden: bool,
        taps: tuple[int, ...] = (),
    ):
        # Only rank 0 keeps tapped layer outputs: tapping adds no collective, so the other ranks
        # run the same all-reduces with plain hidden states.
        super().__init__(model, vocab_size, keep_hidden, taps)
        self.link = link
        link.target = self
        self._rewind = -1  # a rewind the other ranks still have to apply

    def start(self, prompt: list[int], max_step: int = 1, cache: list | None = None) -> None:
        if cache is not None:
            raise CacheError("a sharded target keeps no prompt states to start from")
        self._rewind = -1
        flags = FLAG_HIDDEN if self.keep_hidden else 0
        self.link.send(OP_START, list(prompt), trim=max_step, flags=flags)
        super().start(prompt, max_step)

    def logits(self, tokens: mx.array, rewindable: bool = False) -> mx.array:
        # The rewind rides with the next forward: one message per round, not two.
        flags = FLAG_REWINDABLE if rewindable else 0
        self.link.send(OP_FORWARD, tokens.tolist(), trim=self._rewind, flags=flags)
        self._rewind = -1
        if not self.link.time_collectives:
            return super().logits(tokens, rewindable)
        with timed_all_sum(self.link):
            return super().logits(tokens, rewindable)

    def trim_to(self, length: int) -> None:
        super().trim_to(length)
        self._rewind = length


@contextmanager
def timed_all_sum(link: Link) -> Iterator[None]:
    """Time the model's own all-reduces: evaluate each input first, then the sum alone.

    Only around a forward pass whose whole output is evaluated anyway (logits), so that the
    same collectives run as on the other ranks; the extra syncs cost a little speed."""
    orig = mx.distributed.all_sum

    def all_sum(x: mx.array, *args: object, **kwargs: object) -> mx.array:
        mx.eval(x)
        t0 = time.perf_counter()
        y = orig(x, *args, **kwargs)
        mx.eval(y)
        link.comm_time += time.perf_counter() - t0
        return y

    mx.distributed.all_sum = all_sum
    try:
        yield
    finally:
        mx.distributed.all_sum = orig


def leader_target(pair: LoadedPair, keep_hidden: bool, taps: tuple[int, ...] = ()) -> LeaderTarget:
    if not is_leader(pair):
        raise DistributedError(
            f"rank {rank(pair)} does not generate: rank 0 does; call "
            "macspec.distributed.serve(pair) on the other ranks"
        )
    return LeaderTarget(link_of(pair), pair.target, pair.vocab_size, keep_hidden, taps)


def make_target(pair: LoadedPair, drafter: Drafter | None) -> Target:
    """The target a generation runs: local, or rank 0's lead of a sharded one."""
    keep_hidden = drafter is not None and drafter.needs_hidden
    taps = tuple(drafter.feature_layers) if drafter is not None else ()  # a feature draft reads
    if pair.group is None:
        return Target(pair.target, pair.vocab_size, keep_hidden, taps, pair.target_path.name)
    return leader_target(pair, keep_hidden, taps)


def guard(pair: LoadedPair, steps: Iterator[Round]) -> Iterator[Round]:
    """The rounds as they come for a local pair. Sharded: rank 0's rounds, each bounded by the
    watchdog, with its communication time filled in."""
    if pair.group is None:
        return steps
    return _guarded(pair, steps)


def _guarded(pair: LoadedPair, steps: Iterator[Round]) -> Iterator[Round]:
    link = link_of(pair)
    try:
        while True:
            before = link.comm_time
            link.watchdog.arm("verifying a round", link.timeout)
            try:
                r = next(steps)
            except StopIteration:
                return
            except RuntimeError as e:  # a collective inside the model's forward pass failed
                link.broken = True
                raise DistributedError(
                    f"rank 0: lost the connection to another rank during a round "
                    f"(a rank exited or its machine went away): {e}"
                ) from e
            except BaseException:
                # Stopped half-way (Ctrl-C, an error): the other ranks may be inside a collective
                # rank 0 never joins, so no further message is safe.
                link.broken = True
                raise
            finally:
                link.watchdog.disarm()
            yield replace(r, comm_time=link.comm_time - before)
    finally:
        steps.close()


def serve(pair: LoadedPair) -> None:
    """Ranks > 0: run this rank's shard of the target for rank 0 until it quits."""
    link = link_of(pair)
    target: Target | None = None
    while True:
        op, ids, rewind, flags = link.receive()
        if op == OP_QUIT:
            return
        if target is not None and rewind >= 0 and op != OP_START:
            target.trim_to(rewind)
        try:
            if op == OP_START:
                target = Target(pair.target, pair.vocab_size, bool(flags & FLAG_HIDDEN))
                link.target = target
                target.start(ids, max(rewind, 1))
            elif op == OP_FORWARD and target is not None:
                rewindable = bool(flags & FLAG_REWINDABLE)
                mx.eval(target.logits(mx.array(ids, dtype=mx.int32), rewindable))
            else:
                raise DistributedError(f"rank {link.rank}: unexpected message {op} from rank 0")
        except RuntimeError as e:
            raise DistributedError(
                f"rank {link.rank}: lost the connection to another rank: {e}"
            ) from e


def serve_if_follower(pair: LoadedPair) -> None:
    """For commands: ranks > 0 serve rank 0 and then end the process; rank 0 returns."""
    if not is_leader(pair):
        serve(pair)
        raise SystemExit(0)
