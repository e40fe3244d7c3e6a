"""`macspec chat`: the Textual app driven by a Pilot, its SVG snapshot, and the plain ANSI mode.

Every test runs the real engine on tiny random models (target seed 0, draft seed 1) that agree
part of the time, so replies hold accepted drafts, target tokens and rejected drafts.
"""

from __future__ import annotations

import io
import re

import pytest
from support.aio import aio
from support.tinymodels import make_tiny_model

import macspec
from macspec import cli
from macspec.api.chat_template import render as chat_prompt
from macspec.ui import create_app
from macspec.ui.plain import ANSI, answer, run_plain
from macspec.ui.transcript import DRAFT, REJECTED, TARGET, Reply
from macspec.ui.widgets import STYLES

SIZE = (120, 36)
# adaptive K follows measured timings; fixed K makes rounds (and so colours) reproducible
FIXED = {"adaptive": False}
OPTS40 = {"max_tokens": 40, "seed": 0, **FIXED}


ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def short_dirs(tmp_path_factory):
    """A target whose context holds only 32 tokens."""
    root = tmp_path_factory.mktemp("short")
    target = make_tiny_model(root / "target", seed=0, context=32)
    draft = make_tiny_model(root / "draft", seed=1, context=32)
    return target, draft


@pytest.fixture(scope="module")
def short_pair(short_dirs):
    return macspec.load(*short_dirs)


def expected_text(pair, history, **options) -> str:
    """What the engine alone answers to this conversation (the chat must show exactly this)."""
    return macspec.generate(pair, chat_prompt(pair.tokenizer, history), **options).text


def reply_views(app):
    return list(app.query(".assistant"))


def spans_by_style(view) -> dict[str, str]:
    """Rendered text of a reply grouped by style."""
    out: dict[str, str] = {}
    for span in view.content.spans:
        out[str(span.style)] = (
            out.get(str(span.style), "") + view.content.plain[span.start : span.end]
        )
    return out


async def send(app, pilot, message: str) -> None:
    app.query_one("#prompt").focus()
    await pilot.pause()
    await pilot.press(*message, "enter")
    await pilot.pause()
    await app.workers.wait_for_complete()
    await pilot.pause()


# --------------------------------------------------------------------------- the app


@aio
async def test_reply_is_the_engines_text_coloured_by_origin(chat_pair):
    app = create_app(chat_pair, **OPTS40, rejected_linger=None, timings=False)
    async with app.run_test(size=SIZE) as pilot:
        await send(app, pilot, "hello there")
        want = expected_text(chat_pair, [{"role": "user", "content": "hello there"}], **OPTS40)
        assert app.history[-1] == {"role": "assistant", "content": want}
        (view,) = reply_views(app)
        styles = spans_by_style(view)
        assert set(styles) == {STYLES[DRAFT], STYLES[TARGET], STYLES[REJECTED]}
        # without the struck-through rejected drafts, the rendered text is the answer
        shown = "".join(
            view.content.plain[s.start : s.end]
            for s in view.content.spans
            if str(s.style) != STYLES[REJECTED]
        )
        assert shown == want
        stats = str(app.query_one("#stats").content)
        result = macspec.generate(
            chat_pair,
            chat_prompt(chat_pair.tokenizer, [{"role": "user", "content": "hello there"}]),
            **OPTS40,
        )
        assert f"rounds        {result.stats.rounds}" in stats
        assert f"acceptance    {100 * result.stats.acceptance_rate:.0f}%" in stats
        assert f"accept length {result.stats.mean_accepted_length:.2f}" in stats
        assert app.sub_title == chat_pair.describe() == "target + draft draft (model+ngram)"
        assert len(app.query_one("#chart").data) == result.stats.rounds
        assert "max tokens reached" in str(app.query_one("#status").content)


@aio
async def test_rejected_drafts_toggle_and_fade(chat_pair):
    app = create_app(chat_pair, **OPTS40, rejected_linger=None)
    async with app.run_test(size=SIZE) as pilot:
        await send(app, pilot, "hello there")
        (view,) = reply_views(app)
        assert STYLES[REJECTED] in spans_by_style(view)
        await pilot.press("ctrl+r")
        assert STYLES[REJECTED] not in spans_by_style(view)
        assert "hidden" in str(app.query_one("#legend").content)
        await pilot.press("ctrl+r")
        assert STYLES[REJECTED] in spans_by_style(view)
    # with a linger time, rejected drafts are gone once it has passed
    reply = Reply(linger=0.5)
    stream = macspec.stream_generate(
        chat_pair,
        chat_prompt(chat_pair.tokenizer, [{"role": "user", "content": "hello there"}]),
        **FIXED,
    )
    for event in stream:
        reply.add_round(event, now=0.0)
    assert reply.pending_rejected()
    assert not reply.expire(now=0.4)
    assert reply.expire(now=0.6) and not reply.pending_rejected()


@aio
async def test_rejected_drafts_can_start_hidden(chat_pair):
    app = create_app(chat_pair, **OPTS40, rejected_linger=None, show_rejected=False)
    async with app.run_test(size=SIZE) as pilot:
        assert "hidden" in str(app.query_one("#legend").content)
        await send(app, pilot, "hello there")
        (view,) = reply_views(app)
        assert STYLES[REJECTED] not in spans_by_style(view)
        assert view.reply.pending_rejected()  # kept, only not shown
        await pilot.press("ctrl+r")
        assert STYLES[REJECTED] in spans_by_style(view)


def paced_after(rounds: int, app):
    """stream_generate that, after `rounds` rounds, waits (at most 10 s) for the app's stop flag:
    on a fast machine a tiny model would otherwise finish before Esc is pressed."""
    real = macspec.stream_generate

    def stream(*args, **kwargs):
        for i, event in enumerate(real(*args, **kwargs)):
            if i == rounds:  # once: if Esc did nothing, generation runs on to max_tokens
                app._stop.wait(10)
            yield event

    return stream


@aio
async def test_escape_stops_at_once_and_the_next_message_works(chat_pair, monkeypatch):
    app = create_app(chat_pair, max_tokens=1500, seed=0)
    monkeypatch.setattr(macspec, "stream_generate", paced_after(3, app))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*"hi", "enter")
        for _ in range(3000):  # until a few rounds are on screen (bounded, never a hang)
            stats = app.reply.stats if app.reply is not None else None
            if stats is not None and stats.rounds >= 3:
                break
            await pilot.pause(0.01)
        await pilot.press("escape")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert not app.busy
        first = app.history[-1]["content"]
        assert 0 < len(first) < 1500
        assert "stopped (Esc)" in str(app.query_one("#status").content)

        app.options["max_tokens"] = 30  # keep the second answer short
        monkeypatch.undo()
        await send(app, pilot, "more")
        history = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "more"},
        ]
        assert app.history[:3] == history
        # the pair was left clean: the second answer is exactly the engine's own
        assert app.history[3]["content"] == expected_text(chat_pair, history, max_tokens=30, seed=0)


@aio
async def test_prompt_too_long_and_full_context_are_messages(short_pair):
    app = create_app(short_pair, max_tokens=100, seed=0)
    async with app.run_test(size=SIZE) as pilot:
        await send(app, pilot, "this message is much longer than the context")
        errors = [str(e.content) for e in app.query(".error")]
        assert len(errors) == 1 and "context holds 32" in errors[0]
        assert app.history == []  # the rejected message is not kept
        assert not reply_views(app)

        await send(app, pilot, "hi")  # fits, then fills the context
        errors = [str(e.content) for e in app.query(".error")]
        assert len(errors) == 2 and "context is full" in errors[1]
        assert "context full" in str(app.query_one("#status").content)
        assert app.is_running


@aio
async def test_unexpected_engine_error_is_shown_not_raised(chat_pair, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the accelerator caught fire")

    monkeypatch.setattr(macspec, "stream_generate", broken)
    app = create_app(chat_pair)
    async with app.run_test(size=SIZE) as pilot:
        await send(app, pilot, "hi")
        (error,) = app.query(".error")
        assert str(error.content) == "unexpected error: RuntimeError: the accelerator caught fire"
        assert app.is_running and not app.busy


@aio
async def test_keys_change_k_and_temperature_and_k0_is_plain(chat_pair):
    app = create_app(chat_pair, max_tokens=12, seed=0, num_draft=2, **FIXED)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3", "f3", "f5", "f5", "f4")
        assert app.options["num_draft"] == 4 and app.options["temperature"] == 0.1
        assert str(app.query_one("#settings").content).startswith("K 4   T 0.1")
        await pilot.press("f4", "f2", "f2", "f2", "f2", "f2")  # K cannot go below 0
        assert app.options["num_draft"] == 0 and app.options["temperature"] == 0.0
        assert "(plain)" in str(app.query_one("#settings").content)
        await send(app, pilot, "hi")
        (view,) = reply_views(app)
        assert set(spans_by_style(view)) == {STYLES[TARGET]}  # plain decoding: no drafts
        assert "acceptance    –" in str(app.query_one("#stats").content)


@aio
async def test_new_chat_clears_the_conversation(chat_pair):
    app = create_app(chat_pair, max_tokens=8, seed=0, system="be brief")
    async with app.run_test(size=SIZE) as pilot:
        await send(app, pilot, "hi")
        assert [m["role"] for m in app.history] == ["system", "user", "assistant"]
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.history == [{"role": "system", "content": "be brief"}]
        assert not reply_views(app)
        assert [str(m.content) for m in app.query(".message")] == ["system: be brief"]


def test_unknown_option_is_an_option_error(chat_pair):
    with pytest.raises(macspec.OptionError, match="colour"):
        create_app(chat_pair, colour="blue")


def test_snapshot(chat_dirs, snap_compare):
    """Two exchanges at temperature 0 with rejected drafts kept on screen; timings hidden."""
    # a pair of its own: rounds must not depend on what earlier tests did with the shared pair
    app = create_app(macspec.load(*chat_dirs), **OPTS40, timings=False, rejected_linger=None)

    async def run_before(pilot):
        await send(app, pilot, "hello there")
        await send(app, pilot, "hi")
        app.query_one("#prompt").cursor_blink = False  # a blinking cursor differs shot to shot
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


# --------------------------------------------------------------------------- plain mode


def test_plain_mode_streams_ansi_coloured_answer(chat_pair, capsys):
    out = io.StringIO()
    rc = run_plain(chat_pair, OPTS40, prompt="hello there", out=out, color=True)
    assert rc == 0
    text = out.getvalue()
    assert ANSI[DRAFT] in text and ANSI[TARGET] in text
    lines = ANSI_RE.sub("", text).split("\n")
    assert lines[0].startswith("legend:")
    want = expected_text(chat_pair, [{"role": "user", "content": "hello there"}], **OPTS40)
    assert "\n".join(lines[1:-2]) == want
    summary = (
        r"\[40 tokens in \d+ rounds, .*acceptance \d+%, [\d.]+ tokens/round, "
        r"rounds by arm: plain \d+(, \w+ K=\d+ \d+ \(\d+ tok\))+; max tokens reached\]"
    )
    assert re.fullmatch(summary, lines[-2])


def test_plain_mode_via_cli_reads_stdin_lines(chat_dirs, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n\nmore\n"))
    monkeypatch.setenv("NO_COLOR", "1")
    target, draft = chat_dirs
    argv = ["chat", "--target", str(target), "--draft", str(draft), "--max-tokens", "10"]
    assert cli.main([*argv, "--seed", "0", "--system", "be brief"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    assert len(re.findall(r"^\[10 tokens in \d+ rounds", out, flags=re.M)) == 2


def test_cli_one_shot_prompt_error_is_a_message_and_exit_code(short_dirs, capsys):
    target, draft = (str(d) for d in short_dirs)
    long = "this message is much longer than the context"
    assert cli.main(["chat", "--target", target, "--draft", draft, "-p", long]) == 1
    captured = capsys.readouterr()
    # stderr: the loaded pair and what load() measured ([macspec] lines), then the one error line
    assert captured.err.splitlines()[-1].startswith("macspec: error: the prompt has")
    assert "Traceback" not in captured.err


def test_plain_ctrl_c_ends_only_the_answer(chat_pair, monkeypatch):
    calls = []
    real = Reply.add_round

    def interrupted(self, event, now=None):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, event, now)

    monkeypatch.setattr(Reply, "add_round", interrupted)
    history = [{"role": "user", "content": "hi"}]
    reply = answer(chat_pair, history, OPTS40, io.StringIO(), interruptible=True)
    assert reply.stopped and reply.stats.rounds == 2
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        answer(chat_pair, history, OPTS40, io.StringIO())


def test_cli_load_error_is_a_message(capsys, tmp_path):
    missing = tmp_path / "nope"
    assert cli.main(["chat", "--target", str(missing), "-p", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("macspec: error: ") and "nope" in err and "Traceback" not in err


# --------------------------------------------------------------------------- pieces


def test_plain_mode_reports_a_bad_message_and_goes_on(short_pair):
    out = io.StringIO()
    lines = ["this message is much longer than the context\n", "hi\n"]
    err = io.StringIO()
    options = {"seed": 0, **FIXED}
    assert run_plain(short_pair, options, lines=lines, out=out, err=err, color=False) == 0
    assert err.getvalue().startswith("macspec: error: the prompt has")
    text = out.getvalue()
    assert re.search(r"^\[.*; context full\]$", text, flags=re.M)


def test_reply_cuts_a_stop_string_like_the_engine(chat_pair):
    prompt = chat_prompt(chat_pair.tokenizer, [{"role": "user", "content": "hello there"}])
    full = macspec.generate(chat_pair, prompt, **OPTS40).text
    stop = full[12:15]
    reply = Reply()
    for event in macspec.stream_generate(chat_pair, prompt, stop=stop, **OPTS40):
        reply.add_round(event)
    assert reply.finish_reason == "stop_string"
    assert reply.text == full[: full.index(stop)]


@aio
async def test_a_failing_reply_is_one_message_and_stops_generation(chat_pair, monkeypatch):
    def broken(self, event, now=None):
        raise ValueError("cannot decode")

    monkeypatch.setattr(Reply, "add_round", broken)
    app = create_app(chat_pair, max_tokens=1500, seed=0)
    async with app.run_test(size=SIZE) as pilot:
        await send(app, pilot, "hi")
        (error,) = app.query(".error")
        assert str(error.content) == "unexpected error: ValueError: cannot decode"
        assert str(app.query_one("#status").content) == "stopped after an error"
        assert app.history == [] and app.is_running and not app.busy


@aio
async def test_conversation_follows_the_answer(chat_pair):
    app = create_app(chat_pair, max_tokens=300, seed=0, **FIXED)
    async with app.run_test(size=(80, 16)) as pilot:
        conversation = app.query_one("#conversation")
        await send(app, pilot, "hi")
        assert 0 < conversation.max_scroll_y == conversation.scroll_y
        conversation.scroll_home(animate=False)
        await pilot.pause()
        assert conversation.scroll_y == 0
        await send(app, pilot, "again")  # a new message brings the end back into view
        assert 0 < conversation.max_scroll_y == conversation.scroll_y


# --------------------------------------------------------------------------- prompt cache


def fresh_text(pair, history, **options) -> str:
    kept, pair.prompt_cache = pair.prompt_cache, None
    try:
        return expected_text(pair, history, **options)
    finally:
        pair.prompt_cache = kept


@aio
async def test_the_next_message_reads_only_its_new_tokens(chat_pair):
    chat_pair.prompt_cache.clear()
    app = create_app(chat_pair, **OPTS40, timings=False)
    async with app.run_test(size=SIZE) as pilot:
        await send(app, pilot, "hello there")
        await send(app, pilot, "and once more")
        first, second = (view.reply.stats for view in reply_views(app))
        assert first.cached_tokens == 0
        assert first.prompt_tokens < second.cached_tokens < second.prompt_tokens
        assert app.history[-1]["content"] == fresh_text(chat_pair, app.history[:-1], **OPTS40)


def test_plain_mode_reuses_the_prompt_cache_too(chat_pair):
    chat_pair.prompt_cache.clear()
    history = [{"role": "user", "content": "the cat sat"}]
    first = answer(chat_pair, history, OPTS40, io.StringIO(), color=False)
    history += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "on the mat"},
    ]
    second = answer(chat_pair, history, OPTS40, io.StringIO(), color=False)
    assert first.stats.prompt_tokens < second.stats.cached_tokens
    assert second.text == fresh_text(chat_pair, history, **OPTS40)


def test_reply_says_what_the_last_round_verified_and_kept(chat_pair):
    """A chain round: who drafted, kept of drafted; a token tree (more nodes than depth): its
    nodes and the accepted path's depth; a plain step says so."""
    prompt = chat_prompt(chat_pair.tokenizer, [{"role": "user", "content": "hello there"}])
    for options, tree in ((FIXED, False), ({**FIXED, "tree_nodes": 6}, True)):
        reply, shown = Reply(), []
        for event in macspec.stream_generate(chat_pair, prompt, **options):
            reply.add_round(event, now=0.0)
            if event.rows > 1:
                shown.append(reply.last_round)
                drafts, kept = event.rows - 1, len(event.accepted)
                assert event.drafter in ("model", "ngram")  # who drafted, named
                assert reply.last_round in (
                    f"{event.drafter} tree {drafts}: depth {kept}",
                    f"{event.drafter} {kept} of {drafts} kept",
                )
            else:
                assert reply.last_round == "plain step"
        trees = [s for s in shown if s.startswith("model tree 6: depth ")]
        assert shown and (bool(trees) == tree), shown
