"""`macspec serve` decoding constrained output, beyond checking the fields: response_format
(json_object, json_schema), tool_choice "required" and a named function (arguments constrained
to the function's schema), and logprobs; answers equal `macspec.generate` with the same options,
through the `openai` client, whole and streamed. Bad fields are a 400 naming them."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from support.scripted_server import TOOL_TEMPLATE
from support.tinymodels import DEFAULT_CHARS, make_tiny_model

import macspec
from macspec.server.command import serving

CHARS = DEFAULT_CHARS + '{}[]":-<>_/'
QUESTION = [{"role": "user", "content": "what is the weather in paris"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _model(path):
    path = make_tiny_model(path, seed=0, hidden=48, tie=False, context=2048, chars=CHARS)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    target = _model(root / "target")
    draft = make_tiny_model(root / "draft", seed=0, hidden=48, tie=False, perturb=0.3, chars=CHARS)
    return macspec.load(target, draft)


@pytest.fixture(scope="module")
def url(pair):
    with serving(pair) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_response_format_is_generate_with_the_schema(pair, client):
    for fmt, schema in [
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}, PERSON),
        ({"type": "json_object"}, {"type": "object"}),
    ]:
        ask = {"model": "target", "messages": QUESTION, "max_tokens": 60, "response_format": fmt}
        got = client.chat.completions.create(**ask).choices[0]
        want = macspec.generate(pair, messages=QUESTION, max_tokens=60, json_schema=schema)
        assert got.message.content == want.text
        assert got.finish_reason == want.finish_reason
        if got.finish_reason == "stop":
            jsonschema.validate(json.loads(got.message.content), schema)
        streamed = client.chat.completions.create(**ask, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == want.text
    got = client.completions.create(
        model="target", prompt="a person:", max_tokens=60, extra_body={"response_format": fmt}
    )
    assert (
        got.choices[0].text
        == macspec.generate(pair, "a person:", max_tokens=60, json_schema={"type": "object"}).text
    )


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_a_required_or_named_call_is_one_with_valid_arguments(client, choice):
    tool_choice = (
        choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    )
    ask = {"model": "target", "messages": QUESTION, "tools": TOOLS, "tool_choice": tool_choice}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for temperature, seed in [(0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3)]:
        got = client.chat.completions.create(
            **ask, max_tokens=200, temperature=temperature, seed=seed
        ).choices[0]
        # An untrained model may go on writing calls past max_tokens: then "length".
        assert got.finish_reason == ("tool_calls" if temperature == 0 else got.finish_reason)
        assert got.finish_reason in ("tool_calls", "length") and got.message.tool_calls
        for call in got.message.tool_calls:
            if choice != "required":
                assert call.function.name == choice
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    streamed = list(client.chat.completions.create(**ask, max_tokens=120, stream=True))
    deltas = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
    whole = client.chat.completions.create(**ask, max_tokens=120).choices[0].message.tool_calls
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_logprobs_are_generates_in_openai_shapes(pair, client):
    ask = {"model": "target", "messages": QUESTION, "max_tokens": 12}
    got = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3).choices[0]
    events = list(macspec.stream_generate(pair, messages=QUESTION, max_tokens=12, top_logprobs=3))
    want = [x for ev in events for x in ev.logprobs]
    content = got.logprobs.content
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in want], abs=1e-5)
    assert "".join(c.token for c in content) == got.message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)
    streamed = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3, stream=True)
    lps = [
        c.logprob
        for ch in streamed
        for c in (ch.choices[0].logprobs.content if ch.choices and ch.choices[0].logprobs else [])
    ]
    assert lps == pytest.approx([x.logprob for x in want], abs=1e-5)
    legacy = client.completions.create(model="target", prompt="ab", max_tokens=6, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert "".join(lp.tokens) == legacy.choices[0].text and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset[0] == 0 and len(lp.token_logprobs) == 6


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools",
        ),
    ],
)
def test_bad_fields_are_400s_naming_them_and_the_server_goes_on(url, extra, param):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": QUESTION, **extra}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.json()
    ok = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200
