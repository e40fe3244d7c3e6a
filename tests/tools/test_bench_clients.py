"""bench_serve's plan (macspec/tools/bench/clients.py), with a stand-in for the served runs: both
ways warmed alike before any timed run, the two ways taking turns at going first, medians."""

from __future__ import annotations

from macspec.tools.bench import clients as bench_serve


class Pair:
    def describe(self) -> str:
        return "stand-in pair"


def test_both_ways_are_warmed_alike_alternate_and_report_medians(capsys):
    calls = []
    speeds = iter([40.0, 80.0, 46.0, 74.0, 41.0, 82.0])  # the timed runs' tok/s, in order

    def measure(pair, clients, batch, per_client, max_tokens, choose=True):
        calls.append((clients, batch))
        warm = len(calls) <= 2
        tps = 1.0 if warm else next(speeds)
        return {
            "tokens_per_second": tps,
            "rows_per_shared_pass": 4.0 if batch else None,
            "drafts_per_shared_row": 1.0 if batch else None,
            "completion_tokens": 256,
            "texts": ["same"],
        }

    out = bench_serve.run(Pair(), [4], 1, 64, 3, False, measure=measure)
    # Untimed: every timed request once each way, at the largest client count.
    assert calls[:2] == [(4, False), (4, True)]
    # Timed: taking turns first, then batched first, then taking turns first.
    assert calls[2:] == [(4, False), (4, True), (4, True), (4, False), (4, False), (4, True)]
    turns, batched = [40.0, 74.0, 41.0], [80.0, 46.0, 82.0]
    assert [r["turns_tps"] for r in out["rows"]] == turns
    assert [r["batched_tps"] for r in out["rows"]] == batched
    (med,) = out["medians"]
    assert med["turns_tps"] == 41.0 and med["batched_tps"] == 80.0
    assert med["ratio"] == 2.0  # the median of 2.0, 0.622 and 2.0
    assert med["ratio_range"] == [0.622, 2.0] and med["same_answers"] is True
    assert "median of 3, 4 clients" in capsys.readouterr().out


def test_macspec_bench_serve_reports_each_client_count_against_taking_turns():
    from macspec.tools.bench import serve as serve_bench

    medians = [
        {
            "clients": n,
            "turns_tps": 40.0,
            "batched_tps": 40.0 * r,
            "ratio": r,
            "ratio_range": [r - 0.1, r + 0.1],
            "same_answers": True,
        }
        for n, r in ((1, 1.0), (2, 1.5), (4, 2.1), (8, 2.6))
    ]
    result = {
        "pair": "stand-in pair",
        "machine": "x86_64",
        "ttft": [
            {
                "turn": 1,
                "prompt_tokens": 62,
                "cached_tokens": 0,
                "ttft_without_cache": 0.3,
                "ttft": 0.3,
            }
        ],
        "clients": {"medians": medians},
    }
    lines = serve_bench.report(result).splitlines()
    assert "| 4 | 40.0 | 84.0 | 2.1x (2.0-2.2x) | True |" in lines
    assert [line.split(" | ")[0] for line in lines[-4:]] == ["| 1", "| 2", "| 4", "| 8"]
    assert serve_bench.CLIENTS == (1, 2, 4, 8)
