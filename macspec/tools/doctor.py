"""`macspec doctor`: backend, device, BLAS, memory bandwidth and advice for this machine."""

from __future__ import annotations

import argparse
import json as jsonlib
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..base import platform_info as be
from ..base import switches
from ..core import caches, hooks
from ..core.adaptive import AdaptiveK
from ..core.policy import Costs
from ..core.sampling import SamplingOptions, distribution, sample
from ..core.target import hidden_states, output_head


def row_cost_ratio(size: int = 2048, rows: int = 8) -> float:
    """Time of a ``rows``-row float32 product over a 1-row one: ~1 means verification is cheap."""
    # Small products: many repeats, keep the best, so a busy machine disturbs the ratio less.
    one = be.measure_matmul_gflops(size, rows=1, repeats=12)
    many = be.measure_matmul_gflops(size, rows=rows, repeats=12)
    return rows * one / many


def diagnose() -> dict[str, Any]:
    import mlx.core as mx

    backend = be.detect_backend()
    blas = be.blas_in_use()
    memory = be.total_memory_bytes()
    bandwidth = be.measure_bandwidth()
    report: dict[str, Any] = {
        "backend": backend,
        "device": be.device_name(),
        "cpu_count": os.cpu_count(),
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", "?"),
        "blas": blas.kind,
        "blas_path": blas.path,
        "openblas": be.openblas_details() if blas.kind == "openblas" else None,
        "openblas_coretype_env": os.environ.get("OPENBLAS_CORETYPE") or None,
        "cpu_avx512": be.cpu_has_avx512(),
        # `import macspec` loads OpenBLAS before mlx: what this process got, any script gets too
        "blas_loaded_by_macspec": str(be.LOADED) if be.LOADED else None,
        "blas_not_loaded_reason": be.NOT_LOADED_REASON,
        "memory_gb": round(memory / 1e9, 1) if memory else None,
        "bandwidth_gbs": {k: round(v, 2) for k, v in bandwidth.items()},
        "matmul_gflops": round(be.measure_matmul_gflops(1024), 1),
        "rows8_over_rows1": round(row_cost_ratio(), 2),
    }
    fmt = be.choose_weight_format(135_000_000, backend=backend, blas=blas, memory_bytes=memory)
    report["weight_format"] = {"dtype": fmt.dtype, "reason": fmt.reason}
    report["layer_kernels"] = layer_kernels() if backend == "cpu" else "mlx's own mx.fast kernels"
    report["native_products"] = native_products() if backend == "cpu" else None
    report["switches"] = switch_report()
    report["advice"] = advice(report)
    return report


def _shown(value: Any) -> str:
    return {True: "on", False: "off", None: "default"}.get(value, str(value))


def switch_report() -> list[dict[str, Any]]:
    """Every MACSPEC_* switch: its text here, its value (or why it is refused) and meaning."""
    rows = [
        {
            "name": s.switch.name,
            "set": s.raw,
            "value": None if s.error else _shown(s.value),
            "error": s.error,
            "meaning": s.switch.meaning,
            "read": "at import" if s.switch.at_import else "when used",
        }
        for s in switches.settings()
    ]
    return rows + [
        {"name": n, "set": text, "value": None, "error": "no switch has this name"}
        for n, text in switches.unknown().items()
    ]


def layer_kernels() -> str:
    """Which of macspec's CPU layer kernels run: native primitives, or whole-array mlx ops."""
    from ..cpu import blocks, kernels, products
    from ..cpu.state import STATE

    if kernels.native_layers() is not None:
        fused = (
            "a llama/qwen2 layer as two primitives"
            if blocks.enabled() and products.active()
            else f"one primitive each ({switches.NATIVE_BLOCKS} or products off)"
        )
        return (
            f"macspec's native ones (RMS norm, SwiGLU, RoPE, attention; any number of rows, "
            f"each with the bits it gets alone; {fused})"
        )
    why = STATE.ext_reason or f"{switches.NATIVE_LAYERS} is off"
    return f"macspec's table RoPE, attention and SwiGLU as mlx ops (native ones off: {why})"


def native_products() -> str:
    """Whether the weight products of a few rows run macspec's native kernels (built on first
    use), and on how many threads."""
    from ..cpu import native, products
    from ..cpu.state import STATE

    ext = native.load()
    if ext is None:
        return f"off: {STATE.ext_reason}; mlx's own products (BLAS, scalar quantized)"
    if not products.enabled():
        off = f"{switches.NATIVE_PRODUCTS} is off"
        return f"off: {off}; mlx's own products (BLAS, scalar quantized)"
    repacked = STATE.int8_activations and STATE.repack_weights and ext.q4_packs()
    return f"in use ({ext.threads()} threads; float32 and 4/8-bit, any number of rows" + (
        "; 4-bit weights in groups of 64 repacked at load)" if repacked else ")"
    )


def advice(report: dict[str, Any]) -> list[str]:
    notes: list[str] = []
    if report["backend"] != "cpu":
        return ["GPU backend: nothing to do; 4-bit targets are the fast choice here."]
    if report["blas"] not in ("openblas", "mkl", "blis", "accelerate"):
        if be.find_openblas() is None:
            notes.append(
                f"float32 products use the {report['blas']} BLAS (10-30x slower): install OpenBLAS,"
                f" e.g. `apt-get install {be.OPENBLAS_PACKAGE}`; macspec then loads it itself."
            )
        elif switches.NO_BLAS_PRELOAD.value():
            notes.append(f"OpenBLAS is installed but {switches.NO_BLAS_PRELOAD} is on: unset it.")
        else:
            reason = report.get("blas_not_loaded_reason") or "mlx was imported first"
            notes.append(
                f"OpenBLAS is installed but not in use ({reason}): import macspec before mlx, "
                f"or start Python with LD_PRELOAD={be.find_openblas()}."
            )
    core = (report.get("openblas") or {}).get("core", "")
    forced = report.get("openblas_coretype_env")
    if forced and report.get("cpu_avx512") and core.lower() not in be.AVX512_OPENBLAS_CORES:
        # The figure in the note: docs/cpu.md, "figures behind the code".
        notes.append(
            f"OPENBLAS_CORETYPE={forced} forces OpenBLAS's {core} kernels on a CPU with AVX-512: "
            "unset it and OpenBLAS picks its AVX-512 kernels (a SmolLM2-135M float32 step on a "
            "Zen 5 EPYC: 46 ms forced to Haswell, 38 ms with them)."
        )
    if report["rows8_over_rows1"] > 4:
        notes.append("an 8-row product costs >4x a 1-row one: speculation cannot pay off here.")
    in_use = str(report.get("native_products", ""))
    if not notes and in_use.startswith("in use"):
        notes.append(
            "fine: with macspec's native products a 4-bit or 8-bit target steps faster than "
            "float32 (fewer bytes to read)"
            + (
                "; its 4-bit layers are repacked: passes grow slowly with the rows verified."
                if "repacked" in in_use
                else ", though its passes grow faster with the rows verified."
            )
        )
    if not notes:
        notes.append("fine: float32 targets with the optimized BLAS are the fast choice here.")
    return notes


def scripts_line(report: dict[str, Any]) -> str:
    """What a Python script gets: this process imported macspec before mlx, as a script should."""
    if report["backend"] != "cpu" or report["blas"] == "accelerate":
        return "the same backend as the command"
    if report["blas_loaded_by_macspec"]:
        return (
            f"`import macspec` before mlx gives {report['blas']} too; mlx imported first keeps "
            "mlx's reference BLAS (macspec warns with the remedy)"
        )
    return f"{report['blas']}, as here"


def format_report(report: dict[str, Any]) -> str:
    bw = report["bandwidth_gbs"]
    blas = report["blas"] + (f" ({report['blas_path']})" if report["blas_path"] else "")
    if report.get("openblas"):
        blas += f", {report['openblas']['core']} kernels, {report['openblas']['threads']} threads"
    if report["blas_loaded_by_macspec"]:
        blas += " [loaded by import macspec]"
    lines = [
        f"backend        {report['backend']}",
        f"device         {report['device']} ({report['cpu_count']} CPUs, {report['platform']})",
        f"mlx            {report['mlx']} (Python {report['python']})",
        f"BLAS           {blas}",
        f"scripts        {scripts_line(report)}",
        f"memory         {report['memory_gb']} GB",
        f"bandwidth      {bw['best']:.1f} GB/s copy (mlx copy {bw['mlx']:.1f} GB/s)",
        f"matmul f32     {report['matmul_gflops']:.0f} GFLOP/s (1024x1024)",
        f"8 rows/1 row   {report['rows8_over_rows1']:.2f}x the time (near 1 = cheap verification)",
        f"weights        {report['weight_format']['dtype']}: {report['weight_format']['reason']}",
        f"layer kernels  {report['layer_kernels']}",
        f"products       {report.get('native_products') or 'mlx'}",
    ]
    if "verify_cost" in report:
        v = report["verify_cost"]
        costs = ", ".join(f"{n}: {ms} ms ({v['ratio'][n]}x)" for n, ms in v["ms"].items())
        lines.append(f"tokens/pass    {costs}  [{v['model']}]")
        split = ", ".join(
            f"{n}: {t['layers']} + {t['head']} ms" for n, t in v.get("split_ms", {}).items()
        )
        if split:
            lines.append(f"layers + head  {split}")
        for n, parts in v.get("breakdown_ms", {}).items():
            where = ", ".join(f"{p} {ms}" for p, ms in parts.items())
            lines.append(f"{n} token{'s' if n != '1' else ' '} (ms)  {where}")
        lines += [f"policy         {line}" for line in v.get("policy", [])]
        if "floor_ms" in v:
            lines.append(
                f"floor          {v['floor_ms']} ms: {v['weights_mb']} MB of weights at "
                f"{v['bandwidth_gbs']} GB/s; products {v['native']}"
            )
    for row in report.get("switches", []):
        shown = " (unset)" if row["set"] is None else f"={row['set']}"
        value = f"refused: {row['error']}" if row["error"] else row["value"]
        read = " (read at import)" if row.get("read") == "at import" else ""
        lines.append(f"switch         {row['name']}{shown} -> {value}{read}")
        if row.get("meaning"):
            lines.append(f"                 {row['meaning']}")
    lines += [f"advice         {note}" for note in report["advice"]]
    return "\n".join(lines)


def _layer_products(model: Any, head: Any) -> list[tuple[Any, int]]:
    """(module, input width) of every weight product of the decoder layers (not the head)."""
    import mlx.nn as nn

    found = []
    for _, m in model.named_modules():
        if m is head:
            continue
        if isinstance(m, nn.QuantizedLinear):
            # groups a row: the scales' (N, groups), or repacked weights' (N / 16, groups, ...)
            # (repacked scales may be factored, with more rows: cpu/products.py)
            groups = m.weight.shape[1] if m.weight.ndim == 3 else m.scales.shape[1]
            found.append((m, groups * m.group_size))
        elif isinstance(m, nn.Linear):
            found.append((m, m.weight.shape[1]))
    return found


class _PassTimes:
    """The best times, by (part, rows), of one target pass over n new ids and of its parts
    (verify_costs), after a `context`-id prompt."""

    PARTS = ("pass", "serial", "layers", "head", "build", "products", "head_alone", "sample")

    def __init__(self, pair: Any, rows: tuple[int, ...], context: int) -> None:
        self.pair, self.target, self.rows, self.context = pair, pair.target, rows, context
        target = self.target
        # The split needs an mlx-lm decoder's layout (`model.model`, a tied or untied head);
        # other models (multimodal wrappers such as qwen3_5's) get the pass times alone.
        trunk = getattr(target, "model", None)
        args = getattr(target, "args", None)
        self.split = hasattr(trunk, "embed_tokens") and hasattr(args, "hidden_size")
        head = (getattr(target, "lm_head", None) or trunk.embed_tokens) if self.split else None
        self.products = _layer_products(target, head) if self.split else []
        # an input embedding apart from the head is looked up, not read whole
        apart = self.split and head is not trunk.embed_tokens
        self.looked_up = trunk.embed_tokens if apart else None
        self.width = target.args.hidden_size if self.split else 0
        self.cache = caches.make_cache(target, max(rows))
        ids = [(7 * i) % max(pair.vocab_size - 1, 1) + 1 for i in range(context)]
        with caches.forward(self.cache, context):
            mx.eval(target(mx.array([ids]), cache=self.cache))
        self.best = {(part, n): float("inf") for part in self.PARTS for n in rows}
        # Inputs of every product width, per row count, for timing the products alone.
        widths = {k for _, k in self.products} | {self.width}
        self.inputs = {n: {k: mx.ones((1, n, k)) for k in widths} for n in rows}
        mx.eval(self.inputs if self.split else [])

    def keep(self, part: str, n: int, rep: int, seconds: float) -> None:
        if rep:  # the first round warms up
            self.best[part, n] = min(self.best[part, n], seconds)

    def timed(self, part: str, n: int, rep: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        mx.eval(out)
        self.keep(part, n, rep, time.perf_counter() - start)
        return out

    def run(self, repeats: int) -> None:
        """Variants interleaved, `repeats` times after a warm-up round."""
        for rep in range(repeats + 1):
            for n in self.rows:
                logits = self.passes(n, rep)
                if self.split:
                    self.parts_alone(n, rep, logits)

    def passes(self, n: int, rep: int) -> mx.array:
        """The pass; split in layers and head; built whole, then evaluated. Each is taken back
        as a rejected round's would be (recurrent layers keep their records): the pass time
        includes what rewinding costs the next one."""
        target, cache, x = self.target, self.cache, mx.array([[1] * n])
        with caches.forward(cache, n, rewindable=True):
            logits = self.timed("pass", n, rep, target, x, cache=cache)
        caches.rewind(cache, self.context)
        if not self.split:
            return logits
        with caches.forward(cache, n, rewindable=True):
            h = self.timed("layers", n, rep, hidden_states, target, x[0], cache)
        self.timed("head", n, rep, output_head, target, h)
        caches.rewind(cache, self.context)
        # Graph building timed alone: the layers that start evaluating early are held back.
        with hooks.serial(), caches.forward(cache, n, rewindable=True):
            start = time.perf_counter()
            lazy = target(x, cache=cache)
            self.keep("build", n, rep, time.perf_counter() - start)
            mx.eval(lazy)
            self.keep("serial", n, rep, time.perf_counter() - start)
        caches.rewind(cache, self.context)
        return logits

    def parts_alone(self, n: int, rep: int, logits: mx.array) -> None:
        """The layers' products and the head on inputs of the same shapes, and the greedy
        choice of the next id."""
        ones, products = self.inputs[n], self.products
        self.timed("products", n, rep, lambda xs: [m(xs[k]) for m, k in products], ones)
        self.timed("head_alone", n, rep, output_head, self.target, ones[self.width][0])
        last = logits[0, -1:, : self.pair.vocab_size]
        greedy, key = SamplingOptions(), mx.random.key(0)
        self.timed("sample", n, rep, lambda v: sample(distribution(v, greedy), key).item(), last)

    def breakdown(self, ms: dict) -> dict[str, dict[str, float]]:
        """Per row count, in ms: the parts timed alone; the rest of the pass built whole (never
        below 0); and what evaluating during the build saves against it."""
        out = {}
        for n in self.rows if self.split else ():
            timed_alone = ms["build", n] + ms["products", n] + ms["head_alone", n]
            out[str(n)] = {
                "build": ms["build", n],
                "layer products": ms["products", n],
                "head": ms["head_alone", n],
                "rest": round(max(ms["serial", n] - timed_alone, 0.0), 2),
                "sample": ms["sample", n],
                "overlap saves": round(max(ms["serial", n] - ms["pass", n], 0.0), 2),
                "built whole": ms["serial", n],
            }
        return out


def verify_costs(
    model: str, rows: tuple[int, ...] = (1, 2, 3, 5, 8), context: int = 128, repeats: int = 8
) -> dict[str, Any]:
    """Time of one target forward pass over n new tokens, after a `context`-token prompt.

    A pass over K+1 tokens verifies K drafts: the closer its cost is to one token's, the more
    speculation pays. Where the time goes: Python building the graph, the weight products of
    the decoder layers and of the output head (each timed alone, same rows, same weights), the
    rest of the evaluation (attention, norms, elementwise ops, one dispatch per op), and, for a
    plain step, choosing the token (greedy) and reading it back. Variants interleave and the
    minimum is kept, so other load disturbs less."""
    import macspec

    pair = macspec.load(model)
    times = _PassTimes(pair, rows, context)
    times.run(repeats)
    best = times.best
    one = best["pass", rows[0]]
    weights = sum(v.nbytes for _, v in tree_flatten(pair.target.parameters()))
    if times.looked_up is not None:
        weights -= sum(v.nbytes for _, v in tree_flatten(times.looked_up.parameters()))
    ms = {k: round(v * 1000, 2) for k, v in best.items()}
    bandwidth = be.measure_bandwidth()["best"]
    return {
        "model": str(pair.target_path),
        "ms": {str(n): ms["pass", n] for n in rows},
        "ratio": {str(n): round(best["pass", n] / one, 2) for n in rows},
        "split_ms": {
            str(n): {p: ms[p, n] for p in ("layers", "head")} for n in rows if times.split
        },
        "breakdown_ms": times.breakdown(ms),
        "weights_mb": round(weights / 1e6, 1),
        "bandwidth_gbs": round(bandwidth, 1),
        # the step if every weight byte a pass reads were read once at the measured bandwidth
        "floor_ms": round(weights / (bandwidth * 1e9) * 1000, 2),
        "native": native_products(),
    }


def policy_lines(ms: dict[str, float], rates: tuple[float, ...] = (0.3, 0.6, 0.9)) -> list[str]:
    """What the adaptive policy chooses with these passes (ms by tokens a pass) for drafts that
    cost nothing to make (a long match's copy) accepted at each rate, and why (its Decision)."""
    times = {int(n): t / 1000 for n, t in ms.items()}
    plain = times.pop(1)
    verify = tuple((n - 1, t) for n, t in sorted(times.items()))
    costs = Costs(plain_step=plain, draft_step=0.0, extra=0.0, verify=verify)
    lines = []
    for rate in rates:
        policy = AdaptiveK(k_max=max(times, default=2) - 1, costs=costs, priors={16: rate})
        lines.append(f"at {rate:.0%}: {policy.decide(16)}")
    return lines


BREAKDOWN_COLORS = {
    "build": "#9e9e9e",
    "layer products": "#1f77b4",
    "head": "#6baed6",
    "rest": "#ff7f0e",
    "sample": "#2ca02c",
}


def write_chart(costs: dict[str, Any], path: str) -> None:
    """A stacked bar per row count: where one pass goes, against the bandwidth floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(costs["breakdown_ms"])
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 2.2))
    for i, n in enumerate(rows):
        left = 0.0
        for part, value in costs["breakdown_ms"][n].items():
            if part not in BREAKDOWN_COLORS:
                continue
            label = part if i == 0 else None
            ax.barh(i, value, left=left, color=BREAKDOWN_COLORS[part], label=label)
            left += value
        ax.text(left + 0.3, i, f"{costs['ms'][n]:.1f} ms", va="center", fontsize=8)
    floor = costs["floor_ms"]
    ax.axvline(floor, color="black", linestyle="--", linewidth=1)
    ax.text(floor, len(rows) - 0.4, f" weights at {costs['bandwidth_gbs']} GB/s", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{n} token{'s' if n != '1' else ''}" for n in rows])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds (build and products timed alone; rest = whole-built pass - those)")
    state = "in use" if costs["native"].startswith("in use") else "off"
    ax.set_title(f"One forward pass of {Path(costs['model']).name} (native products {state})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=5, fontsize=8, frameon=False)
    # bbox_inches: the legend below and the labels past the bars, whatever the rows (a
    # tight_layout could not fit them for one or two row counts)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def doctor(json: bool = False, model: str | None = None, chart: str | None = None) -> int:
    report = diagnose()
    if model:
        report["verify_cost"] = verify_costs(model)
        report["verify_cost"]["policy"] = policy_lines(report["verify_cost"]["ms"])
        if chart and report["verify_cost"]["breakdown_ms"]:
            write_chart(report["verify_cost"], chart)
        elif chart:
            note = f"macspec: no chart: {model} is not laid out as an mlx-lm decoder"
            print(note, file=sys.stderr)
    print(jsonlib.dumps(report, indent=2) if json else format_report(report))
    sys.stdout.flush()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("doctor", help="show backend, BLAS, memory bandwidth and advice")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--model", help="also time one forward pass of this target over 1, 2, 3, 5 and 8 tokens"
    )
    p.add_argument("--chart", help="with --model: draw where a pass goes into this PNG file")
    p.set_defaults(func=lambda args: doctor(json=args.json, model=args.model, chart=args.chart))
