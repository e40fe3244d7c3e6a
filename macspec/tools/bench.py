"""`macspec bench`: every decoding method side by side, on the same prompts, seeds and machine.

Methods: mlx-lm's own plain `generate_step` (the baseline), mlx-lm's `speculative_generate_step`,
macspec with fixed K, adaptive K, the n-gram drafter, and macspec's plain decoding. A method the
loaded engine does not support is skipped with the reason in the output, never imitated.

Throughput is measured the same way for every method, from outside: tokens emitted after the
first target pass, over the wall time after it (prefill and the first pass are excluded).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import MacspecError, ModelError, OptionError
from .prompts import KINDS, builtin_prompts, load_prompts, render

METHODS = ("mlx_lm", "mlx_lm_spec", "macspec", "macspec_adaptive", "macspec_ngram", "macspec_plain")
BASELINE = "mlx_lm"
_NEEDS_DRAFT = ("mlx_lm_spec", "macspec", "macspec_adaptive")
_PER_K = ("mlx_lm_spec", "macspec", "macspec_ngram")


@dataclass(frozen=True)
class Method:
    method: str
    num_draft: int = 0  # K; 0 for plain decoding

    @property
    def label(self) -> str:
        names = {
            "mlx_lm": "mlx-lm plain",
            "mlx_lm_spec": "mlx-lm spec",
            "macspec": "macspec",
            "macspec_adaptive": "macspec adaptive",
            "macspec_ngram": "macspec n-gram",
            "macspec_plain": "macspec plain",
        }
        name = names[self.method]
        if self.method in ("macspec_adaptive", "macspec_ngram"):  # the engine's adaptive K;
            from ..engine.policy import COPY_FACTOR  # n-gram copies may run longer

            return f"{name} K<={self.num_draft} (copies<={COPY_FACTOR * self.num_draft})"
        return f"{name} K={self.num_draft}" if self.method in _PER_K else name


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
    drafted: int = 0
    accepted: int = 0
    spec_rounds: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_time: float | None = None  # after the first pass; None when the method cannot tell
    verify_time: float | None = None
    peak_memory: int = 0
    text: str = ""


class _Counter:
    """Turns a stream of rounds (accepted drafts, drafted count, emitted count) into a record."""

    def __init__(self, rec: RunRecord):
        self.rec = rec
        self.first_at: float | None = None
        self.last_at = 0.0

    def round(self, emitted: int, drafted: int, accepted: int, now: float) -> None:
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
        else:
            rec.passes += 1
            rec.decode_tokens += emitted
        self.last_at = now

    def finish(self) -> None:
        if self.first_at is not None:
            self.rec.decode_time = self.last_at - self.first_at


# ------------------------------------------------------------------ running one method


class Runner:
    """Holds the loaded pairs and runs one method on one prompt.

    `pairs`: "model" (the draft model alone: mlx-lm's methods, macspec fixed K and plain),
    "default" (macspec's own default drafting: adaptive K), "ngram" (no draft model)."""

    def __init__(self, pairs: dict[str, Any], max_tokens: int):
        self.pairs = pairs
        self.pair = pairs["model"]
        self.max_tokens = max_tokens
        import macspec

        params = inspect.signature(macspec.stream_generate).parameters
        self.has_adaptive = "adaptive" in params

    def pair_for(self, method: str) -> Any:
        return self.pairs[
            {"macspec_adaptive": "default", "macspec_ngram": "ngram"}.get(method, "model")
        ]

    def run(self, m: Method, prompt_ids: list[int], temperature: float, seed: int, rec: RunRecord):
        import mlx.core as mx

        # Other methods' pairs stay loaded: count this method's weights plus what the run added.
        resident = mx.get_active_memory()
        mx.reset_peak_memory()
        counter = _Counter(rec)
        if m.method in ("mlx_lm", "mlx_lm_spec"):
            from ..engine import kernels

            # mlx-lm's rows run the models as mlx-lm loads them, without macspec's CPU kernels.
            with kernels.stock(self.pair.target, self.pair.draft):
                self._mlx_lm(m, prompt_ids, temperature, seed, counter)
        else:
            self._macspec(m, prompt_ids, temperature, seed, counter)
        counter.finish()
        pair = self.pair_for(m.method)
        weights = _nbytes(pair.target)
        if m.method in (*_NEEDS_DRAFT,) and pair.draft is not None:
            weights += _nbytes(pair.draft)
        rec.peak_memory = int(mx.get_peak_memory() - resident + weights)

    def _macspec(self, m: Method, ids: list[int], temperature: float, seed: int, c: _Counter):
        import macspec

        pair = self.pair_for(m.method)
        opts: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": temperature,
            "seed": seed,
            "num_draft": max(m.num_draft, 1),
            "speculative": m.method != "macspec_plain",
        }
        if self.has_adaptive and m.method in ("macspec", "macspec_adaptive"):
            opts["adaptive"] = m.method == "macspec_adaptive"
        draft = verify = 0.0
        first = True
        for ev in macspec.stream_generate(pair, ids, **opts):
            c.round(
                len(ev.emitted),
                len(ev.accepted) + len(ev.rejected),
                len(ev.accepted),
                time.perf_counter(),
            )
            if not first:
                draft += ev.draft_time
                verify += ev.verify_time
            first = False
            c.rec.text += ev.text
        c.rec.draft_time, c.rec.verify_time = draft, verify

    def _mlx_lm(self, m: Method, ids: list[int], temperature: float, seed: int, c: _Counter):
        import mlx.core as mx
        from mlx_lm.generate import generate_step, speculative_generate_step
        from mlx_lm.sample_utils import make_sampler

        mx.random.seed(seed)
        prompt = mx.array(ids, mx.uint32)
        sampler = make_sampler(temp=temperature)
        eos = set(self.pair.eos_token_ids)
        detok = self.pair.tokenizer.detokenizer
        detok.reset()
        if m.method == "mlx_lm":
            steps = generate_step(
                prompt, self.pair.target, max_tokens=self.max_tokens, sampler=sampler
            )
            for token, _ in steps:
                token = int(token)
                if token in eos:
                    c.round(0, 0, 0, time.perf_counter())
                    break
                detok.add_token(token)
                c.round(1, 0, 0, time.perf_counter())
        else:
            steps = speculative_generate_step(
                prompt,
                self.pair.target,
                self.pair.draft,
                num_draft_tokens=m.num_draft,
                max_tokens=self.max_tokens,
                sampler=sampler,
            )
            # mlx-lm yields a round's accepted drafts (from_draft=True) then the target's token.
            run = emitted = 0
            for token, _, from_draft in steps:
                token = int(token)
                stop = token in eos
                if not stop:
                    detok.add_token(token)
                    emitted += 1
                if from_draft:
                    run += 1
                if not from_draft or stop:
                    drafted = min(m.num_draft, max(self.max_tokens - c.rec.tokens - 1, 1))
                    c.round(emitted, drafted, run, time.perf_counter())
                    run = emitted = 0
                if stop:
                    break
            if emitted:  # max_tokens reached inside a round of accepted drafts
                c.round(emitted, m.num_draft, run, time.perf_counter())
        detok.finalize()
        c.rec.text = detok.text


# ------------------------------------------------------------------ summarising


def _median_min_max(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(
    records: list[RunRecord], weight_bytes: int, bandwidth_gbs: float
) -> list[dict[str, Any]]:
    """One row per (temperature, method, kind), kind "all" included; speedup vs mlx-lm plain."""
    rows: list[dict[str, Any]] = []
    groups: dict[tuple, list[RunRecord]] = {}
    for r in records:
        for kind in (r.kind, "all"):
            groups.setdefault((r.temperature, r.label, kind), []).append(r)
    for (temp, label, kind), recs in groups.items():
        by_repeat: dict[int, list[RunRecord]] = {}
        for r in recs:
            by_repeat.setdefault(r.repeat, []).append(r)
        # One figure per repeat: all this kind's tokens over all its time (long answers weigh more).
        tok_s = [
            sum(r.decode_tokens for r in rs) / t
            for rs in by_repeat.values()
            if (t := sum(r.decode_time for r in rs)) > 0
        ]
        passes_s = [
            sum(r.passes for r in rs) / t
            for rs in by_repeat.values()
            if (t := sum(r.decode_time for r in rs)) > 0
        ]
        drafted, accepted = sum(r.drafted for r in recs), sum(r.accepted for r in recs)
        spec_rounds = sum(r.spec_rounds for r in recs)
        width = max((len(r.drafted_at) for r in recs), default=0)
        at_d = [sum(r.drafted_at[i] for r in recs if i < len(r.drafted_at)) for i in range(width)]
        at_a = [sum(r.accepted_at[i] for r in recs if i < len(r.accepted_at)) for i in range(width)]
        total = sum(r.decode_time for r in recs)
        split = None
        if all(r.draft_time is not None for r in recs) and total > 0:
            d = sum(r.draft_time or 0.0 for r in recs) / total
            v = sum(r.verify_time or 0.0 for r in recs) / total
            split = {"draft": d, "verify": v, "other": max(0.0, 1.0 - d - v)}
        first = recs[0]
        weight_gbs = statistics.median(passes_s) * weight_bytes / 1e9 if passes_s else 0.0
        rows.append(
            {
                "temperature": temp,
                "method": first.method,
                "label": label,
                "num_draft": first.num_draft,
                "kind": kind,
                "runs": len(recs),
                "tokens": sum(r.decode_tokens for r in recs),
                "tok_s": _median_min_max(tok_s) if tok_s else None,
                "speedup": None,
                "acceptance_rate": accepted / drafted if drafted else None,
                # Tokens emitted per speculative round: accepted drafts + the target's token.
                "mean_accepted_length": (accepted + spec_rounds) / spec_rounds
                if spec_rounds
                else None,
                "per_position_acceptance": [a / d for a, d in zip(at_a, at_d, strict=True) if d],
                "time_split": split,
                "peak_memory_bytes": max(r.peak_memory for r in recs),
                "target_passes_per_s": statistics.median(passes_s) if passes_s else 0.0,
                "weight_read_gbs": weight_gbs,
                "bandwidth_fraction": weight_gbs / bandwidth_gbs if bandwidth_gbs else None,
            }
        )
    base = {
        (r["temperature"], r["kind"]): r["tok_s"]["median"]
        for r in rows
        if r["method"] == BASELINE and r["tok_s"]
    }
    base_passes = {
        (r["temperature"], r["kind"]): r["target_passes_per_s"]
        for r in rows
        if r["method"] == BASELINE
    }
    for r in rows:
        b = base.get((r["temperature"], r["kind"]))
        if b and r["tok_s"]:
            r["speedup"] = r["tok_s"]["median"] / b
        # Seconds a round takes (drafting, verification, rewinding) in plain steps.
        bp = base_passes.get((r["temperature"], r["kind"]))
        r["round_cost"] = bp / r["target_passes_per_s"] if bp and r["target_passes_per_s"] else None
    order = {label: i for i, label in enumerate(dict.fromkeys(rec.label for rec in records))}
    kinds = {k: i for i, k in enumerate([*KINDS, "all"])}
    rows.sort(key=lambda r: (r["temperature"], order[r["label"]], kinds.get(r["kind"], -1)))
    return rows


def format_table(result: dict[str, Any]) -> str:
    """The terminal table: one block per temperature, one line per method (all kinds together)."""
    rows, meta = result["summary"], result["meta"]
    kinds = [k for k in meta["kinds"]]
    out = [
        f"target {meta['target']}  draft {meta['draft']}  "
        f"(adaptive uses drafter {meta.get('default_drafter')}; {meta['blas']}, "
        f"{meta['bandwidth_gbs']:.1f} GB/s copy bandwidth, target weights "
        f"{meta['target_weight_bytes'] / 1e6:.0f} MB)"
    ]
    width = max([26, *(len(r["label"]) + 2 for r in rows)])  # labels such as "(copies<=8)"
    for temp in meta["temperatures"]:
        out.append(f"\ntemperature {temp}")
        head = f"{'method':<{width}}{'tok/s median (min-max)':>25}"
        head += f"{'speedup':>9}{'accept':>8}{'len':>6}{'round':>7}"
        head += "".join(f"{k[:8]:>9}" for k in kinds)
        head += f"{'draft/verify/other':>20}{'peak MB':>9}{'weights GB/s':>14}"
        out.append(head)
        for r in rows:
            if r["temperature"] != temp or r["kind"] != "all":
                continue
            ts = r["tok_s"]
            tok = f"{ts['median']:.1f} ({ts['min']:.1f}-{ts['max']:.1f})" if ts else "-"
            line = f"{r['label']:<{width}}{tok:>25}{_fmt(r['speedup'], 'x'):>9}"
            line += (
                f"{_fmt(r['acceptance_rate'], '', 2):>8}{_fmt(r['mean_accepted_length'], '', 2):>6}"
                f"{_fmt(r['round_cost'], 'x'):>7}"
            )
            for k in kinds:
                cell = next(
                    (
                        x
                        for x in rows
                        if x["temperature"] == temp and x["label"] == r["label"] and x["kind"] == k
                    ),
                    None,
                )
                line += f"{_fmt(cell and cell['speedup'], 'x'):>9}"
            s = r["time_split"]
            split = f"{s['draft']:.0%}/{s['verify']:.0%}/{s['other']:.0%}" if s else "-"
            bw = r["bandwidth_fraction"]
            line += f"{split:>20}{r['peak_memory_bytes'] / 1e6:>9.0f}"
            line += f"{r['weight_read_gbs']:>8.2f} ({bw:.0%})" if bw is not None else f"{'-':>14}"
            out.append(line)
    for s in result["skipped"]:
        out.append(f"skipped {s['method']}: {s['reason']}")
    out.append("speedup per kind and overall: against mlx-lm plain at the same temperature")
    out.append("round: seconds a round takes (draft, verify, rewind), in mlx-lm plain steps")
    return "\n".join(out)


def _fmt(value: float | None, unit: str, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


# ------------------------------------------------------------------ charts


def write_charts(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """speedup.png (by method/K and kind) and acceptance.png (by draft position)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, temps = result["summary"], result["meta"]["temperatures"]
    kinds = [*result["meta"]["kinds"], "all"]
    paths = []
    fig, axes = plt.subplots(1, len(temps), figsize=(6.5 * len(temps), 4.2), squeeze=False)
    for ax, temp in zip(axes[0], temps, strict=True):
        labels = [
            lab
            for lab in dict.fromkeys(r["label"] for r in rows if r["temperature"] == temp)
            if not lab.startswith("mlx-lm plain")
        ]
        width = 0.8 / max(len(labels), 1)
        for i, lab in enumerate(labels):
            ys, spread = [], ([], [])
            for k in kinds:
                cell = next(
                    (
                        r
                        for r in rows
                        if r["temperature"] == temp and r["label"] == lab and r["kind"] == k
                    ),
                    None,
                )
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
        ax.set_ylabel("speedup vs mlx-lm plain")
        ax.set_title(f"temperature {temp}")
    # One legend under the plots, where it hides no bar.
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 3), fontsize=8)
    rows_of_legend = -(-len(names) // 3)
    fig.tight_layout(rect=(0, 0.06 * rows_of_legend, 1, 1))
    paths.append(out_dir / "speedup.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(temps), figsize=(6.5 * len(temps), 4.2), squeeze=False)
    for ax, temp in zip(axes[0], temps, strict=True):
        for r in rows:
            if r["temperature"] == temp and r["kind"] == "all" and r["per_position_acceptance"]:
                acc = r["per_position_acceptance"]
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["label"])
        width = max((len(r["per_position_acceptance"]) for r in rows), default=1)
        ax.set_xticks(range(1, width + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted | drafted)")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"acceptance by position, temperature {temp}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "acceptance.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# ------------------------------------------------------------------ the benchmark


def _numbers(value: Any, name: str, cast: type, minimum: float, example: str) -> list:
    """A comma-separated string, one number or a sequence, as a list of `cast` >= `minimum`."""
    kind = "integers" if cast is int else "numbers"
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (int, float)):
        items = [value]
    else:
        items = list(value)
    try:
        out = [cast(x) for x in items]
        if any(float(x) != y for x, y in zip(items, out, strict=True)):
            raise ValueError  # 2.5 is not an integer: refuse rather than truncate
    except ValueError:
        raise OptionError(f"invalid {name}={value!r}: expected {kind} like {example}") from None
    if not out or any(x < minimum for x in out):
        raise OptionError(f"invalid {name}={value!r}: expected {kind} >= {minimum}")
    return out


def _names(value: str | Sequence[str] | None, allowed: Sequence[str], name: str) -> list[str]:
    if value is None:
        return list(allowed)
    items = [x.strip() for x in value.split(",")] if isinstance(value, str) else list(value)
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise OptionError(f"invalid {name}={value!r}: choose from {', '.join(allowed)}")
    return items


def _nbytes(module: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def _has_drafter(pair: Any) -> bool:
    return pair.draft is not None or getattr(pair, "drafter_factory", None) is not None


def load_pairs(
    target: str | None, draft: str | None, methods: list[str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The pairs the methods need, and why a pair could not be had (method -> reason)."""
    import macspec

    kw_ok = "drafter" in inspect.signature(macspec.load).parameters
    reasons: dict[str, str] = {}
    try:
        base = (
            macspec.load(target, draft, drafter="model") if kw_ok else macspec.load(target, draft)
        )
    except ModuleNotFoundError as e:  # no embedded default pair in this build yet
        raise ModelError(f"no default pair available ({e}): name one with --target") from None
    pairs = {"model": base}
    if "macspec_adaptive" in methods:
        try:
            pairs["default"] = macspec.load(target, draft)
        except OptionError as e:
            reasons["macspec_adaptive"] = str(e)
    if "macspec_ngram" in methods:
        try:
            pairs["ngram"] = macspec.load(str(base.target_path), drafter="ngram")
        except (OptionError, TypeError) as e:
            reasons["macspec_ngram"] = f"this engine has no n-gram drafter yet ({e})"
    return pairs, reasons


def plan_methods(
    methods: list[str],
    ks: list[int],
    pairs: dict[str, Any],
    reasons: dict[str, str],
    has_adaptive: bool,
) -> tuple[list[Method], list[dict[str, str]]]:
    """The runs to make, and the methods that cannot run here with the reason."""
    base = pairs["model"]
    why: dict[str, str] = dict(reasons)
    if not _has_drafter(base):
        for name in ("mlx_lm_spec", "macspec"):
            why.setdefault(name, "no draft model loaded (use --draft)")
    elif base.draft is None:
        why.setdefault("mlx_lm_spec", f"the draft ({base.drafter_kind}) is not a model mlx-lm runs")
    elif "recurrent" in {**base.cache_kinds, **base.draft_cache_kinds}:
        why.setdefault(
            "mlx_lm_spec", "mlx-lm refuses speculation on recurrent layers (ArraysCache)"
        )
    if "default" in pairs and not _has_drafter(pairs["default"]):
        why.setdefault("macspec_adaptive", "no draft model loaded (use --draft)")
    if not has_adaptive:
        why.setdefault("macspec_adaptive", "this engine has no adaptive=... option yet")
    plan: list[Method] = []
    skipped: list[dict[str, str]] = []
    for name in methods:
        if name in why:
            skipped.append({"method": name, "reason": why[name]})
        elif name in _PER_K:
            plan += [Method(name, k) for k in ks]
        elif name == "macspec_adaptive":
            plan.append(Method(name, max(ks)))
        else:
            plan.append(Method(name))
    if BASELINE not in methods:
        plan.insert(0, Method(BASELINE))  # every speedup is against it
    return plan, skipped


def _loadavg() -> str | None:
    # The bench shares the machine with whatever else runs: say how busy it was.
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except (OSError, AttributeError):
        return None


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench(
    target: str | None = None,
    draft: str | None = None,
    prompts: str = "builtin",
    kinds: str | Sequence[str] | None = None,
    per_kind: int = 0,
    max_tokens: int = 128,
    temperature: str | Sequence[float] = "0,0.7",
    num_draft: str | Sequence[int] = "2,4,6",
    repeats: int = 3,
    methods: str | Sequence[str] | None = None,
    seed: int = 0,
    output: str | Path | None = None,
    charts: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """Run the benchmark; returns the result dict that is also written to OUTPUT/bench.json."""
    import mlx.core as mx

    import macspec

    from .. import backend as be

    temps = _numbers(temperature, "temperature", float, 0, "0,0.7")
    ks = _numbers(num_draft, "num_draft", int, 1, "2,4,6")
    method_names = _names(methods, METHODS, "methods")
    if max_tokens < 2 or repeats < 1:
        raise OptionError("max_tokens must be >= 2 and repeats >= 1")
    if prompts == "builtin":
        kind_list = _names(kinds, KINDS, "kinds")
        prompt_list = builtin_prompts(kind_list, per_kind)
    else:
        prompt_list = load_prompts(prompts)
        wanted = _names(kinds, sorted({p.kind for p in prompt_list}), "kinds") if kinds else None
        prompt_list = [p for p in prompt_list if wanted is None or p.kind in wanted]
        if per_kind > 0:
            prompt_list = [
                p
                for i, p in enumerate(prompt_list)
                if sum(q.kind == p.kind for q in prompt_list[:i]) < per_kind
            ]
    say = (lambda msg: None) if quiet else _progress

    say("loading models ...")
    pairs, reasons = load_pairs(target, draft, method_names)
    pair = pairs["model"]
    runner = Runner(pairs, max_tokens)
    plan, skipped = plan_methods(method_names, ks, pairs, reasons, runner.has_adaptive)
    for s in skipped:
        say(f"skipping {s['method']}: {s['reason']}")

    weight_bytes = _nbytes(pair.target)
    say("measuring memory bandwidth ...")
    bandwidth = be.measure_bandwidth()
    blas = be.blas_in_use()
    encoded = []
    for p in prompt_list:
        ids = macspec.api._encode(pair, render(pair.tokenizer, p.text))
        if len(ids) + max_tokens > pair.context_length:
            reason = f"{len(ids)} prompt tokens + {max_tokens} exceed the context"
            skipped.append({"method": f"prompt {p.name}", "reason": reason})
            say(f"skipping prompt {p.name}: {reason}")
        else:
            encoded.append((p, ids))
    if not encoded:
        raise OptionError("no prompt fits the model's context: lower --max-tokens")
    kind_order = list(dict.fromkeys(p.kind for p, _ in encoded))

    # Warm-up: the first call of each method pays one-off set-up costs, so it is not timed.
    say("warming up ...")
    for m in plan:
        rec = RunRecord(m.method, m.label, m.num_draft, "warmup", "", 0.0, -1, seed)
        runner.run(m, encoded[0][1][:64], 0.0, seed, rec)

    records: list[RunRecord] = []
    total = repeats * len(temps) * len(encoded) * len(plan)
    done = 0
    # Methods interleave per prompt, so drift in machine load hits them all alike.
    for rep in range(repeats):
        for temp in temps:
            for i, (p, ids) in enumerate(encoded):
                run_seed = seed + 1000 * rep + i
                for m in plan:
                    rec = RunRecord(
                        m.method, m.label, m.num_draft, p.kind, p.name, temp, rep, run_seed
                    )
                    runner.run(m, ids, temp, run_seed, rec)
                    records.append(rec)
                    done += 1
                    rate = rec.decode_tokens / rec.decode_time if rec.decode_time else 0.0
                    say(
                        f"[{done}/{total}] T={temp} {m.label:<22} {p.name:<12} rep {rep + 1}: "
                        f"{rec.tokens} tokens, {rate:.1f} tok/s"
                    )

    result: dict[str, Any] = {
        "meta": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "target": str(pair.target_path),
            "draft": str(pair.draft_path) if pair.draft_path else None,
            "default_drafter": getattr(pairs.get("default"), "drafter_kind", None),
            "backend": be.detect_backend(),
            "device": be.device_name(),
            "blas": blas.describe(),
            "openblas": be.openblas_details() if blas.kind == "openblas" else None,
            "mlx": getattr(mx, "__version__", "?"),
            "bandwidth_gbs": bandwidth["best"],
            "bandwidth": bandwidth,
            "target_weight_bytes": weight_bytes,
            "max_tokens": max_tokens,
            "temperatures": temps,
            "num_draft": ks,
            "repeats": repeats,
            "seed": seed,
            "loadavg": _loadavg(),
            "kinds": kind_order,
            "prompts": [{"kind": p.kind, "name": p.name, "tokens": len(ids)} for p, ids in encoded],
            "methods": [m.label for m in plan],
        },
        "skipped": skipped,
        "summary": summarise(records, weight_bytes, bandwidth["best"]),
        "runs": [asdict(r) for r in records],
    }
    out_dir = (
        Path(output) if output else Path("runs") / datetime.now().strftime("bench-%Y%m%d-%H%M%S")
    )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
        files = [out_dir / "bench.json"]
        if charts:
            files += write_charts(result, out_dir)
    except OSError as e:
        raise MacspecError(f"cannot write the results to {out_dir}: {e}") from None
    result["files"] = [str(f) for f in files]
    if not quiet:
        print(format_table(result))
        print("written: " + ", ".join(result["files"]))
    return result


def _run(args: argparse.Namespace) -> int:
    kwargs = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    bench(**kwargs)
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
    p.add_argument("--temperature", default="0,0.7", help="comma-separated, e.g. 0,0.7")
    p.add_argument("--num-draft", default="2,4,6", help="draft lengths K, e.g. 2,4,6")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="directory for bench.json and the charts (default runs/...)")
    p.add_argument("--no-charts", dest="charts", action="store_false")
    p.add_argument("--quiet", action="store_true", help="no progress and no table")
    p.set_defaults(func=_run)


def iter_rows(result: dict[str, Any], kind: str = "all") -> Iterator[dict[str, Any]]:
    """Summary rows of one prompt kind, in table order (for scripts/bench_readme.py)."""
    return (r for r in result["summary"] if r["kind"] == kind)
