"""`macspec bench --prompt-lengths` on a tiny pair: a prompt of exactly each length, plain and the
default read it whole, and the rows, ratios, report and chart are written (no speed asserted)."""

from __future__ import annotations

import json
import mmap
import re
import statistics
from collections import Counter

import pytest
from support.tinymodels import make_tiny_model

from macspec.api.pair import DRAFT_CONTEXT, load
from macspec.base.errors import OptionError
from macspec.cli import main
from macspec.tools.bench import command as bm
from macspec.tools.bench import rss
from macspec.tools.bench.lengths import (
    ASKS,
    RATIOS,
    LengthRun,
    check_lengths,
    format_lengths,
    length_prompt,
    source_ids,
)
from macspec.tools.bench.progress import RunUpdate
from macspec.tools.bench.runner import Runner

FIELDS = {"ids", "method", "label", "ttft_s", "prefill_tok_s", "decode_tok_s", "peak_rss_bytes"}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("lengths")
    target = make_tiny_model(root / "t", seed=5, hidden=48, context=1024)
    draft = make_tiny_model(root / "d", seed=5, hidden=48, context=1024, perturb=0.05)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def result(tiny_pair, tmp_path_factory):
    events = []
    out = bm.bench_lengths(
        LengthRun("200,400", *tiny_pair, max_tokens=8),
        output=tmp_path_factory.mktemp("out"),
        progress=events.append,
    )
    out["events"] = events
    return out


def test_rows_have_every_field_for_plain_and_the_default(result):
    rows = result["rows"]
    assert [(r["ids"], r["label"]) for r in rows] == [
        (200, "plain"), (200, "default"), (400, "plain"), (400, "default"),
    ]  # fmt: skip
    for r in rows:
        assert FIELDS <= set(r) and r["tokens"] > 0
        assert r["ttft_s"] > 0 and r["prefill_tok_s"] == pytest.approx(r["ids"] / r["ttft_s"])
        assert r["decode_tok_s"] > 0 and r["peak_rss_bytes"] > 0
    # Greedy either way: the default's answer is plain's, token for token.
    assert rows[0]["text"] == rows[1]["text"] and rows[2]["text"] == rows[3]["text"]
    assert result["meta"]["mode"] == "prompt_lengths" and result["meta"]["lengths"] == [200, 400]


def test_ratios_and_the_report(result):
    rows = {(r["ids"], r["method"]): r for r in result["rows"]}
    for q in result["ratios"]:
        plain, default = rows[q["ids"], "macspec_plain"], rows[q["ids"], "macspec_adaptive"]
        assert q["ttft_default_over_plain"] == pytest.approx(default["ttft_s"] / plain["ttft_s"])
        assert q["decode_default_over_plain"] == pytest.approx(
            default["decode_tok_s"] / plain["decode_tok_s"]
        )
        assert q["prefill_plain_over_llamacpp"] is None  # no --gguf: no llama.cpp rows
    assert [q["ids"] for q in result["ratios"]] == [200, 400]
    table = format_lengths(result)
    assert "| ids | method | TTFT s | prefill tok/s | decode tok/s | peak RSS MiB |" in table
    assert "| 400 | default |" in table and "plain prefill / llama.cpp" in table
    assert "skipped llamacpp_plain: needs" in table  # what llama.cpp's rows lack, said
    # One repeat (the API's default): the bare figures, no ranges.
    assert result["meta"]["repeats"] == 1 and all(r["repeats"] == 1 for r in result["rows"])
    assert result["meta"]["ask"] == "summary" and "then the summary request" in table
    assert result["meta"]["kv_cache"] == "float16" and "; float16 KV cache;" in table
    assert re.search(r"^\| 200 \| plain \| [\d.]+ \| [\d.,]+ \| [\d.,]+ \| [\d,]+ \|$", table, re.M)
    assert "repeats a row" not in table


def test_files_and_progress(result):
    names = [f.rsplit("/", 1)[-1] for f in result["files"]]
    assert names == ["bench.json", "lengths.md", "lengths.png"]
    saved = json.loads(open(result["files"][0]).read())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert set(saved["ratios"][0]) == {"ids", *RATIOS}
    assert open(result["files"][2], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    done = [e for e in result["events"] if isinstance(e, RunUpdate) and e.done]
    assert [(e.phase, e.run, e.runs) for e in done] == [
        ("warm-up", 1, 2), ("warm-up", 2, 2), ("run", 1, 4), ("run", 2, 4), ("run", 3, 4),
        ("run", 4, 4),
    ]  # fmt: skip


@pytest.mark.parametrize("request_kind", sorted(ASKS))
def test_a_prompt_has_exactly_the_asked_ids(tiny_pair, request_kind):
    tokenizer = load(tiny_pair[0]).tokenizer
    source = source_ids(tokenizer)
    ask = tokenizer.encode(ASKS[request_kind], add_special_tokens=False)
    for n in (len(ask) + 1, 300, 1000):
        ids = length_prompt(source, ask, n)
        assert (
            len(ids) == n
            and ids[-len(ask) :] == ask
            and ids[: n - len(ask)] == source[: n - len(ask)]
        )
    with pytest.raises(OptionError, match="invalid prompt length 5"):
        length_prompt(source, ask, 5)  # the request alone is longer
    with pytest.raises(OptionError, match=f"prompt length {len(source) + len(ask) + 1}"):
        length_prompt(source, ask, len(source) + len(ask) + 1)


@pytest.mark.parametrize("lengths", ["0,200", "-5", "two", "200,2.5", ""])
def test_non_positive_or_odd_lengths_are_refused_before_loading(lengths):
    with pytest.raises(OptionError, match="prompt_lengths"):
        bm.bench_lengths(LengthRun(lengths, "no-such-model"), quiet=True)


def test_lengths_past_the_context_are_refused(tiny_pair, capsys):
    with pytest.raises(OptionError, match="invalid prompt length 1000: .* context of 1024"):
        check_lengths([200, 1000], 1024, 128)
    argv = ["bench", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--prompt-lengths", "200"]
    assert main([*argv, "5000", "--quiet"]) == 2
    assert "5000" in capsys.readouterr().err


def test_cli_takes_lengths_spaced_or_comma_separated(tiny_pair, tmp_path, capsys):
    argv = ["bench", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--max-tokens", "4"]
    argv += ["--prompt-lengths", "150,160", "170", "--no-charts", "--output", str(tmp_path)]
    assert main([*argv, "--draft-context", "64"]) == 0
    printed = capsys.readouterr()
    assert "| 170 | default |" in printed.out and "[6/6]" in printed.err
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["meta"]["lengths"] == [150, 160, 170]
    assert saved["meta"]["draft_context"] == 64  # the default pair's draft reads 64 ids
    assert saved["meta"]["repeats"] == 1  # --repeats not given: this mode's default, one
    assert not (tmp_path / "lengths.png").exists() and (tmp_path / "lengths.md").exists()
    assert main([*argv, "--serve"]) == 2


def test_the_edit_request_follows_the_same_sources(tiny_pair, tmp_path, capsys, monkeypatch):
    seen = []
    run = Runner.run

    def recorded(self, m, ids, *args):
        seen.append(list(ids))
        return run(self, m, ids, *args)

    monkeypatch.setattr(Runner, "run", recorded)
    argv = ["bench", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--max-tokens", "3"]
    argv += ["--prompt-lengths", "180", "--no-charts", "--output", str(tmp_path), "--ask", "edit"]
    assert main(argv) == 0
    assert "then the edit request" in capsys.readouterr().out
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["meta"]["ask"] == "edit" and "type hints" in saved["meta"]["prompt"]
    tokenizer = load(tiny_pair[0]).tokenizer
    edit = tokenizer.encode(ASKS["edit"], add_special_tokens=False)
    timed = [ids for ids in seen if len(ids) == 180]
    assert len(timed) == 2  # plain and the default, on the same ids
    assert all(ids == length_prompt(source_ids(tokenizer), edit, 180) for ids in timed)
    with pytest.raises(SystemExit) as refused:  # argparse: not one of the choices
        main([*argv[:-1], "rewrite"])
    assert refused.value.code == 2 and "--ask: invalid choice: 'rewrite'" in capsys.readouterr().err
    plain_bench = ["bench", "--target", tiny_pair[0], "--ask", "edit", "--quiet"]
    assert main(plain_bench) == 2  # the request of the long-prompt mode alone
    assert "--ask edit: the request after a long prompt" in capsys.readouterr().err
    with pytest.raises(OptionError, match="invalid ask='rewrite': one of summary, edit"):
        bm.bench_lengths(LengthRun("200", "no-such-model", ask="rewrite"), quiet=True)


@pytest.fixture(scope="module")
def repeated(tiny_pair, tmp_path_factory):
    """Two repeats of each row, with every timed call of the runner counted."""
    events, calls = [], Counter()
    run = Runner.run

    def counted(self, m, ids, *args):
        calls[len(ids), m.method] += 1
        return run(self, m, ids, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Runner, "run", counted)
        out = bm.bench_lengths(
            LengthRun([150, 200], *tiny_pair, max_tokens=6, repeats=2),
            output=tmp_path_factory.mktemp("repeated"),
            charts=False,
            progress=events.append,
            quiet=True,
        )
    out["events"], out["calls"] = events, calls
    return out


def test_repeats_run_each_row_twice_taking_turns(repeated):
    methods = ("macspec_plain", "macspec_adaptive")
    # Two timed generations per (length, method), besides one warm-up of 64 ids per method.
    assert repeated["calls"] == Counter(
        {**{(n, m): 2 for n in (150, 200) for m in methods}, **{(64, m): 1 for m in methods}}
    )
    done = [
        (e.prompt, e.label, e.repeat, e.run, e.runs)
        for e in repeated["events"]
        if isinstance(e, RunUpdate) and e.done and e.phase == "run"
    ]
    labels = list(dict.fromkeys(label for _, label, *_ in done))
    assert len(labels) == 2
    # At each length plain and the default alternate, repeat by repeat.
    expected = [(f"{n} ids", lab, rep) for n in (150, 200) for rep in (0, 1) for lab in labels]
    assert [d[:3] for d in done] == expected
    assert [d[3:] for d in done] == [(i, 8) for i in range(1, 9)]
    assert repeated["meta"]["repeats"] == 2


def test_repeated_rows_report_medians_and_ranges(repeated):
    rows = repeated["rows"]
    assert [(r["ids"], r["method"]) for r in rows] == [
        (150, "macspec_plain"), (150, "macspec_adaptive"), (200, "macspec_plain"),
        (200, "macspec_adaptive"),
    ]  # fmt: skip
    for r in rows:
        assert r["repeats"] == 2 and len(r["each"]) == 2
        ttfts = [e["ttft_s"] for e in r["each"]]
        assert r["ttft_s"] == pytest.approx(statistics.median(ttfts)) and min(ttfts) > 0
        assert r["ttft_range"] == [min(ttfts), max(ttfts)]
        assert r["ttft_range"][0] <= r["ttft_s"] <= r["ttft_range"][1]
        decodes = [e["decode_tok_s"] for e in r["each"]]
        assert r["decode_tps_range"] == [min(decodes), max(decodes)]
        assert r["decode_tps_range"][0] <= r["decode_tok_s"] <= r["decode_tps_range"][1]
        prefills = [e["prefill_tok_s"] for e in r["each"]]
        assert r["prefill_tok_s"] == pytest.approx(statistics.median(prefills))
        assert r["peak_rss_bytes"] == max(e["peak_rss_bytes"] for e in r["each"])
        assert r["each"][0]["tokens"] == r["each"][1]["tokens"] == r["tokens"]  # greedy
    by = {(r["ids"], r["method"]): r for r in rows}
    for q in repeated["ratios"]:  # from the medians
        plain, default = by[q["ids"], "macspec_plain"], by[q["ids"], "macspec_adaptive"]
        assert q["ttft_default_over_plain"] == pytest.approx(default["ttft_s"] / plain["ttft_s"])
    table = format_lengths(repeated)
    num, spread = r"[\d.,]+", r"[\d.,]+ \([\d.,]+-[\d.,]+\)"
    for n in ("150", "200"):
        for label in ("plain", "default"):
            row = rf"^\| {n} \| {label} \| {spread} \| {num} \| {spread} \| {num} \|$"
            assert re.search(row, table, re.M), table
    assert "2 repeats a row" in table
    written = open(next(f for f in repeated["files"] if f.endswith("lengths.md"))).read()
    assert written == table + "\n"


@pytest.mark.parametrize("repeats", [0, -1])
def test_fewer_than_one_repeat_is_refused_before_loading(repeats):
    with pytest.raises(OptionError, match=f"invalid repeats={repeats}"):
        bm.bench_lengths(LengthRun("200", "no-such-model", repeats=repeats), quiet=True)


def test_cli_repeats_defaults_by_mode(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(bm, "bench_lengths", lambda run, *a, **k: seen.update(lengths=run))
    monkeypatch.setattr(bm, "bench", lambda **k: seen.update(bench=k))
    assert main(["bench", "--prompt-lengths", "200", "--quiet"]) == 0
    assert seen["lengths"].repeats == 1  # long prompts: one unless asked
    assert main(["bench", "--prompt-lengths", "200", "--repeats", "2", "--quiet"]) == 0
    assert seen["lengths"].repeats == 2
    assert main(["bench", "--quiet"]) == 0
    assert seen["bench"]["repeats"] == 3  # the other benchmark's default, as before
    assert seen["bench"]["draft_context"] == seen["lengths"].draft_context == DRAFT_CONTEXT
    assert main(["bench", "--prompt-lengths", "200", "--draft-context", "0", "--quiet"]) == 0
    assert seen["lengths"].draft_context == 0
    monkeypatch.undo()
    assert main(["bench", "--prompt-lengths", "200", "--repeats", "0", "--quiet"]) == 2
    assert "invalid repeats=0" in capsys.readouterr().err
    assert main(["bench", "--prompt-lengths", "200", "--draft-context", "-1", "--quiet"]) == 2
    assert "invalid draft_context=-1" in capsys.readouterr().err


def test_peak_rss_is_positive_and_follows_a_reset():
    reset = rss.reset_peak()
    before = rss.peak_rss(reset)
    assert before.bytes > 0 and before.scope in (rss.DURING, rss.SO_FAR)
    # Against what is resident now: memory freed since the reset (MLX's buffers, the
    # collector) leaves the peak above it, and 64 MiB more may stay under that peak.
    base = rss.resident() or before.bytes  # (no /proc: the peak so far)
    block = _touched(64 << 20)  # 64 MiB more resident
    after = rss.peak_rss(reset)
    assert after.bytes >= base + (60 << 20) and after.bytes >= before.bytes
    block.close()
    if reset:  # Linux: the high-water mark falls back to the present after a reset
        assert rss.reset_peak() and rss.peak_rss(True).bytes < after.bytes
        assert rss.resident() > 0


def _touched(size: int) -> mmap.mmap:
    """`size` bytes of fresh anonymous memory, every 4 KiB page written. Not a bytearray:
    malloc may hand out a freed heap region that is still resident (a CI run's did, and the
    peak did not move), where a new mapping's pages must all be faulted in."""
    block = mmap.mmap(-1, size)
    for at in range(0, size, 4096):
        block[at] = 1
    return block


def test_llamacpp_rows_beside_on_the_same_ids(gguf_target, tmp_path):
    pytest.importorskip("xllamacpp", reason="llama.cpp's rows need the optional xllamacpp")
    target, gguf = gguf_target
    out = bm.bench_lengths(
        LengthRun([120, 240], target, max_tokens=6, gguf=gguf), tmp_path, charts=True, quiet=True
    )
    rows = {(r["ids"], r["method"]): r for r in out["rows"]}
    # No draft model: the default is skipped with its reason, plain and llama.cpp run.
    assert set(rows) == {(n, m) for n in (120, 240) for m in ("macspec_plain", "llamacpp_plain")}
    for n in (120, 240):
        mine, peer = rows[n, "macspec_plain"], rows[n, "llamacpp_plain"]
        assert peer["text"] == mine["text"] and peer["peak_rss_bytes"] > 0  # same f32 weights
        q = next(q for q in out["ratios"] if q["ids"] == n)
        assert q["prefill_plain_over_llamacpp"] == pytest.approx(
            mine["prefill_tok_s"] / peer["prefill_tok_s"]
        )
    assert out["meta"]["llamacpp"]["gguf"] == gguf
    assert "| 240 | llama.cpp plain |" in format_lengths(out)
