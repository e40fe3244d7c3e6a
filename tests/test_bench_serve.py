"""bench_serve's plan (macspec/tools/bench_serve.py), with a stand-in for the served runs: both
ways warmed alike before any timed run, the two ways taking turns at going first, medians."""

from __future__ import annotations

from macspec.tools import bench_serve


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
