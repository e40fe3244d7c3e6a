"""`macspec bench` on a tiny pair: it runs, and its numbers are consistent with each other."""

from __future__ import annotations

import dataclasses
import io
import json
import statistics
import sys

import pytest
from support.tinymodels import make_tiny_model

from macspec.base.errors import OptionError, PromptError
from macspec.cli import main
from macspec.core.policy import COPY_FACTOR
from macspec.tools.bench import command as bm
from macspec.tools.bench.plan import DEFAULT_METHODS, opt_in_reason
from macspec.tools.bench.progress import Finished, Note, RunUpdate, StderrProgress
from macspec.tools.bench.report import (
    RunRecord,
    format_table,
    iter_rows,
    summarise,
    write_charts,
)
from macspec.tools.prompts import BUILTIN, KINDS, builtin_prompts, load_prompts


@pytest.fixture(scope="module")
def same_pair(tmp_path_factory):
    """Draft == target: at temperature 0 every draft must be accepted."""
    root = tmp_path_factory.mktemp("bench")
    target = make_tiny_model(root / "t", seed=5, hidden=48, context=2048)
    draft = make_tiny_model(root / "d", seed=5, hidden=48, context=2048)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def result(same_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    return bm.bench(
        *same_pair,
        kinds="chat,grounded",
        per_kind=1,
        max_tokens=12,
        temperature="0,0.7",
        num_draft="2,3",
        repeats=2,
        output=out,
        quiet=True,
    )


def test_every_method_is_run_or_skipped_with_a_reason(result):
    # By default: every method but llama.cpp's (a peer, opt-in).
    labels = result["meta"]["methods"]
    skipped = {s["method"]: s["reason"] for s in result["skipped"]}
    assert not any(r["method"].startswith("llamacpp") for r in result["runs"])
    for name in DEFAULT_METHODS:
        ran = [r for r in result["runs"] if r["method"] == name]
        assert ran or skipped.get(name), name
    assert "mlx-lm plain" in labels and "macspec K=2" in labels and "mlx-lm spec K=3" in labels
    runs_per_method = 2 * 2 * 2  # temperatures x prompts x repeats
    for label in labels:
        assert sum(r["label"] == label for r in result["runs"]) == runs_per_method


def test_summary_is_consistent(result):
    rows = result["summary"]
    base = {
        (r["temperature"], r["kind"]): r["tok_s"]["median"] for r in rows if r["method"] == "mlx_lm"
    }
    assert set(base) == {(t, k) for t in (0.0, 0.7) for k in ("chat", "grounded", "all")}
    for r in rows:
        ts = r["tok_s"]
        assert ts["min"] <= ts["median"] <= ts["max"] and ts["median"] > 0
        assert r["speedup"] == pytest.approx(ts["median"] / base[(r["temperature"], r["kind"])])
        if r["method"] == "mlx_lm":
            assert r["speedup"] == 1.0
        if r["acceptance_rate"] is not None:
            assert 0.0 <= r["acceptance_rate"] <= 1.0
            # n-gram copies may run to COPY_FACTOR x num_draft ids (they cost no draft time)
            k_max = r["num_draft"] * (
                COPY_FACTOR if r["method"] in ("macspec_ngram", "macspec_adaptive") else 1
            )
            assert 1.0 <= r["mean_accepted_length"] <= k_max + 1
            assert all(0.0 <= a <= 1.0 for a in r["per_position_acceptance"])
            assert len(r["per_position_acceptance"]) <= k_max
        if r["time_split"] is not None:
            assert sum(r["time_split"].values()) == pytest.approx(1.0, abs=1e-6)
        assert r["peak_memory_bytes"] > 0 and r["weight_read_gbs"] > 0
        assert r["bandwidth_fraction"] == pytest.approx(
            r["weight_read_gbs"] / result["meta"]["bandwidth_gbs"]
        )


def test_identical_draft_is_always_accepted_at_temperature_zero(result):
    greedy = [
        r
        for r in result["summary"]
        if r["temperature"] == 0.0 and r["method"] in ("macspec", "mlx_lm_spec")
    ]
    assert len(greedy) == 2 * 2 * 3  # two methods, K in (2, 3), kinds chat, grounded, all
    for r in greedy:
        assert r["acceptance_rate"] == 1.0, r["label"]
        assert r["per_position_acceptance"] == [1.0] * r["num_draft"]


def test_greedy_text_is_the_same_for_every_method(result):
    # Exactness at temperature 0: each method gives mlx-lm's own greedy output.
    runs = [r for r in result["runs"] if r["temperature"] == 0.0]
    for prompt in {r["prompt"] for r in runs}:
        texts = {r["label"]: r["text"] for r in runs if r["prompt"] == prompt and r["repeat"] == 0}
        assert len(set(texts.values())) == 1, texts


def test_json_and_charts_are_written(result):
    files = result["files"]
    assert [f.rsplit("/", 1)[-1] for f in files] == ["bench.json", "speedup.png", "acceptance.png"]
    saved = json.loads(open(files[0]).read())
    assert saved["summary"] == json.loads(json.dumps(result["summary"]))
    for png in files[1:]:
        assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    table = format_table(result)
    assert "mlx-lm plain" in table and "temperature 0.7" in table


def test_cli_bench(same_pair, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["bench", "--target", same_pair[0], "--draft", same_pair[1], "--kinds", "code"]
    argv += ["--per-kind", "1", "--max-tokens", "6", "--temperature", "0", "--num-draft", "2"]
    argv += ["--repeats", "1", "--methods", "mlx_lm,macspec_plain", "--no-charts"]
    assert main([*argv, "--output", str(out)]) == 0
    captured = capsys.readouterr()
    assert "macspec plain" in captured.out and "[2/2]" in captured.err
    saved = json.loads((out / "bench.json").read_text())
    assert saved["meta"]["methods"] == ["mlx-lm plain", "macspec plain"]
    assert not (out / "speedup.png").exists()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": "zero"},
        {"temperature": "-1"},
        {"num_draft": "0"},
        {"methods": "mlx_lm,warp"},
        {"kinds": "poetry"},
        {"max_tokens": 1},
    ],
)
def test_bad_options(same_pair, kwargs):
    with pytest.raises(OptionError):
        bm.bench(*same_pair, quiet=True, **kwargs)


def test_cli_bad_option_is_a_message(same_pair, capsys):
    assert main(["bench", "--target", same_pair[0], "--num-draft", "x"]) == 2
    assert "num_draft" in capsys.readouterr().err


def test_summarise_exact_numbers():
    def rec(method, label, rep, tokens, seconds, drafted=0, accepted=0, k=0):
        r = RunRecord(method, label, k, "chat", "chat-1", 0.0, rep, rep)
        r.decode_tokens, r.decode_time, r.passes = tokens, seconds, tokens
        if drafted:
            r.drafted, r.accepted, r.spec_rounds = drafted, accepted, drafted // k
            r.drafted_at, r.accepted_at = [drafted // k] * k, [accepted // k] * k
            r.passes = r.spec_rounds
        r.peak_memory = 100
        return r

    records = [
        rec("mlx_lm", "mlx-lm plain", 0, 10, 1.0),
        rec("mlx_lm", "mlx-lm plain", 1, 10, 2.0),
        rec("mlx_lm", "mlx-lm plain", 2, 10, 0.5),
        rec("macspec", "macspec K=2", 0, 30, 1.0, drafted=20, accepted=10, k=2),
    ]
    rows = {(r["label"], r["kind"]): r for r in summarise(records, 1000, 1.0)}
    base = rows[("mlx-lm plain", "all")]
    assert base["tok_s"] == {"median": 10.0, "min": 5.0, "max": 20.0}
    spec = rows[("macspec K=2", "chat")]
    assert spec["speedup"] == 3.0
    assert spec["acceptance_rate"] == 0.5
    assert spec["mean_accepted_length"] == 2.0  # (10 accepted + 10 rounds) / 10 rounds
    assert spec["per_position_acceptance"] == [0.5, 0.5]
    assert spec["weight_read_gbs"] == pytest.approx(10 * 1000 / 1e9)  # 10 passes/s x 1000 B
    # llama.cpp's rows read its GGUF file's bytes, not the target's; unknown: no figure
    peer = [rec("llamacpp_plain", "llama.cpp plain", 0, 10, 1.0)]
    row = summarise(peer, 1000, 1.0, other_bytes={"llamacpp_plain": 600})[0]
    assert row["weight_read_gbs"] == pytest.approx(10 * 600 / 1e9)
    row = summarise(peer, 1000, 1.0, other_bytes={"llamacpp_plain": None})[0]
    assert row["weight_read_gbs"] == 0.0 and row["bandwidth_fraction"] is None


def test_builtin_prompts_cover_every_kind():
    assert set(BUILTIN) == set(KINDS)
    prompts = builtin_prompts()
    assert {p.kind for p in prompts} == set(KINDS)
    assert len({p.name for p in prompts}) == len(prompts)
    assert [p.name for p in builtin_prompts(["code"], per_kind=2)] == ["code-1", "code-2"]
    with pytest.raises(OptionError):
        builtin_prompts(["poetry"])


def test_prompt_files(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"kind": "code", "prompt": "a"}\n{"prompt": "b"}\n')
    assert [(p.kind, p.text) for p in load_prompts(jsonl)] == [("code", "a"), ("custom", "b")]
    text = tmp_path / "p.txt"
    text.write_text("first\n\nsecond\n")
    assert [p.text for p in load_prompts(text)] == ["first", "second"]
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(PromptError, match="no prompts"):
        load_prompts(tmp_path / "empty.txt")
    with pytest.raises(PromptError, match="cannot read"):
        load_prompts(tmp_path / "missing.txt")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(PromptError, match="entry 1"):
        load_prompts(tmp_path / "bad.json")


def test_prompts_go_through_the_chat_template(same_pair):
    import macspec
    from macspec.api.stream import prompt_ids

    pair = macspec.load(same_pair[0])
    ids = prompt_ids(pair, messages=builtin_prompts(["chat"])[0].messages)
    text = "user: " + builtin_prompts(["chat"])[0].text + "\nassistant: "
    assert ids == prompt_ids(pair, text)


def test_readme_script_replaces_only_the_results_block(result, tmp_path):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_readme.py"
    spec = importlib.util.spec_from_file_location("bench_readme", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n<!-- section:bench -->\nintro\n{mod.START}\nold\n{mod.END}\nafter\n")
    charts = tmp_path / "docs"
    assert mod.main([result["files"][0], "--readme", str(readme), "--charts", str(charts)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n<!-- section:bench -->\nintro\n") and text.endswith("\nafter\n")
    assert "old" not in text and "| mlx-lm plain |" in text and "| macspec K=3 |" in text
    assert "![speedup](docs/speedup.png)" in text and (charts / "acceptance.png").is_file()
    # The goals' "plain" is macspec's own plain decoding when the run measured it.
    summary = json.loads(Path(result["files"][0]).read_text())["summary"]
    base = "macspec plain" if any(r["method"] == "macspec_plain" for r in summary) else "plain"
    assert text.count(f"never below 0.95x {base} (adaptive modes)") == 1
    # The n-gram goal names no temperature: one verdict per measured temperature.
    for temp in (0.0, 0.7):
        assert (
            text.count(f"n-gram ≥ 1.5x {base} on grounded prompts at T={temp}: best macspec n-gram")
            == 1
        )
    assert (
        "drafts with `model+ngram`); 2 prompts (chat, grounded), 12 tokens max, 2 repeats, seed 0."
        in text
    )
    # A second run (e.g. a model draft for the mlx-lm side-by-side) follows with its own tables
    # and only the mlx-lm comparison among the goals.
    assert mod.main([result["files"][0], result["files"][0], "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.count("**Temperature 0.0**") == 2 and text.count("never below 0.95x") == 1
    assert text.count("T=0.7, K=3: macspec accepted length") == 2
    readme.write_text("no markers")
    assert mod.main([result["files"][0], "--readme", str(readme)]) == 1


def test_charts_of_the_final_run_shape(tmp_path):
    """One repeat: min == median == max, whose scaled difference rounds below zero (a real run
    crashed on it); the whiskers must then be zero, not an error."""
    cell = {
        "temperature": 0.0,
        "kind": "chat",
        "tok_s": {"median": 0.3, "min": 0.1 + 0.2, "max": 0.1 + 0.2},
    }
    rows = [
        {**cell, "label": "mlx-lm plain", "speedup": 1.0, "per_position_acceptance": []},
        {**cell, "label": "macspec K=2", "speedup": 1.1, "per_position_acceptance": [0.5]},
        {
            **cell,
            "kind": "all",
            "label": "macspec K=2",
            "speedup": 1.1,
            "per_position_acceptance": [0.5],
        },
    ]
    result = {"summary": rows, "meta": {"temperatures": [0.0], "kinds": ["chat"]}, "runs": []}
    assert 1.1 - (0.1 + 0.2) * (1.1 / 0.3) < 0  # the rounding that crashed
    files = write_charts(result, tmp_path)
    assert (tmp_path / "speedup.png").stat().st_size > 0 and files


def test_target_without_a_draft_runs_what_needs_none(same_pair, tmp_path):
    result = bm.bench(
        same_pair[0],
        methods="mlx_lm,macspec,macspec_plain",
        kinds="code",
        per_kind=1,
        max_tokens=4,
        temperature="0",
        num_draft="2",
        repeats=1,
        output=tmp_path,
        charts=False,
        quiet=True,
    )
    assert result["meta"]["methods"] == ["mlx-lm plain", "macspec plain"]
    assert result["skipped"] == [
        {"method": "macspec", "reason": "no draft model loaded (use --draft)"}
    ]


def test_readme_goals_are_judged_against_macspecs_own_plain_decoding():
    """The speedup columns are against mlx-lm's plain decoding; the goals against macspec's own
    plain decoding, which the CPU kernels make faster (2.0 / 1.6 = 1.25x: not 1.5x)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_readme.py"
    spec = importlib.util.spec_from_file_location("bench_readme", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def row(method: str, speedup: float, kind: str = "chat") -> dict:
        return {"method": method, "label": method, "speedup": speedup, "kind": kind,
                "temperature": 0.0}  # fmt: skip

    rows = [row("mlx_lm", 1.0), row("macspec_plain", 1.6), row("macspec_adaptive", 2.0)]
    lines = mod.targets({"meta": {"temperatures": [0.0]}, "summary": rows})
    assert (
        "macspec ≥ 1.5x macspec plain on chat at T=0.0: best macspec_adaptive 1.25x — NOT met"
        in lines
    )
    assert (
        "never below 0.95x macspec plain (adaptive modes): worst macspec_adaptive on chat "
        "at T=0.0: 1.25x — met" in lines
    )
    # Without macspec's plain row, against the table's baseline.
    lines = mod.targets({"meta": {"temperatures": [0.0]}, "summary": rows[::2]})
    assert "macspec ≥ 1.5x plain on chat at T=0.0: best macspec_adaptive 2.00x — met" in lines


def test_context_precedes_each_prompt_with_other_questions(same_pair, tmp_path, capsys):
    out = tmp_path / "ctx"
    argv = ["bench", "--target", same_pair[0], "--draft", same_pair[1], "--kinds", "chat"]
    argv += ["--per-kind", "2", "--max-tokens", "4", "--temperature", "0", "--context", "700"]
    argv += ["--repeats", "1", "--methods", "macspec_plain", "--no-charts", "--quiet"]
    assert main([*argv, "--output", str(out)]) == 0
    meta = json.loads((out / "bench.json").read_text())["meta"]
    assert meta["context"] == 700
    # The fewest questions that reach 700 tokens: at least 700, and not one question more.
    assert all(700 <= p["tokens"] < 760 for p in meta["prompts"]), meta["prompts"]


def test_every_run_reads_its_prompt_whole_and_its_time_to_the_first_token_is_kept(
    same_pair, tmp_path, monkeypatch
):
    """Two repeats of one 700-id prompt: the prompt cache is emptied before each macspec run (the
    second is no cache hit: a whole prefill), and the summary and the table show that time."""
    from macspec.core.caches import PromptCache

    cleared = []
    real = PromptCache.clear
    monkeypatch.setattr(PromptCache, "clear", lambda self: cleared.append(1) or real(self))
    out = bm.bench(
        *same_pair, kinds="chat", per_kind=1, max_tokens=4, temperature="0", context=700,
        repeats=2, methods="macspec_plain", output=tmp_path / "ttft", charts=False, quiet=True,
    )  # fmt: skip
    runs = [r for r in out["runs"] if r["method"] == "macspec_plain"]
    assert len(runs) == 2 and len(cleared) >= 2
    assert all(r["first_time"] > 0 for r in runs)
    row = next(r for r in out["summary"] if r["method"] == "macspec_plain" and r["kind"] == "all")
    assert row["first_token_s"] == statistics.median(r["first_time"] for r in runs)
    assert "TTFT s" in format_table(out)


def test_with_context_is_the_shortest_list_that_reaches_the_length():
    from macspec.tools.prompts import with_context

    p = builtin_prompts(["chat"], 1)[0]

    def words(q):
        return len(q.text.split())

    long = with_context(p, words, 300)
    assert long.text.endswith("Now answer this one: " + p.text) and long.name == p.name
    assert words(long) >= 300
    last = long.text.split("\n\nNow answer")[0].splitlines()[-1]
    n = int(last.split(".")[0])
    shorter = "\n".join(long.text.split("\n\nNow answer")[0].splitlines()[:-1])
    assert len(shorter.split()) + len(("Now answer this one: " + p.text).split()) < 300
    assert n > 10
    assert with_context(p, words, 3) == p  # already long enough: unchanged
    with pytest.raises(OptionError, match="context=10000000"):
        with_context(p, words, 10_000_000)


# ------------------------------------------------------------- methods, baseline, progress


def _small(same_pair, tmp_path, **kw):
    args = dict(kinds="code", per_kind=1, max_tokens=6, temperature="0", num_draft="2")
    args.update(tree_nodes="", repeats=1, output=tmp_path, charts=False, quiet=True)
    return bm.bench(*same_pair, **{**args, **kw})


def test_methods_run_exactly_as_named_against_macspec_plain(same_pair, tmp_path, monkeypatch):
    def never(*a):
        raise AssertionError("mlx-lm was timed though no mlx-lm row was asked for")

    monkeypatch.setattr(bm, "mlx_lm_step", never)
    result = _small(same_pair, tmp_path, methods="macspec_plain,macspec_adaptive")
    assert {r["method"] for r in result["runs"]} == {"macspec_plain", "macspec_adaptive"}
    assert result["meta"]["baseline"] == "macspec_plain"
    rows = {r["method"]: r for r in iter_rows(result, 0.0)}
    plain = rows["macspec_plain"]["tok_s"]["median"]
    assert rows["macspec_plain"]["speedup"] == 1.0
    assert (
        rows["macspec_adaptive"]["speedup"] == rows["macspec_adaptive"]["tok_s"]["median"] / plain
    )
    table = format_table(result)
    assert "temperature 0.0 (speedup vs macspec plain)" in table
    assert "against macspec plain at the same temperature" in table and "mlx-lm" not in table
    # The tiny draft's 72 ids are scored whole; a pruned head is named.
    assert result["meta"]["draft_vocab"] == 0 and "the draft's head" not in table
    result["meta"]["draft_vocab"] = 32768
    assert "drafter model+ngram, the draft's head over 32,768 ids; " in format_table(result)


def test_without_a_baseline_there_are_no_speedups(same_pair, tmp_path):
    result = _small(same_pair, tmp_path, methods="macspec_ngram")
    assert result["meta"]["baseline"] is None
    assert all(r["speedup"] is None and r["round_cost"] is None for r in result["summary"])
    assert "no speedups: neither mlx_lm nor macspec_plain ran" in format_table(result)


@pytest.mark.parametrize("step, runs_mlx_lm", [(0.5, True), (10.0, False)])
def test_mlx_lm_rows_are_opt_in_where_a_prompt_takes_over_a_minute(
    same_pair, tmp_path, monkeypatch, step, runs_mlx_lm
):
    # 10 s a step x 12 tokens = 120 s a prompt: left out; 0.5 s x 12 = 6 s: run.
    monkeypatch.setattr(bm, "mlx_lm_step", lambda pair, ids: step)
    result = _small(same_pair, tmp_path, max_tokens=12)
    ran = {r["method"] for r in result["runs"]}
    assert ("mlx_lm" in ran and "mlx_lm_spec" in ran) is runs_mlx_lm
    assert {"macspec_plain", "macspec_adaptive", "macspec_ngram", "macspec"} <= ran
    assert result["meta"]["baseline"] == ("mlx_lm" if runs_mlx_lm else "macspec_plain")
    skipped = {s["method"]: s["reason"] for s in result["skipped"]}
    if not runs_mlx_lm:
        why = "opt-in here: one mlx-lm step of this target takes 10.00 s, about 120 s a prompt"
        why += " of 12 tokens (> 60 s); name it in --methods"
        assert skipped["mlx_lm"] == skipped["mlx_lm_spec"] == why
    else:
        assert "mlx_lm" not in skipped
    # Named in --methods, they run whatever they cost.
    result = _small(same_pair, tmp_path, max_tokens=12, methods="mlx_lm,macspec_plain")
    assert {r["method"] for r in result["runs"]} == {"mlx_lm", "macspec_plain"}


def test_mlx_lm_step_times_the_stock_model(same_pair):
    import macspec

    pair = macspec.load(same_pair[0])
    assert 0.0 < bm.mlx_lm_step(pair, [1, 2, 3, 4]) < 10.0
    assert opt_in_reason(0.5, 120) is None and opt_in_reason(0.5, 121) is not None


def test_progress_events_count_runs_and_rates(same_pair, tmp_path):
    events = []
    result = _small(same_pair, tmp_path, methods="macspec_plain,macspec", progress=events.append)
    assert isinstance(events[-1], Finished) and events[-1].result is result
    assert isinstance(events[0], Note) and events[0].text == "loading models ..."
    updates = [e for e in events if isinstance(e, RunUpdate)]
    done = [e for e in updates if e.done]
    assert [(e.phase, e.run, e.runs) for e in done] == [
        ("warm-up", 1, 2),
        ("warm-up", 2, 2),
        ("run", 1, 2),
        ("run", 2, 2),
    ]
    for e, rec in zip(done[2:], result["runs"], strict=True):
        assert (e.label, e.prompt, e.tokens) == (rec["label"], rec["prompt"], rec["tokens"])
        assert e.tok_s == rec["decode_tokens"] / rec["decode_time"]
    # Within a run, one update per round: the tokens grow to the total.
    first = [e for e in updates if e.phase == "run" and e.run == 1]
    assert [e.tokens for e in first] == sorted(e.tokens for e in first)
    assert len(first) >= 3 and first[-1].done and not first[0].done


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_stderr_progress_lines():
    update = RunUpdate("run", 3, 36, "macspec plain", "code-1", 0.0, 0, 40, 9.75, False)
    log = io.StringIO()
    show = StderrProgress(log, every_log=3600)
    show(Note("warming up ..."))
    show(update)  # in progress, and the last line is recent: not repeated in a log
    show(dataclasses.replace(update, tokens=128, tok_s=10.0, done=True))
    assert log.getvalue().splitlines() == [
        "warming up ...",
        "[3/36] T=0.0 rep 1 macspec plain          code-1      : 128 tokens, 10.0 tok/s",
    ]
    tty = _Tty()
    show = StderrProgress(tty, every=0.0)
    show(update)
    show(dataclasses.replace(update, tokens=128, done=True))
    assert tty.getvalue() == (
        "\r\x1b[K[3/36] T=0.0 rep 1 macspec plain          code-1      : 40 tokens, 9.8 tok/s ..."
        "\r\x1b[K[3/36] T=0.0 rep 1 macspec plain          code-1      : 128 tokens, 9.8 tok/s\n"
    )
    warm = dataclasses.replace(update, phase="warm-up", repeat=-1, done=True)
    assert StderrProgress.describe(warm).startswith("[3/36] warm-up macspec plain ")


# ------------------------------------------------------------- llama.cpp as a peer


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """A tiny BPE target as a GGUF file and as the store model converted from it."""
    from support.gguf_helpers import hf_to_gguf, make_bpe_model

    from macspec.models.convert import convert

    root = tmp_path_factory.mktemp("peer")
    gguf = root / "target.gguf"
    hf_to_gguf(make_bpe_model(root / "src", seed=4, context=2048), gguf, "f32")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MACSPEC_HOME", str(root / "home"))
        target = convert(str(gguf), output="peer", dtype="float32")
    return str(target), str(gguf)


def test_llamacpp_rows_are_opt_in_and_say_what_they_lack(same_pair, tmp_path, monkeypatch):
    result = _small(same_pair, tmp_path, methods="macspec_plain,llamacpp_plain")
    assert {r["method"] for r in result["runs"]} == {"macspec_plain"}
    (why,) = [s["reason"] for s in result["skipped"] if s["method"] == "llamacpp_plain"]
    assert why in (
        "needs the target's GGUF file (--gguf FILE)",
        "needs the optional package xllamacpp (pip install xllamacpp)",
    )
    monkeypatch.setitem(sys.modules, "xllamacpp", None)  # as if it were not installed
    assert bm.unavailable("x.gguf", None)["llamacpp_draft"] == (
        "needs the optional package xllamacpp (pip install xllamacpp)"
    )
    assert "llamacpp_plain" not in DEFAULT_METHODS


def test_llamacpp_rows_run_the_gguf(gguf_pair, same_pair, tmp_path):
    pytest.importorskip("xllamacpp", reason="llama.cpp's rows need the optional xllamacpp")
    target, gguf = gguf_pair
    result = _small(
        (target, None), tmp_path, methods="macspec_plain,llamacpp_plain,llamacpp_ngram",
        gguf=gguf, max_tokens=8, num_draft="3",
    )  # fmt: skip
    runs = {r["method"]: r for r in result["runs"]}
    assert set(runs) == {"macspec_plain", "llamacpp_plain", "llamacpp_ngram"}
    # The same f32 weights and prompt ids: llama.cpp's greedy answer is macspec's.
    assert runs["llamacpp_plain"]["tokens"] == runs["macspec_plain"]["tokens"] > 0
    assert runs["llamacpp_plain"]["text"] == runs["macspec_plain"]["text"]
    assert runs["llamacpp_ngram"]["text"] == runs["macspec_plain"]["text"]
    assert result["meta"]["llamacpp"]["gguf"] == gguf
    # The target as its own draft: every draft is accepted; K is the server's (K=2 drafts fewer
    # a round than llama.cpp's own n_max=3, so fewer in all).
    result = _small(
        (target, None), tmp_path, methods="llamacpp_draft", gguf=gguf, draft_gguf=gguf,
        max_tokens=12,
    )  # fmt: skip
    k2, own = result["runs"]
    assert (k2["label"], own["label"]) == ("llama.cpp draft K=2", "llama.cpp draft (its defaults)")
    assert result["meta"]["llamacpp"]["draft_defaults"]["n_max"] == 3
    assert k2["accepted"] == k2["drafted"] > 0 and own["accepted"] == own["drafted"] > 0
    assert k2["drafted"] < own["drafted"]
    assert k2["text"] == own["text"] and k2["text"].startswith(runs["macspec_plain"]["text"])
    with pytest.raises(OptionError, match="does not have the target's vocabulary"):
        _small(same_pair, tmp_path, methods="llamacpp_plain", gguf=gguf)


def test_mtp_and_eagle3_rows_show_the_mechanism_on_tiny_models(tmp_path, monkeypatch):
    """A target that carries MTP heads gets a `macspec mtp` row, and a published EAGLE-3 draft
    (`--draft PATH`) drafts the macspec rows; at T=0 each answers what plain decoding does.
    Tiny random weights: the rows show the mechanism, not speed or acceptance."""
    from support.drafter_models import make_eagle3_draft, make_eagle_target, make_mtp_checkpoint

    from macspec.models.convert import convert

    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    src = make_mtp_checkpoint(tmp_path / "src", "deepseek_v3", count=2, seed=3)
    target = convert(str(src), output="mtp-target", dtype="float32")
    kw = dict(kinds="chat", per_kind=1, max_tokens=8, temperature="0", num_draft="2")
    kw |= dict(repeats=1, quiet=True, charts=False, output=tmp_path / "out")
    got = bm.bench(str(target), methods="macspec_plain,macspec_mtp", **kw)
    texts = {r["method"]: r["text"] for r in got["runs"]}
    assert texts["macspec_mtp"] == texts["macspec_plain"]
    assert [r["label"] for r in got["summary"] if r["kind"] == "all"][1] == "macspec mtp K=2"
    assert sum(r["drafted"] for r in got["runs"] if r["method"] == "macspec_mtp") > 0

    eagle_target = make_eagle_target(tmp_path / "eagle-target", seed=0)
    draft = make_eagle3_draft(tmp_path / "eagle3", eagle_target, "speculators", seed=1)
    got = bm.bench(str(eagle_target), str(draft), methods="macspec_plain,macspec,macspec_mtp", **kw)
    texts = {r["method"]: r["text"] for r in got["runs"]}
    assert texts["macspec"] == texts["macspec_plain"]
    assert sum(r["drafted"] for r in got["runs"] if r["method"] == "macspec") > 0
    assert {s["method"] for s in got["skipped"]} == {"macspec_mtp"}  # no heads on this target
