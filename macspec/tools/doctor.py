"""`macspec doctor`: backend, device, BLAS, memory bandwidth and advice for this machine."""

from __future__ import annotations

import argparse
import json as jsonlib
import os
import platform
import sys
from typing import Any

from .. import backend as be


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
    report["layer_kernels"] = (
        "macspec's (table RoPE, attention, SwiGLU with a compiled exp; llama/qwen2 layers)"
        if backend == "cpu"
        else "mlx's own mx.fast kernels"
    )
    report["advice"] = advice(report)
    return report


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
        elif os.environ.get(be.OPT_OUT_ENV, "") not in ("", "0"):
            notes.append(f"OpenBLAS is installed but {be.OPT_OUT_ENV} is set: unset it.")
        else:
            reason = report.get("blas_not_loaded_reason") or "mlx was imported first"
            notes.append(
                f"OpenBLAS is installed but not in use ({reason}): import macspec before mlx, "
                f"or start Python with LD_PRELOAD={be.find_openblas()}."
            )
    core = (report.get("openblas") or {}).get("core", "")
    forced = report.get("openblas_coretype_env")
    if forced and report.get("cpu_avx512") and core.lower() not in be.AVX512_OPENBLAS_CORES:
        # Measured on a 2-core AMD EPYC (Zen 5): SmolLM2-135M float32, one token 46 ms with the
        # Haswell kernels, 38 ms with the Cooperlake ones OpenBLAS picks itself.
        notes.append(
            f"OPENBLAS_CORETYPE={forced} forces OpenBLAS's {core} kernels on a CPU with AVX-512: "
            "unset it and OpenBLAS picks its AVX-512 kernels (a SmolLM2-135M float32 step on a "
            "Zen 5 EPYC: 46 ms forced to Haswell, 38 ms with them)."
        )
    if report["rows8_over_rows1"] > 4:
        notes.append("an 8-row product costs >4x a 1-row one: speculation cannot pay off here.")
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
    lines += [f"advice         {note}" for note in report["advice"]]
    return "\n".join(lines)


def verify_costs(
    model: str, rows: tuple[int, ...] = (1, 2, 3, 5, 8), context: int = 128, repeats: int = 8
) -> dict[str, Any]:
    """Time of one target forward pass over n new tokens, after a `context`-token prompt.

    A pass over K+1 tokens verifies K drafts: the closer its cost is to one token's, the more
    speculation pays. Where the time goes: the same pass split into the decoder layers and the
    output head (the vocabulary-wide product, often the largest single matrix). Variants
    interleave and the minimum is kept, so other load disturbs less."""
    import time

    import mlx.core as mx

    import macspec

    from ..engine import caches
    from ..engine.round import hidden_states, output_head

    pair = macspec.load(model)
    target = pair.target
    cache = caches.make_cache(target, max(rows))
    prompt = mx.array([[(7 * i) % max(pair.vocab_size - 1, 1) + 1 for i in range(context)]])
    with caches.forward(cache, context):
        mx.eval(target(prompt, cache=cache))
    parts = ("pass", "layers", "head")
    best = {(part, n): float("inf") for part in parts for n in rows}

    def timed(part: str, n: int, rep: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        mx.eval(out)
        if rep:  # the first round warms up
            best[part, n] = min(best[part, n], time.perf_counter() - start)
        return out

    for rep in range(repeats + 1):
        for n in rows:
            x = mx.array([[1] * n])
            # Passes are taken back as a rejected round would be (recurrent layers keep their
            # records); the pass time includes what rewinding costs the next one.
            with caches.forward(cache, n, rewindable=True):
                timed("pass", n, rep, target, x, cache=cache)
            caches.rewind(cache, context)
            with caches.forward(cache, n, rewindable=True):
                h = timed("layers", n, rep, hidden_states, target, x[0], cache)
            timed("head", n, rep, output_head, target, h)
            caches.rewind(cache, context)
    one = best["pass", rows[0]]
    return {
        "model": str(pair.target_path),
        "ms": {str(n): round(best["pass", n] * 1000, 2) for n in rows},
        "ratio": {str(n): round(best["pass", n] / one, 2) for n in rows},
        "split_ms": {
            str(n): {p: round(best[p, n] * 1000, 2) for p in ("layers", "head")} for n in rows
        },
    }


def doctor(json: bool = False, model: str | None = None) -> int:
    report = diagnose()
    if model:
        report["verify_cost"] = verify_costs(model)
    print(jsonlib.dumps(report, indent=2) if json else format_report(report))
    sys.stdout.flush()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("doctor", help="show backend, BLAS, memory bandwidth and advice")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--model", help="also time one forward pass of this target over 1, 2, 3, 5 and 8 tokens"
    )
    p.set_defaults(func=lambda args: doctor(json=args.json, model=args.model))
