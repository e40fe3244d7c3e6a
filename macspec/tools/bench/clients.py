"""Aggregate tokens/s of `macspec serve` with 1, 2, 4 and 8 clients at once, the clients'
requests verified in one target pass (server/batching.py) against taking turns, same run.

    python -m macspec.tools.bench.clients [--target DIR --draft DIR] [--clients 1 2 4 8]

Every client asks the same number of requests (built-in prompts, greedy, so both ways produce
the same tokens: checked). The server runs in this process over loopback HTTP. Both ways are
warmed alike (every timed request asked once each way first), take turns at going first, and
the medians over `--repeats` are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median
from typing import Any

from ..prompts import builtin_prompts


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=900) as response:
        return json.loads(response.read())


def measure(
    pair: Any, clients: int, batch: bool, per_client: int, max_tokens: int, choose: bool = True
) -> dict:
    """`clients` clients asking `per_client` requests each, one after the other, all at once:
    aggregate completion tokens/s, the answers, and the server's /health at the end; `choose`:
    the batch chooses its rows' K (else each row drafts its own policy's)."""
    from ...server.batching import BatchScheduler
    from ...server.command import serving

    asks = [p.text for p in builtin_prompts()]
    plan = [
        [asks[(c * per_client + i) % len(asks)] for i in range(per_client)] for c in range(clients)
    ]
    with serving(pair, scheduler=BatchScheduler(pair, clients, batch, choose)) as base:
        url = base + "/v1/chat/completions"

        def client(texts: list[str]) -> list[dict[str, Any]]:
            out = []
            for text in texts:
                body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
                answer = _post(url, {**body, "temperature": 0.0})
                out.append(answer)
            return out

        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            answers = [a for per in pool.map(client, plan) for a in per]
        wall = time.perf_counter() - t0
        with urllib.request.urlopen(base + "/health", timeout=60) as r:
            health = json.loads(r.read())
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return {
        "clients": clients,
        "batch": batch,
        "requests": len(answers),
        "completion_tokens": tokens,
        "seconds": round(wall, 2),
        "tokens_per_second": round(tokens / wall, 2),
        "rows_per_shared_pass": health.get("rows_per_shared_pass"),
        "drafts_per_shared_row": health.get("drafts_per_shared_row"),
        "texts": [a["choices"][0]["message"]["content"] for a in answers],
    }


# The table each repeat's line (_line) belongs to.
HEADER = (
    "| clients | taking turns tok/s | batched tok/s | ratio | rows/pass | drafts/row | tokens "
    "| same |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
)


def run(
    pair: Any,
    clients: list[int],
    per_client: int,
    max_tokens: int,
    repeats: int,
    own_k: bool,
    measure: Callable[..., dict] = measure,
) -> dict:
    """Each client count, taking turns and batched, `repeats` times, after one untimed run each
    way of every request the timed runs make (the pair's prompt cache and its policies'
    observations then start alike for both; the first requests of a process pay its warm-up).
    The two ways take turns at going first; the medians over the repeats are the result.
    `own_k`: also batched with each row drafting its own policy's K (no choice for the batch)."""
    for batch in (False, True):
        measure(pair, max(clients), batch, per_client, max_tokens)
    rows, summaries = [], []
    for n in clients:
        mine = []
        for _ in range(repeats):
            first = len(rows) % 2 == 1  # batched first every other time
            got = {b: measure(pair, n, b, per_client, max_tokens) for b in (first, not first)}
            row = _row(n, got[False], got[True])
            if own_k:
                own = measure(pair, n, True, per_client, max_tokens, choose=False)
                row["own_k_tps"] = own["tokens_per_second"]
                row["own_k_ratio"] = round(own["tokens_per_second"] / row["turns_tps"], 3)
                row["own_k_drafts_per_row"] = own["drafts_per_shared_row"]
                row["same_answers"] &= own["texts"] == got[False]["texts"]
            rows.append(row)
            mine.append(row)
            print(_line(row), flush=True)
        summaries.append(summary(mine))
    for s in summaries:
        print(_summary_line(s), flush=True)
    return {
        "pair": pair.describe(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the end",
        "per_client": per_client,
        "max_tokens": max_tokens,
        "rows": rows,
        "medians": summaries,
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of one client count's repeats, the ratios' range, and whether every repeat
    gave the same answers both ways."""
    ratios = [r["ratio"] for r in rows]
    return {
        "clients": rows[0]["clients"],
        "repeats": len(rows),
        "turns_tps": round(median(r["turns_tps"] for r in rows), 2),
        "batched_tps": round(median(r["batched_tps"] for r in rows), 2),
        "ratio": round(median(ratios), 3),
        "ratio_range": [min(ratios), max(ratios)],
        "same_answers": all(r["same_answers"] for r in rows),
    }


def _summary_line(s: dict[str, Any]) -> str:
    low, high = s["ratio_range"]
    return (
        f"median of {s['repeats']}, {s['clients']} clients: taking turns {s['turns_tps']} tok/s, "
        f"batched {s['batched_tps']} tok/s, {s['ratio']}x ({low}-{high}x), "
        f"same answers: {s['same_answers']}"
    )


def _row(n: int, turns: dict[str, Any], batched: dict[str, Any]) -> dict[str, Any]:
    return {
        "clients": n,
        "turns_tps": turns["tokens_per_second"],
        "batched_tps": batched["tokens_per_second"],
        "ratio": round(batched["tokens_per_second"] / turns["tokens_per_second"], 3),
        "rows_per_shared_pass": batched["rows_per_shared_pass"],
        "drafts_per_row": batched["drafts_per_shared_row"],
        "tokens": batched["completion_tokens"],
        "same_answers": turns["texts"] == batched["texts"],
    }


def _line(r: dict[str, Any]) -> str:
    own = ""
    if "own_k_tps" in r:
        own = f" own K: {r['own_k_tps']} ({r['own_k_ratio']}x, "
        own += f"{r['own_k_drafts_per_row']} drafts/row)"
    return (
        f"| {r['clients']} | {r['turns_tps']} | {r['batched_tps']} | {r['ratio']}x | "
        f"{r['rows_per_shared_pass']} | {r['drafts_per_row']} | {r['tokens']} | "
        f"{r['same_answers']} |" + own
    )


def main(argv: list[str] | None = None) -> int:
    import macspec

    p = argparse.ArgumentParser(prog="python -m macspec.tools.bench.clients", description=__doc__)
    p.add_argument("--target", help="target model (default: the embedded default pair)")
    p.add_argument("--draft", help="draft model")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--per-client", type=int, default=2, help="requests each client asks")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs each way (median shown)")
    p.add_argument("--output", help="write the results as JSON here")
    p.add_argument(
        "--own-k", action="store_true", help="also batched with each row's own K (no choice)"
    )
    args = p.parse_args(argv)
    pair = macspec.load(args.target, args.draft)
    print(f"{pair.describe()}\n")
    print(HEADER)
    result = run(pair, args.clients, args.per_client, args.max_tokens, args.repeats, args.own_k)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
