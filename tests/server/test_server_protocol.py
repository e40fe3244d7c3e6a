"""`macspec serve` and what real clients send besides plain chat: response_format, tools,
tool_choice, tool messages and logprobs are checked field by field (a bad one is a 400 naming
it, and the server goes on serving); tools go through the target's template and the calls a real
model writes come back as OpenAI tool_calls, whole or streamed."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.scripted_server import scripted_serving, tool_model

import macspec
from macspec.api import chat_template
from macspec.api import stream as api
from macspec.api.tool_calls import ToolCallStream, check_tools, family_of
from macspec.models.store import store_root
from macspec.server.command import serving

QUESTION = [{"role": "user", "content": "what is the weather in paris"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER},
    }
]


@pytest.fixture(scope="module")
def tool_pair(tmp_path_factory):
    """The test model with a template that takes tools (no draft: these tests are not about it)."""
    return macspec.load(tool_model(tmp_path_factory.mktemp("tools") / "target"), measure=False)


@pytest.fixture(scope="module")
def url(tool_pair):
    with serving(tool_pair) as base:
        yield base


@pytest.fixture(scope="module")
def plain_url(chat_dirs):
    """A pair whose template takes no tools."""
    with serving(macspec.load(*chat_dirs, measure=False)) as base:
        yield base


def post(url, body, endpoint="chat/completions"):
    return httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=60)


def test_tools_go_through_the_template_and_plain_text_stays_content(tool_pair, url):
    body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 30, "temperature": 0.0}
    got = post(url, body).json()["choices"][0]
    prompt = chat_template.render(tool_pair.tokenizer, QUESTION, check_tools(TOOLS))
    assert prompt.startswith("tools: get_weather \n")
    want = macspec.generate(tool_pair, prompt, max_tokens=30, temperature=0.0)
    assert got["message"] == {"role": "assistant", "content": want.text}
    assert got["finish_reason"] == ("length" if want.finish_reason == "length" else "stop")
    none = post(url, {**body, "tool_choice": "none"}).json()["choices"][0]["message"]["content"]
    assert none == macspec.generate(tool_pair, messages=QUESTION, max_tokens=30).text


def test_tool_calls_and_results_in_the_history_are_rendered(tool_pair, url):
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"messages": history, "tools": TOOLS, "max_tokens": 5}
    r = post(url, body)
    assert r.status_code == 200, r.text
    prompt = chat_template.render(tool_pair.tokenizer, history, check_tools(TOOLS))
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}' in prompt
    assert "tool: sunny\n" in prompt
    assert r.json()["usage"]["prompt_tokens"] == len(api.prompt_ids(tool_pair, prompt))


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
BAD = [
    ({"response_format": BAD_SCHEMA}, "response_format", "invalid_value"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        None,
    ),
    ({"response_format": {"type": "xml"}}, "response_format", None),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
        "response_format",
        "invalid_value",
    ),
    ({"json_schema": {"type": "nope"}}, "json_schema", "invalid_value"),
    ({"grammar": "start: foo"}, "grammar", "invalid_value"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
        "tools[0].function.parameters",
        "invalid_value",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{"}}]},
        "tools[0].function.parameters",
        "invalid_value",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        "tool_choice",
        "invalid_value",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ({"top_logprobs": 3}, "top_logprobs", None),
    ({"logprobs": "yes"}, "logprobs", None),
    (
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]},
        "messages[0]",
        None,
    ),
    ({"n": 2}, "n", "unsupported"),
]


@pytest.mark.parametrize("extra, param, code", BAD, ids=range(len(BAD)))
def test_a_bad_field_is_a_400_naming_it_and_the_server_goes_on(url, extra, param, code):
    r = post(url, {"messages": QUESTION, "max_tokens": 3, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    if code:
        assert error["code"] == code
    assert post(url, {"messages": QUESTION, "max_tokens": 3}).status_code == 200


def test_completions_check_their_own_fields(url):
    r = post(url, {"prompt": "ab", "logprobs": 21}, "completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = post(url, {"prompt": "ab", "tools": TOOLS}, "completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = post(url, {"prompt": "ab", "response_format": BAD_SCHEMA}, "completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_a_template_without_tools_is_a_400_that_says_so(plain_url):
    r = post(plain_url, {"messages": QUESTION, "tools": TOOLS})
    assert r.status_code == 400
    assert (
        r.json()["error"]["param"] == "tools" and "no tool support" in r.json()["error"]["message"]
    )
    r = post(plain_url, {"messages": QUESTION, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200  # no tools asked for: none rendered


# ---------------------------------------------------------------- calls in answers

SCRIPT = [
    "Sure.",
    "\n<tool_",
    'call>\n{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}',
    "\n</tool_call>",
]


@pytest.fixture(scope="module")
def scripted_url(tool_pair):
    with scripted_serving(tool_pair, lambda prompt: SCRIPT) as base:
        yield base


def test_calls_come_back_as_tool_calls_whole_and_streamed(scripted_url):
    client = openai.OpenAI(base_url=scripted_url + "/v1", api_key="unused", max_retries=0)
    ask = {"model": "target", "messages": QUESTION, "tools": TOOLS}
    got = client.chat.completions.create(**ask).choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content == "Sure."
    (call,) = got.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure."
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", '{"city": "Paris"}')
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(**{**ask, "tool_choice": "none"}).choices[0]
    assert plain.message.content == "".join(SCRIPT) and plain.message.tool_calls is None


def test_a_real_models_call_is_read(tmp_path):
    """Qwen2.5-Coder-0.5B-Instruct where the store has it (its converted GGUF; never fetched
    here): its answer to a question for the tool, through its own template, is the call."""
    path = store_root() / "qwen2.5-coder-0.5b"
    if not (path / "config.json").is_file():
        pytest.skip(f"{path} is not in the model store")
    pair = macspec.load(path, measure=False)
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    tools = check_tools(TOOLS)
    prompt = chat_template.render(pair.tokenizer, ask, tools)
    text = macspec.generate(pair, prompt, max_tokens=60, temperature=0.0).text
    reader = ToolCallStream(family_of(pair.tokenizer.chat_template))
    content = reader.feed(text)[0] + reader.finish()[0]
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in reader.calls] == [
        ("get_weather", {"city": "Paris"})
    ]
