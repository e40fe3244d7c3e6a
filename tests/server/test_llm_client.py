"""`macspec serve` as the local model of simonw's `llm` CLI, through llm's own code path: an
OpenAI-compatible model entry in extra-openai-models.yaml (as the README shows), a prompt
streamed and whole, the usage llm logs, and a tool llm runs itself on the call the server
returns, whose result comes back in the next request as a tool message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.scripted_server import scripted_serving, tool_model

import macspec
from macspec.server.command import serving

LLM = Path(sys.executable).parent / "llm"
pytestmark = [
    pytest.mark.skipif(not LLM.is_file(), reason="the llm CLI is not installed"),
    pytest.mark.subprocess,
]


def configure(home: Path, base: str, model_name: str) -> dict[str, str]:
    """llm's user folder with one model entry for the server; the environment that uses it."""
    home.mkdir(exist_ok=True)
    entry = (
        f"- model_id: macspec\n  model_name: {model_name}\n  api_base: {base}/v1\n"
        "  supports_tools: true\n"
    )
    (home / "extra-openai-models.yaml").write_text(entry)
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}  # none is needed
    return {**env, "LLM_USER_PATH": str(home)}


def llm(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [str(LLM), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_llm_prompts_get_the_engines_answer(chat_dirs, tmp_path):
    pair = macspec.load(*chat_dirs, measure=False)
    question = [{"role": "user", "content": "the cat sat"}]
    want = macspec.generate(pair, messages=question, max_tokens=12, temperature=0.0).text
    with serving(pair) as base:
        env = configure(tmp_path / "llm", base, pair.target_path.name)
        assert "OpenAI Chat: macspec" in llm(env, "models")
        options = ["-o", "max_tokens", "12", "-o", "temperature", "0"]
        assert llm(env, "-m", "macspec", "the cat sat", *options) == want + "\n"
        assert llm(env, "-m", "macspec", "--no-stream", "the cat sat", *options) == want + "\n"
        logged = json.loads(llm(env, "logs", "-n", "1", "--json"))[0]
    assert logged["response"] == want and logged["output_tokens"] == len(
        macspec.generate(pair, messages=question, max_tokens=12).tokens
    )
    assert "speculative" in json.loads(logged["token_details"])


def answer(prompt: str) -> list[str]:
    """A call first; once the tool's result is in the prompt (the template's "tool: ..." line,
    its ':' outside the test tokenizer's characters), an answer that quotes it."""
    results = [line.split(" ", 1)[1] for line in prompt.split("\n") if line.startswith("tool<")]
    if results:
        return ["It is ", results[-1], "."]
    return ['<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}</tool_call>']


def test_llm_runs_the_tool_the_server_calls(tmp_path):
    pair = macspec.load(tool_model(tmp_path / "target"), measure=False)
    functions = "def get_weather(city: str) -> str:\n    return city.upper() + ' is sunny'\n"
    with scripted_serving(pair, answer) as base:
        env = configure(tmp_path / "llm", base, "target")
        out = llm(env, "-m", "macspec", "--functions", functions, "weather in paris?")
    assert out.strip() == "It is PARIS is sunny."
