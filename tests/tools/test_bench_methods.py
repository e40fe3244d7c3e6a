"""`macspec bench`'s methods run as named against macspec plain, its progress, and its peers
(mlx-lm, llama.cpp on a GGUF, MTP and EAGLE-3 rows) on tiny models."""

from __future__ import annotations

import dataclasses
import io
import sys

import pytest

from macspec.base.errors import OptionError
from macspec.tools.bench import command as bm
from macspec.tools.bench.plan import DEFAULT_METHODS, opt_in_reason
from macspec.tools.bench.progress import Finished, Note, RunUpdate, StderrProgress
from macspec.tools.bench.report import (
    format_table,
    iter_rows,
)

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


def test_llamacpp_rows_run_the_gguf(gguf_target, same_pair, tmp_path):
    pytest.importorskip("xllamacpp", reason="llama.cpp's rows need the optional xllamacpp")
    target, gguf = gguf_target
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
