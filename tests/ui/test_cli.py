"""`macspec generate` mirrors macspec.generate(); errors become one message and an exit code."""

import json

import pytest

import macspec
from macspec.cli import main


def test_generate_json_equals_the_api(tiny_dirs, capsys):
    target, draft = map(str, tiny_dirs)
    args = ["generate", "Hello", "--target", target, "--draft", draft, "--raw-prompt"]
    args += ["--max-tokens", "20", "--temperature", "0.8", "--seed", "4", "--num-draft", "3"]
    assert main([*args, "--no-adaptive", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    pair = macspec.load(target, draft)
    r = macspec.generate(
        pair, "Hello", max_tokens=20, temperature=0.8, seed=4, num_draft=3, adaptive=False
    )
    assert out["tokens"] == r.tokens
    assert out["stats"]["accepted"] == r.stats.accepted
    assert out["stats"]["drafted"] == r.stats.drafted


def test_generate_streams_text_and_a_summary(tiny_dirs, capsys):
    target = str(tiny_dirs[0])
    assert (
        main(["generate", "Hi", "--target", target, "--drafter", "ngram", "--max-tokens", "12"])
        == 0
    )
    captured = capsys.readouterr()
    pair = macspec.load(target)
    prompt = pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert captured.out == macspec.generate(pair, prompt, max_tokens=12).text + "\n"
    assert "ngram drafting" in captured.err and "tok/s" in captured.err


def test_no_speculation_decodes_without_measuring_the_machine(tiny_dirs, capsys, monkeypatch):
    import macspec.api.pair
    import macspec.api.stream

    def refuse(pair):
        raise AssertionError("plain decoding measured the speculation costs")

    target, draft = map(str, tiny_dirs)
    monkeypatch.setattr(macspec.api.pair, "calibrate", refuse)
    args = ["generate", "Hi", "--target", target, "--draft", draft, "--raw-prompt"]
    assert main([*args, "--max-tokens", "12", "--no-speculation"]) == 0
    captured = capsys.readouterr()
    assert "measured this machine" not in captured.err
    pair = macspec.load(target, draft, measure=False)
    assert pair.costs is None
    assert (
        captured.out == macspec.generate(pair, "Hi", max_tokens=12, speculative=False).text + "\n"
    )
    # Speculating later on such a pair measures then, once.
    calls, real = [], macspec.api.stream.calibrate
    monkeypatch.setattr(macspec.api.stream, "calibrate", lambda p: calls.append(p) or real(p))
    macspec.generate(pair, "Hi", max_tokens=6)
    macspec.generate(pair, "Hi", max_tokens=6)
    assert calls == [pair]


def test_speculating_commands_measure_the_machine_at_load(tiny_dirs, capsys, monkeypatch):
    import macspec.api.stream

    def refuse(pair):
        raise AssertionError("the first answer measured the speculation costs")

    target, draft = map(str, tiny_dirs)
    monkeypatch.setattr(macspec.api.stream, "calibrate", refuse)
    args = ["generate", "Hi", "--target", target, "--draft", draft, "--max-tokens", "8"]
    assert main(args) == 0
    assert "measured this machine" in capsys.readouterr().err


def test_the_summary_compares_with_plain_decoding_only_when_it_speculated(pair):
    spec = macspec.generate(pair, "Hi", max_tokens=12, num_draft=2, adaptive=False)
    assert "x plain: " in spec.stats.summary()
    plain = macspec.generate(pair, "Hi", max_tokens=12, speculative=False)
    assert "tok/s" in plain.stats.summary() and "x plain" not in plain.stats.summary()


def test_errors_are_one_line_and_an_exit_code(tmp_path, capsys):
    assert main(["generate", "Hi", "--target", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("macspec: error: ") and "missing" in err and "Traceback" not in err


def test_invalid_option_exit_code(tiny_dirs, capsys):
    assert main(["generate", "Hi", "--target", str(tiny_dirs[0]), "--num-draft", "0"]) == 2
    assert "num_draft" in capsys.readouterr().err


def test_messages_equal_the_cli_templated_prompt(tiny_dirs, capsys):
    target, draft = map(str, tiny_dirs)
    args = ["generate", "Tell me", "--target", target, "--draft", draft, "--system", "Be brief."]
    # --no-adaptive: K then does not depend on the costs each load measures, nor the samples on K
    args += ["--max-tokens", "16", "--temperature", "0.7", "--seed", "2", "--no-adaptive"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    pair = macspec.load(target, draft)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me"}]
    options = {"max_tokens": 16, "temperature": 0.7, "seed": 2, "adaptive": False}
    r = macspec.generate(pair, messages=messages, **options)
    assert r.tokens == out["tokens"]
    templated = pair.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert macspec.generate(pair, templated, **options).tokens == r.tokens


def test_messages_are_checked(tiny_dirs):
    pair = macspec.load(tiny_dirs[0])
    for bad, match in [
        ([], "non-empty list"),
        ([{"role": "user"}], "'role' and 'content'"),
        ([{"role": "robot", "content": "x"}], "role 'robot'"),
        ([{"role": "user", "content": 3}], "must be a string"),
    ]:
        with pytest.raises(macspec.PromptError, match=match):
            macspec.generate(pair, messages=bad)
    with pytest.raises(macspec.PromptError, match="not both"):
        macspec.generate(pair, "hi", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("flag", "want"), [([], macspec.api.pair.DRAFT_CONTEXT), (["0"], 0), (["7"], 7)]
)
def test_draft_context_flag_reaches_the_pair(tiny_dirs, capsys, monkeypatch, flag, want):
    import macspec.api.pair

    loaded = []
    real = macspec.api.pair.load
    monkeypatch.setattr(macspec.api.pair, "load", lambda *a, **k: loaded.append(k) or real(*a, **k))
    target, draft = map(str, tiny_dirs)
    args = ["generate", "Hi", "--target", target, "--draft", draft, "--max-tokens", "4"]
    assert main([*args, *(["--draft-context", *flag] if flag else [])]) == 0
    assert loaded[0]["draft_context"] == want


def test_a_negative_draft_context_is_one_message(tiny_dirs, capsys):
    target, draft = map(str, tiny_dirs)
    args = ["generate", "Hi", "--target", target, "--draft", draft, "--draft-context", "-3"]
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "draft_context=-3" in err and "Traceback" not in err


def test_the_chat_paints_fewer_frames_where_the_cpu_generates(monkeypatch):
    """On the CPU the app's default frame rate is CPU_FPS (its drawing would take a core from
    the answer); a user's own TEXTUAL_FPS stands, and elsewhere Textual keeps its own."""
    import sys

    import mlx.core as mx

    from macspec.ui import command

    monkeypatch.delitem(sys.modules, "textual.screen", raising=False)  # as before Textual loads
    monkeypatch.delenv("TEXTUAL_FPS", raising=False)
    command._frame_rate()
    want = str(command.CPU_FPS) if mx.default_device() == mx.cpu else None
    assert command.os.environ.get("TEXTUAL_FPS") == want
    monkeypatch.setenv("TEXTUAL_FPS", "50")
    command._frame_rate()
    assert command.os.environ["TEXTUAL_FPS"] == "50"
