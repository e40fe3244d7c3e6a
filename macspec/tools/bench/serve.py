"""`macspec bench --serve`: what the prompt cache and the server give.

1. Time to first token against conversation length: one chat, turn after turn (greedy, so both
   runs see the same conversation), with the pair's prompt cache and without it.
2. Aggregate tokens/s of `macspec serve` (in this process, over loopback HTTP) with 1, 2, 4 and 8
   clients asking at once, verified in one target pass against taking turns (clients.py).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from ...api.stream import stream_generate
from ...core.caches import PromptCache
from ..prompts import builtin_prompts
from . import clients

CLIENTS = (1, 2, 4, 8)  # clients at once, each asking one request


def time_to_first_token(
    pair: Any, turns: int = 8, max_tokens: int = 64, cache: bool = True
) -> list[dict[str, Any]]:
    """One conversation of `turns` user messages; per turn its prompt length, the ids the
    prompt cache held, and the seconds until the first token."""
    pair.prompt_cache = PromptCache() if cache else None
    asks = [p.text for p in builtin_prompts(per_kind=0)]
    messages: list[dict[str, str]] = []
    rows = []
    for turn in range(turns):
        messages.append({"role": "user", "content": asks[turn % len(asks)]})
        t0 = time.perf_counter()
        stream = stream_generate(pair, messages=messages, max_tokens=max_tokens, temperature=0.0)
        parts, first = [], None
        for event in stream:
            first = first or time.perf_counter() - t0
            parts.append(event.text)
        stats = stream.stats()
        messages.append({"role": "assistant", "content": "".join(parts)})
        rows.append(
            {
                "turn": turn + 1,
                "prompt_tokens": stats.prompt_tokens,
                "cached_tokens": stats.cached_tokens,
                "ttft": round(first or 0.0, 4),
            }
        )
    return rows


def _median_runs(pair: Any, turns: int, max_tokens: int, cache: bool, repeats: int) -> list:
    """time_to_first_token `repeats` times (a fresh cache each), each turn's median TTFT: the
    machine is shared, and one busy moment should not make a row."""
    runs = [time_to_first_token(pair, turns, max_tokens, cache) for _ in range(repeats)]
    turns_ = zip(*runs, strict=True)
    return [{**rows[0], "ttft": statistics.median(r["ttft"] for r in rows)} for rows in turns_]


def run(
    pair: Any, turns: int, max_tokens: int, output: str | None, repeats: int = 3
) -> dict[str, Any]:
    kept = pair.prompt_cache
    try:
        without = _median_runs(pair, turns, max_tokens, False, repeats)
        with_cache = _median_runs(pair, turns, max_tokens, True, repeats)
        pair.prompt_cache = kept
        print(clients.HEADER, flush=True)
        served = clients.run(pair, list(CLIENTS), 1, max_tokens, repeats, own_k=False)
    finally:
        pair.prompt_cache = kept
    result = {
        "pair": pair.describe(),
        "machine": f"{platform.machine()}, {platform.system()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the end",
        "ttft": [
            {
                **a,
                "ttft_without_cache": a["ttft"],
                "ttft": b["ttft"],
                "cached_tokens": b["cached_tokens"],
            }
            for a, b in zip(without, with_cache, strict=True)
        ],
        "clients": served,
    }
    print(report(result))
    if output:
        Path(output).write_text(json.dumps(result, indent=1))
    return result


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['pair']}; {result['machine']}",
        "",
        "| turn | prompt tokens | cached | TTFT without cache | TTFT with cache |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["ttft"]:
        lines.append(
            f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
            f"{r['ttft_without_cache'] * 1000:.0f} ms | {r['ttft'] * 1000:.0f} ms |"
        )
    lines += ["", "| clients | taking turns tok/s | batched tok/s | ratio (range) | same answers |"]
    lines.append("| ---: | ---: | ---: | ---: | --- |")
    for c in result["clients"]["medians"]:
        low, high = c["ratio_range"]
        lines.append(
            f"| {c['clients']} | {c['turns_tps']} | {c['batched_tps']} | "
            f"{c['ratio']}x ({low}-{high}x) | {c['same_answers']} |"
        )
    return "\n".join(lines)
