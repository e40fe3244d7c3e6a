"""One rank of a distributed test, started by mlx.launch (or by the tests with MLX_RANK set).

    python dist_worker.py TARGET DRAFT MODE OUT_DIR [options as JSON]

Rank 0 writes OUT_DIR/result.json; with MODE=caches every rank writes OUT_DIR/cache_RANK.npz.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import macspec
from macspec.core import sharded as distributed


def main() -> int:
    target, draft, mode, out = sys.argv[1:5]
    opts = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    out_dir = Path(out)
    group = distributed.init_group()
    pair = macspec.load(target, None if draft == "-" else draft, group=group)
    me = distributed.rank(pair)
    link = distributed.link_of(pair)
    die = {k: opts.pop(k) for k in ("rank", "after", "signal") if k in opts}
    if mode == "die" and me == die["rank"]:
        # Take part in the first operations, then die (SIGKILL) or hang (SIGSTOP) mid-generation.
        receive, count = link.receive, [0]

        def dying_receive():
            count[0] += 1
            if count[0] > die["after"]:
                os.kill(os.getpid(), getattr(signal, die["signal"]))
            return receive()

        link.receive = dying_receive
    if me != 0:
        distributed.serve(pair)
        if mode == "caches":
            dump_cache(link, out_dir / f"cache_{me}.npz")
        return 0
    if opts.pop("eos_off", False):
        pair.eos_token_ids = frozenset()
    prompt = opts.pop("prompt")
    result: dict = {"size": group.size()}
    if mode == "sample":
        seeds = opts.pop("seeds")
        runs = [macspec.generate(pair, prompt, seed=s, **opts).tokens for s in range(seeds)]
        result["runs"] = runs
    else:
        adaptive_run = opts.pop("adaptive_run", True)
        distributed.time_communication(pair, opts.pop("time_comm", False))
        # A reader that stops after two rounds (as a chat user can) leaves every rank ready.
        stream = macspec.stream_generate(pair, prompt, **opts)
        early = [next(stream).emitted for _ in range(2)]
        stream.close()
        # Adaptive K (its calibration runs the sharded target too), then the options given:
        # that last run's cache is the one compared, and its stats are reported.
        again = []
        if adaptive_run:
            events = macspec.stream_generate(pair, prompt, **{**opts, "adaptive": True})
            again = [t for e in events for t in e.emitted]
        stream = macspec.stream_generate(pair, prompt, **opts)
        rounds = list(stream)
        result.update(
            tokens=[t for e in rounds for t in e.emitted],
            again=again,
            early=[t for ids in early for t in ids],
            drafted=stream.stats().drafted,
            accepted=stream.stats().accepted,
            comm_time=sum(e.comm_time for e in rounds),
        )
    link.quit()
    if mode == "caches":
        dump_cache(link, out_dir / "cache_0.npz")
        result["offset"] = link.target.offset
    (out_dir / "result.json").write_text(json.dumps(result))
    return 0


def dump_cache(link: distributed.Link, path: Path) -> None:
    """This rank's KV cache up to its length: keys and values of every layer."""
    target = link.target
    arrays = {}
    for i, c in enumerate(target.cache):
        keys, values = c.keys, c.values
        arrays[f"k{i}"] = np.array(keys[..., : c.offset, :].astype(mx.float32))
        arrays[f"v{i}"] = np.array(values[..., : c.offset, :].astype(mx.float32))
    np.savez(path, offset=target.offset, **arrays)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except macspec.MacspecError as e:  # as the CLI does: a message, no traceback
        print(f"macspec: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
