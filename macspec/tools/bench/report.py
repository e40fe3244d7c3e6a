"""`macspec bench`'s results: the record of each run (filled round by round), the summary rows
(speedup against the run's baseline: mlx-lm's plain decoding, else macspec's), the terminal table
and the charts. scripts/bench_readme.py reads the same rows (iter_rows, find_row).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ...api.stream import acceptance_by_position
from ...base.errors import MacspecError
from ..prompts import KINDS

LABELS = {"mlx_lm": "mlx-lm plain", "macspec_plain": "macspec plain"}  # the possible baselines


@dataclass
class RunRecord:
    """One method on one prompt at one temperature, one repeat."""

    method: str
    label: str
    num_draft: int
    kind: str
    prompt: str
    temperature: float
    repeat: int
    seed: int
    tokens: int = 0  # all generated tokens
    decode_tokens: int = 0  # tokens after the first target pass
    decode_time: float = 0.0  # seconds after the first target pass
    passes: int = 0  # target forward passes after the first
    rows: int = 0  # ids those passes verified (a chain's drafts + 1, a tree's nodes + 1)
    drafted: int = 0
    accepted: int = 0
    spec_rounds: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_time: float | None = None  # after the first pass; None when the method cannot tell
    verify_time: float | None = None
    peak_memory: int = 0
    text: str = ""
    first_time: float = 0.0  # seconds from the run's start to its first token: the prompt read


class Recorder:
    """Turns a stream of rounds (accepted drafts, drafted count, emitted count) into a record."""

    def __init__(self, rec: RunRecord):
        self.rec = rec
        self.started = time.perf_counter()  # the run's start: its first token comes after
        self.first_at: float | None = None
        self.last_at = 0.0

    def round(self, emitted: int, drafted: int, accepted: int, now: float, rows: int = 0) -> None:
        rec = self.rec
        rec.tokens += emitted
        if drafted:
            rec.spec_rounds += 1
            rec.drafted += drafted
            rec.accepted += accepted
            while len(rec.drafted_at) < drafted:
                rec.drafted_at.append(0)
                rec.accepted_at.append(0)
            for i in range(drafted):
                rec.drafted_at[i] += 1
                rec.accepted_at[i] += i < accepted
        if self.first_at is None:
            self.first_at = now
            rec.first_time = now - self.started
        else:
            rec.passes += 1
            rec.rows += rows or drafted + 1
            rec.decode_tokens += emitted
        self.last_at = now

    def rate(self, now: float) -> float:
        """Tokens per second after the first target pass, so far."""
        if self.first_at is None or now <= self.first_at:
            return 0.0
        return self.rec.decode_tokens / (now - self.first_at)

    def finish(self) -> None:
        if self.first_at is not None:
            self.rec.decode_time = self.last_at - self.first_at


def iter_rows(
    result: dict[str, Any], temperature: float | None = None, kind: str = "all"
) -> Iterator[dict[str, Any]]:
    """Summary rows of one prompt kind (at one temperature, when given), in table order."""
    return (
        r
        for r in result["summary"]
        if r["kind"] == kind and (temperature is None or r["temperature"] == temperature)
    )


def find_row(
    result: dict[str, Any], temperature: float, label: str, kind: str
) -> dict[str, Any] | None:
    """The summary row of one method (by label) on one kind at one temperature, if measured."""
    return next((r for r in iter_rows(result, temperature, kind) if r["label"] == label), None)


def _median_min_max(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(
    records: list[RunRecord],
    weight_bytes: int,
    bandwidth_gbs: float,
    baseline: str | None = "mlx_lm",
    other_bytes: dict[str, int | None] | None = None,
) -> list[dict[str, Any]]:
    """One row per (temperature, method, kind), kind "all" included; speedup and round cost
    against the `baseline` method (None: no speedups). A row's weights read a second count the
    target's `weight_bytes`, or for a method in `other_bytes` its own (llama.cpp's rows: the
    GGUF file's; None: unknown)."""
    other = other_bytes or {}
    groups: dict[tuple, list[RunRecord]] = {}
    for r in records:
        for kind in (r.kind, "all"):
            groups.setdefault((r.temperature, r.label, kind), []).append(r)
    rows = [
        _row(*key, recs, other.get(recs[0].method, weight_bytes), bandwidth_gbs)
        for key, recs in groups.items()
    ]
    _against_baseline(rows, baseline)
    order = {label: i for i, label in enumerate(dict.fromkeys(rec.label for rec in records))}
    kinds = {k: i for i, k in enumerate([*KINDS, "all"])}
    rows.sort(key=lambda r: (r["temperature"], order[r["label"]], kinds.get(r["kind"], -1)))
    return rows


def _per_repeat(recs: list[RunRecord], count: Any) -> list[float]:
    """One figure per repeat: count(records) over all their time (long answers weigh more)."""
    by_repeat: dict[int, list[RunRecord]] = {}
    for r in recs:
        by_repeat.setdefault(r.repeat, []).append(r)
    return [
        sum(count(r) for r in rs) / t
        for rs in by_repeat.values()
        if (t := sum(r.decode_time for r in rs)) > 0
    ]


def _acceptance(recs: list[RunRecord]) -> dict[str, Any]:
    drafted, accepted = sum(r.drafted for r in recs), sum(r.accepted for r in recs)
    spec_rounds = sum(r.spec_rounds for r in recs)
    return {
        "acceptance_rate": accepted / drafted if drafted else None,
        # Tokens emitted per speculative round: accepted drafts + the target's token.
        "mean_accepted_length": (accepted + spec_rounds) / spec_rounds if spec_rounds else None,
        "per_position_acceptance": acceptance_by_position(
            (r.drafted_at, r.accepted_at) for r in recs
        ),
    }


def _time_split(recs: list[RunRecord]) -> dict[str, float] | None:
    if not all(r.draft_time is not None for r in recs):
        return None
    # A round's window opens when the one before was ready, the decode clock at its event: the
    # first event's own handling can make the windows a hair longer than the clock's total.
    rounds = sum((r.draft_time or 0.0) + (r.verify_time or 0.0) for r in recs)
    total = max(sum(r.decode_time for r in recs), rounds)
    if total <= 0:
        return None
    d = sum(r.draft_time or 0.0 for r in recs) / total
    v = sum(r.verify_time or 0.0 for r in recs) / total
    return {"draft": d, "verify": v, "other": max(0.0, 1.0 - d - v)}


def _row(
    temp: float,
    label: str,
    kind: str,
    recs: list[RunRecord],
    weight_bytes: int | None,
    bandwidth_gbs: float,
) -> dict[str, Any]:
    tok_s = _per_repeat(recs, lambda r: r.decode_tokens)
    passes_s = _per_repeat(recs, lambda r: r.passes)
    first = recs[0]
    passes = sum(r.passes for r in recs)  # 0: unknown (llama.cpp's speculative rows)
    known = passes_s and weight_bytes
    weight_gbs = statistics.median(passes_s) * weight_bytes / 1e9 if known else 0.0
    return {
        "temperature": temp,
        "method": first.method,
        "label": label,
        "num_draft": first.num_draft,
        "kind": kind,
        "runs": len(recs),
        "tokens": sum(r.decode_tokens for r in recs),
        "tok_s": _median_min_max(tok_s) if tok_s else None,
        # the prompt's prefill and the first pass (each run reads its prompt whole)
        "first_token_s": statistics.median(r.first_time for r in recs),
        "speedup": None,
        **_acceptance(recs),
        "time_split": _time_split(recs),
        "peak_memory_bytes": max(r.peak_memory for r in recs),
        "target_passes_per_s": statistics.median(passes_s) if passes_s else 0.0,
        "rows_per_pass": sum(r.rows for r in recs) / passes if passes else None,
        "weight_read_gbs": weight_gbs,
        # None where passes are unknown (llama.cpp's speculative rows)
        "bandwidth_fraction": weight_gbs / bandwidth_gbs if bandwidth_gbs and weight_gbs else None,
    }


def _against_baseline(rows: list[dict[str, Any]], baseline: str | None) -> None:
    """Each row's speedup and round cost against `baseline` at its temperature and kind."""
    base = {
        (r["temperature"], r["kind"]): r["tok_s"]["median"]
        for r in rows
        if r["method"] == baseline and r["tok_s"]
    }
    base_passes = {
        (r["temperature"], r["kind"]): r["target_passes_per_s"]
        for r in rows
        if r["method"] == baseline
    }
    for r in rows:
        b = base.get((r["temperature"], r["kind"]))
        if b and r["tok_s"]:
            r["speedup"] = r["tok_s"]["median"] / b
        # Seconds a round takes (drafting, verification, rewinding) in plain steps.
        bp = base_passes.get((r["temperature"], r["kind"]))
        r["round_cost"] = bp / r["target_passes_per_s"] if bp and r["target_passes_per_s"] else None


def _head(meta: dict[str, Any]) -> str:
    """How many ids the draft model's head scored, when it was pruned."""
    n = meta.get("draft_vocab")
    return f", the draft's head over {n:,} ids" if n else ""


def format_table(result: dict[str, Any]) -> str:
    """The terminal table: one block per temperature, one line per method (all kinds together)."""
    rows, meta = result["summary"], result["meta"]
    kinds = meta["kinds"]
    out = [
        f"target {meta['target']}  draft {meta['draft']}  "
        f"(adaptive uses drafter {meta.get('default_drafter')}{_head(meta)}; {meta['blas']}, "
        f"{meta['bandwidth_gbs']:.1f} GB/s copy bandwidth, target weights "
        f"{meta['target_weight_bytes'] / 1e6:.0f} MB)"
    ]
    if meta.get("context"):
        tokens = [p["tokens"] for p in meta["prompts"]]
        out.append(f"decoding after {min(tokens)}-{max(tokens)} tokens of prompt")
    width = max([26, *(len(r["label"]) + 2 for r in rows)])  # labels such as "(copies<=8)"
    base = baseline_label(meta)
    for temp in meta["temperatures"]:
        out.append(f"\ntemperature {temp}" + (f" (speedup vs {base})" if base else ""))
        head = f"{'method':<{width}}{'tok/s median (min-max)':>25}"
        head += f"{'speedup':>9}{'accept':>8}{'len':>6}{'rows':>6}{'round':>7}"
        head += "".join(f"{k[:8]:>9}" for k in kinds)
        head += f"{'draft/verify/other':>20}{'TTFT s':>8}{'peak MB':>9}{'weights GB/s':>14}"
        out.append(head)
        for r in iter_rows(result, temp):
            ts = r["tok_s"]
            tok = f"{ts['median']:.1f} ({ts['min']:.1f}-{ts['max']:.1f})" if ts else "-"
            line = f"{r['label']:<{width}}{tok:>25}{_fmt(r['speedup'], 'x'):>9}"
            line += (
                f"{_fmt(r['acceptance_rate'], '', 2):>8}{_fmt(r['mean_accepted_length'], '', 2):>6}"
                f"{_fmt(r.get('rows_per_pass'), '', 1):>6}{_fmt(r['round_cost'], 'x'):>7}"
            )
            for k in kinds:
                cell = find_row(result, temp, r["label"], k)
                line += f"{_fmt(cell and cell['speedup'], 'x'):>9}"
            s = r["time_split"]
            split = f"{s['draft']:.0%}/{s['verify']:.0%}/{s['other']:.0%}" if s else "-"
            bw = r["bandwidth_fraction"]
            peak = r["peak_memory_bytes"]  # 0: not measured (llama.cpp's rows)
            line += f"{split:>20}{r.get('first_token_s', 0.0):>8.2f}"
            line += f"{peak / 1e6:>9.0f}" if peak else f"{'-':>9}"
            line += f"{r['weight_read_gbs']:>8.2f} ({bw:.0%})" if bw is not None else f"{'-':>14}"
            out.append(line)
    for s in result["skipped"]:
        out.append(f"skipped {s['method']}: {s['reason']}")
    if base is None:
        out.append("no speedups: neither mlx_lm nor macspec_plain ran (add one to --methods)")
    else:
        out.append(f"speedup per kind and overall: against {base} at the same temperature")
        out.append(f"round: seconds a round takes (draft, verify, rewind), in {base} steps")
    return "\n".join(out)


def baseline_label(meta: dict[str, Any]) -> str | None:
    """The label of the method a run's speedups are against (older runs: mlx-lm's plain)."""
    name = meta.get("baseline", "mlx_lm")
    return LABELS.get(name) if name else None


def _fmt(value: float | None, unit: str, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


# ------------------------------------------------------------------ files and charts


def loadavg() -> str | None:
    # The bench shares the machine with whatever else runs: say how busy it was.
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except (OSError, AttributeError):
        return None


def write_results(
    result: dict[str, Any],
    output: str | Path | None,
    more: Callable[[Path], list[Path]] | None = None,
) -> list[Path]:
    """bench.json and what `more` writes beside it (the charts), into `output` (default
    runs/bench-<time>); the files written."""
    out_dir = (
        Path(output) if output else Path("runs") / datetime.now().strftime("bench-%Y%m%d-%H%M%S")
    )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
        files = [out_dir / "bench.json"]
        if more is not None:
            files += more(out_dir)
    except OSError as e:
        raise MacspecError(f"cannot write the results to {out_dir}: {e}") from None
    return files


def write_charts(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """speedup.png (by method/K and kind) and acceptance.png (by draft position)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [out_dir / "speedup.png", out_dir / "acceptance.png"]
    _speedup_chart(plt, result, paths[0])
    _acceptance_chart(plt, result, paths[1])
    return paths


def _speedup_chart(plt: Any, result: dict[str, Any], path: Path) -> None:
    rows, temps = result["summary"], result["meta"]["temperatures"]
    kinds = [*result["meta"]["kinds"], "all"]
    base = baseline_label(result["meta"])
    fig, axes = plt.subplots(1, len(temps), figsize=(6.5 * len(temps), 4.2), squeeze=False)
    for ax, temp in zip(axes[0], temps, strict=True):
        labels = [
            lab
            for lab in dict.fromkeys(r["label"] for r in rows if r["temperature"] == temp)
            if lab != base
        ]
        width = 0.8 / max(len(labels), 1)
        for i, lab in enumerate(labels):
            ys, spread = [], ([], [])
            for k in kinds:
                cell = find_row(result, temp, lab, k)
                y = cell["speedup"] if cell and cell["speedup"] else 0.0
                ys.append(y)
                # Whiskers: the slowest and fastest repeat against the baseline's median.
                scale = y / cell["tok_s"]["median"] if y else 0.0
                # max(0, ...): with one repeat min == median, and rounding can leave -1e-16.
                spread[0].append(max(0.0, y - cell["tok_s"]["min"] * scale) if y else 0.0)
                spread[1].append(max(0.0, cell["tok_s"]["max"] * scale - y) if y else 0.0)
            xs = [x + i * width for x in range(len(kinds))]
            ax.bar(xs, ys, width, label=lab, color=f"C{i}")
            if any(spread[0]) or any(spread[1]):
                ax.errorbar(xs, ys, yerr=spread, fmt="none", ecolor="black", lw=0.8, capsize=2)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(kinds))], kinds)
        ax.set_ylabel(f"speedup vs {base}" if base else "no baseline run")
        ax.set_title(f"temperature {temp}")
    # One legend under the plots, where it hides no bar.
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 3), fontsize=8)
    rows_of_legend = -(-len(names) // 3)
    fig.tight_layout(rect=(0, 0.06 * rows_of_legend, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _acceptance_chart(plt: Any, result: dict[str, Any], path: Path) -> None:
    rows, temps = result["summary"], result["meta"]["temperatures"]
    fig, axes = plt.subplots(1, len(temps), figsize=(6.5 * len(temps), 4.2), squeeze=False)
    for ax, temp in zip(axes[0], temps, strict=True):
        for r in iter_rows(result, temp):
            if acc := r["per_position_acceptance"]:
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["label"])
        width = max((len(r["per_position_acceptance"]) for r in rows), default=1)
        ax.set_xticks(range(1, width + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted | drafted)")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"acceptance by position, temperature {temp}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
