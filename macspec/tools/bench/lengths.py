"""`macspec bench --prompt-lengths 512 2048 4096`: long prompts, each read whole.

For each length, one prompt of exactly that many ids: Python's own argparse, collections, shutil
and subprocess sources cut to the length, then a request (the same ids for the same Python and
tokenizer): to summarize them (`summary`, new text), or to rewrite the last function with type
hints (`edit`, mostly the file's own lines again, where n-gram copies from the prompt pay).
macspec plain and the default (speculative, adaptive K, the pair's own draft context) decode it
greedily with the prompt cache emptied first, and llama.cpp decodes the same ids from the GGUF
file with --gguf and the optional package xllamacpp. Every row is timed from outside, as `macspec
bench`'s others: the time to the first token (TTFT), prompt ids over TTFT (prefill tok/s), tokens
after the first over the time after it (decode tok/s); and the process's peak RSS during the row
(rss.py). Each row runs `repeats` times (the methods taking turns at each length) and reports the
medians, the TTFT's and decode tok/s's ranges and the largest peak RSS. docs/benchmarks.md,
"Long prompts".
"""

from __future__ import annotations

import argparse
import collections
import logging
import platform
import shutil
import statistics
import subprocess
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlx.core as mx

from ...api.options import GenerationOptions
from ...api.pair import DRAFT_CONTEXT
from ...base import platform_info as be
from ...base.errors import OptionError
from ...cpu.state import STATE
from .llamacpp import LlamaCpp, check_vocabulary, unavailable
from .plan import Method, load_pairs, parse_numbers, plan_methods
from .progress import Finished, Note, RunUpdate
from .report import RunRecord, loadavg, write_results
from .rss import peak_rss, reset_peak, resident
from .runner import Runner, run_events

SOURCES = (argparse, collections, shutil, subprocess)  # the pasted file, in this order
# The requests after the pasted file (--ask): a summary is new text; an edit repeats the file's
# lines, as a coding assistant's answers do.
ASKS = {
    "summary": "\n\nSummarize what the code above does, in a few sentences.\n",
    "edit": "\n\nRewrite the last complete function above with type hints added to its signature. "
    "Reply with the whole function only.\n",
}
PLAIN = Method("macspec_plain")
DEFAULT = Method("macspec_adaptive", GenerationOptions().num_draft)  # as generate() drafts
PEER = Method("llamacpp_plain")
NAMES = {PLAIN.method: "plain", DEFAULT.method: "default", PEER.method: "llama.cpp plain"}
RATIOS = ("ttft_default_over_plain", "decode_default_over_plain", "prefill_plain_over_llamacpp")
WARM_IDS = 64  # the warm-up's prompt: the first ids of the shortest one
EACH = ("ttft_s", "prefill_tok_s", "decode_tok_s", "tokens", "acceptance_rate", "peak_rss_bytes")


@dataclass(frozen=True)
class LengthRun:
    """What `macspec bench --prompt-lengths` runs."""

    lengths: str | Sequence[int]  # prompt ids: "512,2048" or [512, 2048]
    target: str | None = None  # default: the embedded default pair
    draft: str | None = None
    max_tokens: int = 128
    gguf: str | None = None  # llama.cpp's rows: the GGUF file the target was converted from
    seed: int = 0
    repeats: int = 1  # timed runs of each row (long prompts are slow: one unless asked)
    draft_context: int = DRAFT_CONTEXT  # the ids of a prompt's end a draft model reads (0: all)
    ask: str = "summary"  # the request after the pasted file: a key of ASKS


def source_ids(tokenizer: Any) -> list[int]:
    """The pasted file's ids: the four modules' sources one after another."""
    text = "".join(Path(m.__file__).read_text(encoding="utf-8") for m in SOURCES)
    # Longer than any context on purpose (only its first ids are used): no warning about it.
    said = logging.getLogger("transformers.tokenization_utils_base")
    level = said.level
    said.setLevel(logging.ERROR)
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    finally:
        said.setLevel(level)


def length_prompt(source: list[int], ask: list[int], n: int) -> list[int]:
    """A prompt of exactly `n` ids: the source's first ids, then the request `ask`."""
    if not len(ask) < n <= len(source) + len(ask):
        raise OptionError(
            f"invalid prompt length {n}: between {len(ask) + 1} (the request to summarize takes "
            f"{len(ask)} ids) and {len(source) + len(ask)} (the source's ids and the request)"
        )
    return source[: n - len(ask)] + ask


def check_lengths(lengths: list[int], context: int, max_tokens: int) -> None:
    """OptionError for a length whose prompt and answer do not fit the target's context."""
    for n in lengths:
        if n + max_tokens > context:
            raise OptionError(
                f"invalid prompt length {n}: with {max_tokens} tokens to generate it exceeds the "
                f"target's context of {context} ids"
            )


def length_events(
    run: LengthRun, output: str | Path | None = None, charts: bool = True
) -> Iterator[Note | RunUpdate | Finished]:
    """The mode as `macspec bench`'s stream of events: notes, each run's progress, the result
    (also written to OUTPUT: bench.json, lengths.md and, with `charts`, lengths.png)."""
    lengths = parse_numbers(run.lengths, "prompt_lengths", int, 1, "512,2048,4096")
    if run.max_tokens < 2:
        raise OptionError(f"invalid max_tokens={run.max_tokens}: at least 2")
    if not isinstance(run.repeats, int) or run.repeats < 1:
        raise OptionError(f"invalid repeats={run.repeats!r}: an integer, at least 1")
    if run.ask not in ASKS:
        raise OptionError(f"invalid ask={run.ask!r}: one of {', '.join(ASKS)}")
    yield Note("loading models ...")
    pairs = load_pairs(run.target, run.draft, [PLAIN.method, DEFAULT.method], run.draft_context)
    pair = pairs["model"]
    check_lengths(lengths, pair.context_length, run.max_tokens)
    source = source_ids(pair.tokenizer)
    ask = list(pair.tokenizer.encode(ASKS[run.ask], add_special_tokens=False))
    prompts = [length_prompt(source, ask, n) for n in lengths]
    names = [PLAIN.method, DEFAULT.method, PEER.method]
    peers = unavailable(run.gguf, None)
    plan, skipped = plan_methods(names, [DEFAULT.num_draft], pairs, unavailable=peers)
    runner = Runner(pairs, run.max_tokens)
    if any(m.method == PEER.method for m in plan):
        check_vocabulary(Path(run.gguf), pair.tokenizer)
        room = max(lengths) + run.max_tokens + 64  # as the bench's: a round's drafts past the end
        runner.llamacpp = LlamaCpp(run.gguf, None, run.max_tokens, room)
    yield from (Note(f"skipping {s['method']}: {s['reason']}") for s in skipped)

    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}  # (ids, method): each repeat's
    done, total = 0, len(lengths) * len(plan) * run.repeats
    # macspec's rows first, then llama.cpp's: its server, in this process, keeps the model and
    # its cache resident and would count in every later macspec row's peak RSS.
    for group in ([m for m in plan if m.method != PEER.method], [m for m in plan if m == PEER]):
        if group:
            warm = min(prompts, key=len)[:WARM_IDS]
            yield from _warm_up(runner, group, warm, run.seed)
        # At each length the methods take turns, repeat by repeat (plain, default, plain, ...):
        # drift in the machine's load hits them alike.
        for ids in prompts:
            for rep in range(run.repeats):
                for m in group:
                    done += 1
                    one = yield from _timed(runner, m, ids, rep, (done, total), run.seed)
                    runs.setdefault((len(ids), m.method), []).append(one)
    rows = [_row(n, method, each) for (n, method), each in runs.items()]
    rows.sort(key=lambda r: (lengths.index(r["ids"]), names.index(r["method"])))
    result = {
        "meta": _meta(pairs, runner, run, lengths),
        "skipped": skipped,
        "rows": rows,
        "ratios": ratios(rows),
    }
    result["files"] = [str(f) for f in write_results(result, output, _files(result, charts))]
    yield Finished(result)


def _warm_up(runner: Runner, group: list[Method], ids: list[int], seed: int) -> Iterator[RunUpdate]:
    # The first run of each method pays one-off costs (compiling, the adaptive policy's
    # measurements, llama.cpp's load): an untimed one first.
    for n, m in enumerate(group, 1):
        rec = RunRecord(m.method, m.label, m.num_draft, "warmup", f"{len(ids)} ids", 0.0, -1, seed)
        yield from run_events(runner, m, ids, rec, "warm-up", n, len(group))


def _timed(
    runner: Runner, m: Method, ids: list[int], rep: int, count: tuple[int, int], seed: int
) -> Generator[RunUpdate, None, dict[str, Any]]:
    """One method on one prompt, repeat `rep` (`count`: its place among the runs), measured."""
    rec = RunRecord(m.method, m.label, m.num_draft, "lengths", f"{len(ids)} ids", 0.0, rep, seed)
    reset = reset_peak()
    start = resident()
    yield from run_events(runner, m, ids, rec, "run", *count)
    peak = peak_rss(reset)
    ttft = rec.first_time
    return {
        "ttft_s": ttft,
        "prefill_tok_s": len(ids) / ttft if ttft else None,
        "decode_tok_s": rec.decode_tokens / rec.decode_time if rec.decode_time else None,
        "tokens": rec.tokens,
        "acceptance_rate": rec.accepted / rec.drafted if rec.drafted else None,
        "peak_rss_bytes": peak.bytes,
        "peak_rss_scope": peak.scope,
        "rss_at_start_bytes": start,
        "mlx_peak_bytes": rec.peak_memory or None,  # MLX's own count (macspec's rows)
        "text": rec.text,
    }


def _row(ids: int, method: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row of the table from its repeats: medians, the TTFT's and decode tok/s's [min, max],
    the largest peak RSS; the answer (greedy: the same each time) and the RSS before, the
    first's. `each`: every repeat's own figures, in order."""
    first = runs[0]
    mlx_peaks = [r["mlx_peak_bytes"] for r in runs if r["mlx_peak_bytes"]]
    return {
        "ids": ids,
        "method": method,
        "label": NAMES[method],
        "repeats": len(runs),
        "ttft_s": _median(runs, "ttft_s"),
        "ttft_range": _range(runs, "ttft_s"),
        "prefill_tok_s": _median(runs, "prefill_tok_s"),
        "decode_tok_s": _median(runs, "decode_tok_s"),
        "decode_tps_range": _range(runs, "decode_tok_s"),
        "tokens": first["tokens"],
        "acceptance_rate": _median(runs, "acceptance_rate"),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
        "peak_rss_scope": first["peak_rss_scope"],
        "rss_at_start_bytes": first["rss_at_start_bytes"],
        "mlx_peak_bytes": max(mlx_peaks) if mlx_peaks else None,
        "text": first["text"],
        "each": [{k: r[k] for k in EACH} for r in runs],
    }


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def _range(runs: list[dict[str, Any]], key: str) -> list[float] | None:
    values = [r[key] for r in runs if r[key] is not None]
    return [min(values), max(values)] if values else None


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per length: the default's TTFT and decode tok/s over plain's, and macspec plain's prefill
    tok/s over llama.cpp's (None where a row is missing)."""
    out = []
    for n in dict.fromkeys(r["ids"] for r in rows):
        by = {r["method"]: r for r in rows if r["ids"] == n}
        plain, default, peer = (by.get(m.method) for m in (PLAIN, DEFAULT, PEER))
        over = ((default, plain, "ttft_s"), (default, plain, "decode_tok_s"))
        over += ((plain, peer, "prefill_tok_s"),)
        out.append({"ids": n, **{k: _ratio(*p) for k, p in zip(RATIOS, over, strict=True)}})
    return out


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if a is None or b is None or not a[key] or not b[key]:
        return None
    return a[key] / b[key]


def _meta(
    pairs: dict[str, Any], runner: Runner, run: LengthRun, lengths: list[int]
) -> dict[str, Any]:
    """What was measured, where and how: the head of bench.json."""
    pair, default = pairs["model"], pairs.get("default")
    blas = be.blas_in_use()
    return {
        "mode": "prompt_lengths",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target": str(pair.target_path),
        "draft": str(pair.draft_path) if pair.draft_path else None,
        "default_drafter": default.drafter_kind if default is not None else None,
        "draft_context": default.draft_context if default is not None else None,  # 0: all ids
        "backend": be.detect_backend(),
        "device": be.device_name(),
        "blas": blas.describe(),
        # what the CPU layers' KV caches hold, as read at import (Metal, CUDA: the model's dtype)
        "kv_cache": str(STATE.kv_dtype).rsplit(".", 1)[-1]
        if be.detect_backend() == "cpu"
        else None,
        "mlx": mx.__version__,
        "python": platform.python_version(),  # its sources are the prompts
        "ask": run.ask,
        "prompt": f"{', '.join(m.__name__ for m in SOURCES)} sources, then "
        f"{ASKS[run.ask].strip()!r}",
        "lengths": lengths,
        "max_tokens": run.max_tokens,
        "temperature": 0.0,
        "seed": run.seed,
        "repeats": run.repeats,
        "llamacpp": runner.llamacpp.describe() if runner.llamacpp is not None else None,
        "loadavg": loadavg(),
    }


# ------------------------------------------------------------------ the report and the chart


def format_lengths(result: dict[str, Any]) -> str:
    """The rows and the ratios as markdown tables, printed and written to lengths.md."""
    meta = result["meta"]
    window, drafter = meta["draft_context"], meta["default_drafter"]
    reads = f"the draft reads a prompt's last {window} ids" if window else "the draft reads all"
    default = f"the default: {drafter}, {reads}" if drafter else "no draft model"
    kv = f"; {meta['kv_cache']} KV cache" if meta.get("kv_cache") else ""
    out = [
        f"target {meta['target']}  draft {meta['draft']}  ({default}; {meta['blas']}{kv}; Python "
        f"{meta['python']}'s sources, then the {meta.get('ask', 'summary')} request; "
        f"{meta['max_tokens']} tokens, greedy)",
        "",
        "| ids | method | TTFT s | prefill tok/s | decode tok/s | peak RSS MiB |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        ttft = _spread(r["ttft_s"], r.get("ttft_range"), r.get("repeats", 1), 2)
        decode = _spread(r["decode_tok_s"], r.get("decode_tps_range"), r.get("repeats", 1), 2)
        out.append(
            f"| {r['ids']:,} | {r['label']} | {ttft} | {_fmt(r['prefill_tok_s'], 1)} | "
            f"{decode} | {r['peak_rss_bytes'] / 2**20:,.0f} |"
        )
    out += [
        "",
        "| ids | default TTFT / plain | default decode / plain | plain prefill / llama.cpp |",
        "|---:|---:|---:|---:|",
    ]
    for q in result["ratios"]:
        cells = " | ".join(_fmt(q[k], 2, "x") for k in RATIOS)
        out.append(f"| {q['ids']:,} | {cells} |")
    scopes = {r["peak_rss_scope"] for r in result["rows"]}
    repeats = meta.get("repeats", 1)
    out += [
        "",
        "TTFT: to the first token, the whole prompt read (prompt cache emptied); prefill: prompt "
        "ids / TTFT; decode: tokens after the first over the time after it.",
    ]
    if repeats > 1:
        out.append(
            f"{repeats} repeats a row, the methods taking turns at each length: medians, "
            "(min-max) beside TTFT and decode; peak RSS: the largest."
        )
    out += [
        f"peak RSS: the whole process's ({', '.join(sorted(scopes))}): models loaded for the "
        "other rows count too (macspec's in llama.cpp's rows, which run last).",
    ]
    out += [f"skipped {s['method']}: {s['reason']}" for s in result["skipped"]]
    return "\n".join(out)


def _fmt(value: float | None, digits: int, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.{digits}f}{unit}"


def _spread(value: float | None, span: list[float] | None, repeats: int, digits: int) -> str:
    """A median, with its repeats' min-max when there were several: "7.20 (6.90-7.60)"."""
    if repeats < 2 or value is None or not span:
        return _fmt(value, digits)
    return f"{_fmt(value, digits)} ({_fmt(span[0], digits)}-{_fmt(span[1], digits)})"


def _files(result: dict[str, Any], charts: bool) -> Callable[[Path], list[Path]]:
    def write(out_dir: Path) -> list[Path]:
        (out_dir / "lengths.md").write_text(format_lengths(result) + "\n")
        files = [out_dir / "lengths.md"]
        if charts:
            files.append(write_chart(result, out_dir / "lengths.png"))
        return files

    return write


def write_chart(result: dict[str, Any], path: Path) -> Path:
    """TTFT and decode tok/s against the prompt's ids, a line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, label in enumerate(dict.fromkeys(r["label"] for r in rows)):
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["ids"])
        xs = [r["ids"] for r in mine]
        for ax, key in zip(axes, ("ttft_s", "decode_tok_s"), strict=True):
            ys = [r[key] if r[key] is not None else float("nan") for r in mine]
            ax.plot(xs, ys, marker="o", label=label, color=f"C{i}")
    axes[0].set(xlabel="prompt ids", ylabel="seconds", title="time to the first token")
    axes[1].set(xlabel="prompt ids", ylabel="tokens/s", title="decoding after the prompt")
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.set_xticks(sorted({r["ids"] for r in rows}))
    # One legend under the plots, where it hides no point.
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
