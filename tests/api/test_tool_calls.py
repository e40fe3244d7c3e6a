"""Tool calls (macspec/api/tool_calls.py, chat_template.render with tools): requests checked with
the field named; each family's calls found in what its real template writes for an assistant's
calls, whole or fed in pieces of any size; text that is no call stays text; "required" becomes a
constraint that only allows calls in the template's format with valid arguments."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
from support.chat_templates import Unreachable, templates
from support.tinymodels import DEFAULT_CHARS, write_char_tokenizer
from transformers import AutoTokenizer

from macspec.api import chat_template
from macspec.api.grammar import Grammar
from macspec.api.tool_calls import (
    Choice,
    ToolCallStream,
    ToolError,
    check_choice,
    check_tools,
    family_of,
    parse_body,
    required_spec,
)
from macspec.base.errors import PromptError

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "description": "the time"}},
]
CALLS = [
    {"name": "get_weather", "arguments": {"city": 'Paris "N"', "days": 3}},
    {"name": "now", "arguments": {}},
]
CHECKED = check_tools(TOOLS)  # as the server renders them
USER = [{"role": "user", "content": "weather?"}]
FAMILY = {
    "qwen2.5": "hermes",
    "hermes3": "hermes",
    "llama3.1": "llama3",
    "llama3.2": "llama3",
    "llama3.3": "llama3",
    "mistral-nemo": "mistral",
    "mistral-small-3.2": "mistral",
    "gemma4": "gemma",
    "gemma2": None,
}
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "</s>", "<|tool_response>", "<turn|>", "<end_of_turn>")


@pytest.fixture(scope="module")
def real():
    try:
        return templates()
    except Unreachable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("chars")
    write_char_tokenizer(path, DEFAULT_CHARS + '{}[]":-_<>|/\\')
    return AutoTokenizer.from_pretrained(str(path))


def with_template(tok, template):
    tok.chat_template = template
    return tok


def openai_calls(calls):
    return [
        {
            "id": f"abcDEF12{i}",
            "type": "function",
            "function": {**c, "arguments": json.dumps(c["arguments"])},
        }
        for i, c in enumerate(calls)
    ]


def assistant_text(tok, calls) -> str:
    """What the template writes for an assistant's calls: the model is taught to write this."""
    pre = tok.apply_chat_template(USER, tools=CHECKED, add_generation_prompt=True, tokenize=False)
    said = [*USER, {"role": "assistant", "content": None, "tool_calls": openai_calls(calls)}]
    full = tok.apply_chat_template(
        chat_template.check_messages(said),
        tools=CHECKED,
        add_generation_prompt=False,
        tokenize=False,
    )
    text = full[len(pre) :] if full.startswith(pre) else full[full.rindex("<|turn>model\n") + 13 :]
    while text.rstrip().endswith(END_OF_TURN):
        text = text.rstrip()
        text = text[: -len(next(e for e in END_OF_TURN if text.endswith(e)))]
    return text


def stream(family, text, sizes):
    """(content, calls) of `text` fed in pieces of the given sizes, cycled."""
    s, content, at, i = ToolCallStream(family), "", 0, 0
    while at < len(text):
        n = sizes[i % len(sizes)]
        out, _ = s.feed(text[at : at + n])
        content, at, i = content + out, at + n, i + 1
    out, _ = s.finish()
    return content + out, [(c.name, json.loads(c.arguments)) for c in s.calls]


@pytest.mark.parametrize("name", list(FAMILY))
def test_each_family_reads_back_what_its_real_template_writes(real, tok, name):
    template = real[name]
    assert family_of(template) == FAMILY[name]
    with_template(tok, template)
    assert chat_template.supports_tools(tok) == (FAMILY[name] is not None)
    if FAMILY[name] is None:
        with pytest.raises(ToolError, match="no tool support") as e:
            chat_template.render(tok, USER, TOOLS)
        assert e.value.param == "tools"
        return
    n = 1 if FAMILY[name] == "llama3" else 2  # Llama 3's templates take one call a turn
    text = assistant_text(tok, CALLS[:n])
    want = [(c["name"], c["arguments"]) for c in CALLS[:n]]
    for sizes in ([len(text)], [1], [3, 1, 7], [2, 5]):
        assert stream(FAMILY[name], text, sizes) == ("", want), (text, sizes)
    content, calls = stream(FAMILY[name], "Let me look.\n" + text, [4])
    if FAMILY[name] == "llama3":  # a bare JSON call counts only as the whole answer
        assert calls == []
    else:
        assert content == "Let me look." and calls == want


def test_calls_have_openai_ids_and_json_arguments():
    s = ToolCallStream("mistral")
    s.feed('[TOOL_CALLS][{"name": "now", "arguments": {}}]')
    s.finish()
    (call,) = s.calls
    assert len(call.id) == 9 and call.id.isalnum()  # Mistral's templates take back only these
    assert call.openai(0) == {
        "index": 0,
        "id": call.id,
        "type": "function",
        "function": {"name": "now", "arguments": "{}"},
    }
    s = ToolCallStream("hermes")
    s.feed('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert s.calls[0].id.startswith("call_") and json.loads(s.calls[0].arguments) == {"a": 1}


def test_text_is_held_back_only_while_it_may_begin_a_call():
    s = ToolCallStream("hermes")
    assert s.feed("Hello <tool") == ("Hello", [])  # the space too: it is released with what follows
    assert s.feed("box> here") == (" <toolbox> here", [])
    assert s.finish() == ("", [])
    s = ToolCallStream("llama3")
    assert s.feed("  ") == ("", []) and s.feed('{"a": 1} is JSON') == ("", [])
    assert s.finish() == ('  {"a": 1} is JSON', [])  # not a call: given back whole
    s = ToolCallStream("llama3")
    assert s.feed("Sure: {") == ("Sure: {", [])  # the answer began as text


@pytest.mark.parametrize(
    "family, text",
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": </tool_call>'),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"a": '),
        ("gemma", "<|tool_call>call:f{a:<tool_call|>"),
        ("llama3", '<|python_tag|>brave_search.call(query="x")'),
    ],
)
def test_a_malformed_call_stays_text(family, text):
    assert stream(family, text, [3]) == (text, [])


def test_several_calls_in_one_answer():
    text = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'
    assert stream("mistral", text, [5])[1] == [("a", {"x": 1}), ("b", {})]
    body = '{"name": "a", "parameters": {"s": ";"}}; {"name": "b", "parameters": {}}'
    assert [(c.name, c.arguments) for c in parse_body("llama3", body)] == [
        ("a", '{"s": ";"}'),
        ("b", "{}"),
    ]
    gemma = 'call:f{q:<escape>a, b: c<escape>,n:{<|"|>k<|"|>:[1,true]}}'
    assert json.loads(parse_body("gemma", gemma)[0].arguments) == {
        "q": "a, b: c",
        "n": {"k": [1, True]},
    }


@pytest.mark.parametrize(
    "tools, param",
    [
        ("f", "tools"),
        ([{"type": "code"}], "tools[0]"),
        ([{"type": "function", "function": {}}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
        ([TOOLS[1], TOOLS[1]], "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "{oops"}}],
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_name_the_field(tools, param):
    with pytest.raises(ToolError) as e:
        check_tools(tools)
    assert e.value.param == param


def test_tool_choice():
    tools = check_tools(TOOLS)
    assert check_choice(None, tools) == Choice("auto") and check_choice(None, []) == Choice("none")
    assert check_choice("required", tools) == Choice("required")
    named = {"type": "function", "function": {"name": "now"}}
    assert check_choice(named, tools) == Choice("required", "now")
    for bad in ({"type": "function", "function": {"name": "later"}}, "always", {"name": "now"}):
        with pytest.raises(ToolError) as e:
            check_choice(bad, tools)
        assert e.value.param == "tool_choice"
    with pytest.raises(ToolError, match="needs tools"):
        check_choice("required", [])


def test_tool_messages_go_through_the_template(real, tok):
    with_template(tok, real["qwen2.5"])
    said = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": openai_calls(CALLS[:1])},
        {"role": "tool", "tool_call_id": "abcDEF120", "content": "sunny"},
    ]
    text = chat_template.render(tok, said, CHECKED)
    assert '"arguments": {"city": "Paris \\"N\\"", "days": 3}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(PromptError, match="not JSON"):
        bad = [
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
            },
        ]
        chat_template.render(tok, bad, CHECKED)


def walk(g: Grammar, tok, rng: random.Random, limit: int = 400):
    """Ids drawn from the masks, leaning to characters that close things (a uniform walk writes
    long strings), until the constraint is done; None past `limit`."""
    closing = {2, *tok.encode('"}]>/<\n0', add_special_tokens=False)}  # 2: the stop id
    out = []
    while len(out) < limit and not g.done():
        allowed = np.flatnonzero(g.allowed()).tolist()
        lean = [t for t in allowed if t in closing]
        token = rng.choice(lean if lean and rng.random() < 0.7 else allowed)
        if token == 2:
            return out
        g.commit([token])
        out.append(token)
    return out if g.done() else None


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.2", "mistral-nemo", "mistral-small-3.2"])
@pytest.mark.parametrize("choice", [Choice("required"), Choice("required", "get_weather")])
def test_required_allows_only_calls_with_valid_arguments(real, tok, name, choice):
    template, family = real[name], FAMILY[name]
    spec = required_spec(template, check_tools(TOOLS), choice, set())
    g = Grammar.for_pair(spec, tok, len(tok), [2])
    text = assistant_text(with_template(tok, template), CALLS[:1])
    ids = tok.encode(text.replace("[CALL_ID]abcDEF120", ""), add_special_tokens=False)
    assert g.valid_prefix(ids) == len(ids)
    assert g.valid_prefix(tok.encode("Sure!", add_special_tokens=False)) == 0
    rng, done = random.Random(0), 0
    for _ in range(10):
        g = Grammar.for_pair(spec, tok, len(tok), [2])
        out = walk(g, tok, rng)
        if out is None:
            continue
        content, calls = stream(family, tok.decode(out), [7])
        assert content == "" and calls, tok.decode(out)
        for fname, arguments in calls:
            assert fname in ({choice.name} if choice.name else {"get_weather", "now"})
            if fname == "get_weather":
                jsonschema.validate(arguments, WEATHER)
        done += 1
    assert done >= 3


@pytest.mark.parametrize("name", ["qwen2.5", "mistral-nemo", "mistral-small-3.2"])
def test_a_named_function_or_no_parallel_calls_is_exactly_one_call(real, tok, name):
    template = real[name]
    two = assistant_text(with_template(tok, template), [CALLS[0], CALLS[0]])
    two = re.sub(r"\[CALL_ID\]abcDEF12\d", "", two)  # ids the grammar leaves to the server
    two_ids = tok.encode(two, add_special_tokens=False)
    one = assistant_text(with_template(tok, template), CALLS[:1])
    one_ids = tok.encode(one.replace("[CALL_ID]abcDEF120", ""), add_special_tokens=False)
    for choice, parallel, both in [
        (Choice("required"), True, True),
        (Choice("required"), False, False),
        (Choice("required", "get_weather"), True, False),
    ]:
        spec = required_spec(template, check_tools(TOOLS), choice, set(), parallel)
        g = Grammar.for_pair(spec, tok, len(tok), [2])
        assert g.valid_prefix(one_ids) == len(one_ids)
        assert (g.valid_prefix(two_ids) == len(two_ids)) == both


def test_required_is_refused_where_the_format_is_not_json(real):
    with pytest.raises(ToolError, match="not supported") as e:
        required_spec(real["gemma4"], check_tools(TOOLS), Choice("required"), set())
    assert e.value.param == "tool_choice"


# Qwen2.5-Coder-0.5B-Instruct's greedy answer, given the tool through its own template
CODER = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'


# and Qwen2.5-Coder-1.5B-Instruct's: the template's own example, braces doubled as it shows them
CODER_15 = '{{"name": "get_weather", "arguments": {"city": "Paris"}}}'


def test_a_fenced_call_as_qwen_coder_writes_it():
    assert stream("hermes", CODER_15, [5]) == ("", [("get_weather", {"city": "Paris"})])
    assert stream("hermes", '{"name": "x"} is a name', [5]) == ('{"name": "x"} is a name', [])
    for sizes in ([len(CODER)], [1], [3, 8]):
        assert stream("hermes", CODER, sizes) == ("", [("get_weather", {"city": "Paris"})])
    fenced = '```xml\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n```'
    assert stream("hermes", fenced, [2]) == ("", [("now", {})])
    text = 'Use:\n```json\n{"a": 1}\n```\nand\n```python\nprint(1)\n```'
    assert stream("hermes", text, [3]) == (text, [])  # not calls: text, whole
