"""`macspec bench`: every decoding method side by side, on the same prompts, seeds and machine.

Methods: mlx-lm's own plain `generate_step`, mlx-lm's `speculative_generate_step`, macspec with
fixed K, adaptive K, the n-gram drafter, and macspec's plain decoding. `--methods` names exactly
what runs; without it every method runs, except mlx-lm's where its model would take more than a
minute a prompt (opt-in then). Speedups are against mlx-lm plain when it ran, else macspec plain;
the table says which. A method that cannot run here (no draft model, a draft mlx-lm cannot run)
is skipped with the reason in the output, never imitated.

Throughput is measured the same way for every method, from outside: tokens emitted after the
first target pass, over the wall time after it (prefill and the first pass are excluded).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlx.core as mx

from ...api.pair import DRAFT_CONTEXT
from ...api.stream import prompt_ids
from ...base import platform_info as be
from ...base.errors import OptionError
from ..prompts import KINDS, Prompt, with_context
from .lengths import ASKS, LengthRun, format_lengths, length_events
from .llamacpp import LLAMACPP, LlamaCpp, check_vocabulary, unavailable
from .plan import (
    DEFAULT_METHODS,
    METHODS,
    MLX_LM,
    Method,
    baseline,
    load_pairs,
    mlx_lm_step,
    opt_in_reason,
    parse_names,
    parse_numbers,
    plan_methods,
    select_prompts,
)
from .progress import Finished, Note, RunUpdate, StderrProgress
from .report import RunRecord, format_table, loadavg, summarise, write_charts, write_results
from .runner import Runner, nbytes, run_events

REPEATS = 3  # --repeats when not given (--prompt-lengths: LENGTH_REPEATS)
LENGTH_REPEATS = 1  # long prompts are slow: one timed run of each row unless asked

# ------------------------------------------------------------------ the benchmark


def bench(*args: Any, quiet: bool = False, progress: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Run the benchmark (the arguments are `bench_events`'); returns the result dict that is also
    written to OUTPUT/bench.json. `progress` is called with every event (default: lines on
    stderr, none with `quiet`); unless `quiet`, the table is printed at the end."""
    return consume(bench_events(*args, **kwargs), format_table, quiet, progress)


def bench_lengths(
    run: LengthRun,
    output: str | Path | None = None,
    charts: bool = True,
    quiet: bool = False,
    progress: Any = None,
) -> dict[str, Any]:
    """`macspec bench --prompt-lengths` (lengths.py): as `bench`, its table printed unless
    `quiet`; the result also written to OUTPUT/bench.json."""
    return consume(length_events(run, output, charts), format_lengths, quiet, progress)


def consume(
    events: Iterator[Note | RunUpdate | Finished],
    table: Callable[[dict[str, Any]], str],
    quiet: bool = False,
    progress: Any = None,
) -> dict[str, Any]:
    """A mode's events shown as `bench` says; its result, whose `table` is printed unless
    `quiet`."""
    show = progress or (None if quiet else StderrProgress())
    result: dict[str, Any] = {}
    for event in events:
        if show is not None:
            show(event)
        if isinstance(event, Finished):
            result = event.result
    if not quiet:
        print(table(result))
        print("written: " + ", ".join(result["files"]))
    return result


def bench_events(
    target: str | None = None,
    draft: str | None = None,
    prompts: str = "builtin",
    kinds: str | Sequence[str] | None = None,
    per_kind: int = 0,
    max_tokens: int = 128,
    context: int = 0,
    temperature: str | Sequence[float] = "0,0.7",
    num_draft: str | Sequence[int] = "2,4,6",
    tree_nodes: str | Sequence[int] = "4,8",
    adaptive_tree_nodes: int = 0,
    repeats: int = REPEATS,
    methods: str | Sequence[str] | None = None,
    seed: int = 0,
    output: str | Path | None = None,
    charts: bool = True,
    gguf: str | None = None,
    draft_gguf: str | None = None,
    draft_context: int = DRAFT_CONTEXT,
) -> Iterator[Note | RunUpdate | Finished]:
    """The benchmark as a stream of events: notes, each run's progress, then the result.

    `methods`: what runs, exactly (None: every macspec and mlx-lm method, mlx-lm's only where
    one prompt takes them at most OPT_IN_SECONDS). Speedups are against mlx-lm plain when it
    ran, else against macspec plain. llama.cpp's rows (named only) run `gguf` (the file the
    target came from) and `draft_gguf` through xllamacpp."""
    temps = parse_numbers(temperature, "temperature", float, 0, "0,0.7")
    ks = parse_numbers(num_draft, "num_draft", int, 1, "2,4,6")
    trees = parse_numbers(tree_nodes, "tree_nodes", int, 1, "4,8") if tree_nodes != "" else []
    method_names = (
        list(DEFAULT_METHODS) if methods is None else parse_names(methods, METHODS, "methods")
    )
    if max_tokens < 2 or repeats < 1 or context < 0:
        raise OptionError("max_tokens must be >= 2, repeats >= 1 and context >= 0")
    prompt_list = select_prompts(prompts, kinds, per_kind)

    yield Note("loading models ...")
    pairs = load_pairs(target, draft, method_names, draft_context)
    runner = Runner(pairs, max_tokens)
    peers = unavailable(gguf, draft_gguf) if set(method_names) & set(LLAMACPP) else {}
    plan, skipped = plan_methods(method_names, ks, pairs, trees, adaptive_tree_nodes, peers)
    encoded = _encode(prompt_list, pairs["model"], context, max_tokens, skipped)
    plan = yield from _peers(plan, skipped, methods is None, runner, encoded, gguf, draft_gguf)
    yield from (Note(f"skipping {s['method']}: {s['reason']}") for s in skipped)
    yield Note("measuring memory bandwidth ...")
    bandwidth = be.measure_bandwidth()
    records: list[RunRecord] = []
    yield from _measure(runner, plan, encoded, temps, repeats, seed, records)

    settings = dict(
        max_tokens=max_tokens, context=context, temperatures=temps, num_draft=ks,
        tree_nodes=trees, adaptive_tree_nodes=adaptive_tree_nodes, repeats=repeats, seed=seed,
    )  # fmt: skip
    if runner.llamacpp is not None:
        settings["llamacpp"] = runner.llamacpp.describe()
    result = _result(pairs, plan, skipped, records, bandwidth, encoded, settings)
    draw = (lambda out_dir: write_charts(result, out_dir)) if charts else None
    result["files"] = [str(f) for f in write_results(result, output, draw)]
    yield Finished(result)


def _peers(
    plan: list[Method],
    skipped: list[dict[str, str]],
    by_default: bool,
    runner: Runner,
    encoded: list[tuple[Prompt, list[int]]],
    gguf: str | None,
    draft_gguf: str | None,
) -> Generator[Note, None, list[Method]]:
    """The plan without mlx-lm's rows where a default run would find them too slow (added to
    `skipped`), with llama.cpp's servers ready where its rows run."""
    pair = runner.pair
    if by_default and any(m.method in MLX_LM for m in plan):
        yield Note("timing one step of mlx-lm's own model (are its rows quick enough?) ...")
        if reason := opt_in_reason(mlx_lm_step(pair, encoded[0][1][:64]), runner.max_tokens):
            planned = {m.method for m in plan}
            skipped += [{"method": n, "reason": reason} for n in MLX_LM if n in planned]
            plan = [m for m in plan if m.method not in MLX_LM]
    if any(m.method in LLAMACPP for m in plan):
        check_vocabulary(Path(gguf), pair.tokenizer)
        room = max(len(ids) for _, ids in encoded) + runner.max_tokens + 64  # + a round's drafts
        runner.llamacpp = LlamaCpp(gguf, draft_gguf, runner.max_tokens, room)
    return plan


def _result(
    pairs: dict[str, Any],
    plan: list[Method],
    skipped: list[dict[str, str]],
    records: list[RunRecord],
    bandwidth: dict[str, Any],
    encoded: list[tuple[Prompt, list[int]]],
    settings: dict[str, Any],
) -> dict[str, Any]:
    weight_bytes = nbytes(pairs["model"].target)
    # llama.cpp reads its own file's weights, not macspec's
    gguf = settings.get("llamacpp", {}).get("gguf")
    other = dict.fromkeys(LLAMACPP, os.path.getsize(gguf) if gguf else None)
    return {
        "meta": _meta(pairs, bandwidth, weight_bytes, settings, encoded, plan),
        "skipped": skipped,
        "summary": summarise(records, weight_bytes, bandwidth["best"], baseline(plan), other),
        "runs": [asdict(r) for r in records],
    }


def _encode(
    prompt_list: list[Prompt], pair: Any, context: int, max_tokens: int, skipped: list[dict]
) -> list[tuple[Prompt, list[int]]]:
    """Each prompt's ids (after `context` tokens of other questions); those that do not fit the
    model's context are added to `skipped`."""
    encoded = []
    for p in prompt_list:
        if context:  # decode after `context` tokens, like llama-bench -d
            p = with_context(p, lambda q: len(prompt_ids(pair, messages=q.messages)), context)
        ids = prompt_ids(pair, messages=p.messages)
        if len(ids) + max_tokens > pair.context_length:
            reason = f"{len(ids)} prompt tokens + {max_tokens} exceed the context"
            skipped.append({"method": f"prompt {p.name}", "reason": reason})
        else:
            encoded.append((p, ids))
    if not encoded:
        raise OptionError("no prompt fits the model's context: lower --max-tokens")
    return encoded


def _measure(
    runner: Runner,
    plan: list[Method],
    encoded: list[tuple[Prompt, list[int]]],
    temps: list[float],
    repeats: int,
    seed: int,
    records: list[RunRecord],
) -> Iterator[RunUpdate]:
    """Every method of the plan on every prompt at every temperature, `repeats` times, into
    `records`, after one untimed warm-up run of each."""
    # Warm-up: the first call of each method pays one-off set-up costs, so it is not timed.
    for n, m in enumerate(plan, 1):
        rec = RunRecord(m.method, m.label, m.num_draft, "warmup", encoded[0][0].name, 0.0, -1, seed)
        yield from run_events(runner, m, encoded[0][1][:64], rec, "warm-up", n, len(plan))
    total = repeats * len(temps) * len(encoded) * len(plan)
    # Methods interleave per prompt, so drift in machine load hits them all alike.
    for rep in range(repeats):
        for temp in temps:
            for i, (p, ids) in enumerate(encoded):
                run_seed = seed + 1000 * rep + i
                for m in plan:
                    rec = RunRecord(
                        m.method, m.label, m.num_draft, p.kind, p.name, temp, rep, run_seed
                    )
                    yield from run_events(runner, m, ids, rec, "run", len(records) + 1, total)
                    records.append(rec)


def _meta(
    pairs: dict[str, Any],
    bandwidth: dict[str, Any],
    weight_bytes: int,
    settings: dict[str, Any],
    encoded: list[tuple[Prompt, list[int]]],
    plan: list[Method],
) -> dict[str, Any]:
    """What was measured, where and how: the head of bench.json."""
    pair = pairs["model"]
    blas = be.blas_in_use()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target": str(pair.target_path),
        "draft": str(pair.draft_path) if pair.draft_path else None,
        "default_drafter": pairs["default"].drafter_kind if "default" in pairs else None,
        "draft_vocab": pair.draft_vocab,  # ids the draft model's head scores; 0: all
        "backend": be.detect_backend(),
        "device": be.device_name(),
        "blas": blas.describe(),
        "openblas": be.openblas_details() if blas.kind == "openblas" else None,
        "mlx": mx.__version__,
        "bandwidth_gbs": bandwidth["best"],
        "bandwidth": bandwidth,
        "target_weight_bytes": weight_bytes,
        "baseline": baseline(plan),
        **settings,
        "loadavg": loadavg(),
        "kinds": list(dict.fromkeys(p.kind for p, _ in encoded)),
        "prompts": [{"kind": p.kind, "name": p.name, "tokens": len(ids)} for p, ids in encoded],
        "methods": [m.label for m in plan],
    }


def _run(args: argparse.Namespace) -> int:
    if args.serve and args.prompt_lengths:
        raise OptionError("--prompt-lengths and --serve are separate modes: choose one")
    if args.ask is not None and not args.prompt_lengths:
        raise OptionError(
            f"--ask {args.ask}: the request after a long prompt, --prompt-lengths only"
        )
    if args.repeats is None:  # not given: each mode's own default
        args.repeats = LENGTH_REPEATS if args.prompt_lengths else REPEATS
    if args.serve:  # the prompt cache's and the server's own benchmark (bench/serve.py)
        from ...api.pair import load
        from .serve import run

        pair = load(args.target, args.draft)
        run(pair, args.turns, args.max_tokens, args.output, args.repeats)
        return 0
    if args.prompt_lengths:  # long prompts read whole (bench/lengths.py)
        lengths = ",".join(args.prompt_lengths)  # "512 2048" and "512,2048" alike
        run = LengthRun(
            lengths,
            args.target,
            args.draft,
            args.max_tokens,
            args.gguf,
            args.seed,
            args.repeats,
            args.draft_context,
            args.ask or "summary",
        )
        bench_lengths(run, args.output, args.charts, args.quiet)
        return 0
    skip = ("func", "command", "serve", "turns", "prompt_lengths", "ask")
    bench(**{k: v for k, v in vars(args).items() if k not in skip})
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="measure every decoding method side by side (tokens/s, acceptance, ...)"
    )
    p.add_argument(
        "--target", help="target model (directory or store name); default pair if omitted"
    )
    p.add_argument("--draft", help="draft model (directory or store name)")
    p.add_argument("--prompts", default="builtin", help="'builtin' or a file (JSON, JSONL or text)")
    p.add_argument("--kinds", help=f"comma-separated prompt kinds ({', '.join(KINDS)})")
    p.add_argument("--per-kind", type=int, default=0, help="prompts of each kind (0 = all)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--context",
        type=int,
        default=0,
        help="decode after about this many tokens of prompt (other questions precede each one)",
    )
    p.add_argument("--temperature", default="0,0.7", help="comma-separated, e.g. 0,0.7")
    p.add_argument("--num-draft", default="2,4,6", help="draft lengths K, e.g. 2,4,6")
    p.add_argument(
        "--tree-nodes",
        default="4,8",
        help="token trees (depth: the largest K), e.g. 4,8; '' = none",
    )
    p.add_argument(
        "--adaptive-tree-nodes",
        type=int,
        default=0,
        help="let the adaptive row weigh trees of up to this many nodes (0 = chains)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,  # None: not given, so each mode takes its own default (_run)
        help=f"timed runs of each row, reported as medians (default {REPEATS}; "
        f"--prompt-lengths: {LENGTH_REPEATS}, long prompts being slow)",
    )
    p.add_argument(
        "--methods",
        help=f"comma-separated subset of {', '.join(METHODS)}: exactly these run (default: "
        "macspec's and mlx-lm's, mlx-lm's only where they take at most a minute a prompt; "
        "llama.cpp's run only when named, with --gguf and the optional package xllamacpp)",
    )
    p.add_argument("--gguf", help="llama.cpp's rows: the GGUF file the target was converted from")
    p.add_argument("--draft-gguf", help="llamacpp_draft: the draft's GGUF file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--draft-context",
        type=int,
        metavar="N",
        default=DRAFT_CONTEXT,
        help=f"the draft model reads only a prompt's last N ids (default {DRAFT_CONTEXT}; 0: all)",
    )
    p.add_argument("--output", help="directory for bench.json and the charts (default runs/...)")
    p.add_argument("--no-charts", dest="charts", action="store_false")
    p.add_argument("--quiet", action="store_true", help="no progress and no table")
    p.add_argument(
        "--serve",
        action="store_true",
        help="instead: time to first token by conversation turn with and without the prompt "
        "cache, and `macspec serve`'s aggregate tokens/s for 1, 2, 4 and 8 clients verified in "
        "one pass against taking turns (--output: a JSON file)",
    )
    p.add_argument("--turns", type=int, default=8, help="--serve: conversation turns")
    p.add_argument(
        "--prompt-lengths",
        nargs="+",
        metavar="N",
        help="instead: one prompt of exactly N ids per length (Python's own sources and a "
        "request, --ask), read whole by macspec plain and the default, and by "
        "llama.cpp with --gguf: TTFT, prefill and decode tok/s, peak RSS and a chart "
        "(uses --target, --draft, --max-tokens, --repeats, --gguf, --seed, --output, "
        "--no-charts, --quiet)",
    )
    p.add_argument(
        "--ask",
        choices=sorted(ASKS),
        help="--prompt-lengths: the request after the pasted sources: summarize them (new text, "
        "the default) or rewrite the last function with type hints (mostly the file's lines "
        "again)",
    )
    p.set_defaults(func=_run)
