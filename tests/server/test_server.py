"""`macspec serve` through OpenAI's own Python client: answers equal the engine's, usage carries
the speculation and the prompt cache, clients run together and go away, bad requests get
OpenAI's error objects, the API key holds, and SIGTERM ends a stream and the process cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest

import macspec
from macspec.api import stream as api
from macspec.server.command import serving

GREEDY = {"max_tokens": 40, "temperature": 0.0}
# A fixed K: an adaptive policy starts each answer from what the loaded pair saw before, so the
# rounds of two runs of one request may differ (their text never does).
FIXED = {"adaptive": False}
QUESTION = [{"role": "user", "content": "the cat sat on the mat"}]


@pytest.fixture(scope="module")
def pair(chat_dirs):
    return macspec.load(*chat_dirs)


@pytest.fixture(scope="module")
def url(pair):
    with serving(pair) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def model_id(pair):
    return pair.target_path.name


def test_chat_answer_is_the_engines(pair, client):
    want = macspec.generate(pair, messages=QUESTION, **GREEDY, **FIXED)
    got = client.chat.completions.create(
        model=model_id(pair), messages=QUESTION, extra_body=FIXED, **GREEDY
    )
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    use = got.usage
    assert use.prompt_tokens == len(api.prompt_ids(pair, messages=QUESTION))
    assert use.completion_tokens == len(want.tokens)
    assert use.total_tokens == use.prompt_tokens + use.completion_tokens
    spec = use.model_extra["speculative"]
    assert spec["drafted"] > 0 and spec["rounds"] == want.stats.rounds
    assert spec["accepted"] == want.stats.accepted
    assert 0 < spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] >= 1
    assert spec["tokens_per_second"] > 0 and spec["speedup"] > 0


def test_streamed_answer_is_the_engines(pair, client):
    want = macspec.generate(pair, messages=QUESTION, **GREEDY, **FIXED)
    stream = client.chat.completions.create(
        model=model_id(pair),
        messages=QUESTION,
        extra_body=FIXED,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 2  # per round
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)
    assert chunks[-1].usage.model_extra["speculative"]["rounds"] == want.stats.rounds


def test_completions_take_a_raw_prompt(pair, client):
    want = macspec.generate(pair, "the cat sat", **GREEDY)
    got = client.completions.create(model=model_id(pair), prompt="the cat sat", **GREEDY)
    assert got.choices[0].text == want.text
    streamed = client.completions.create(
        model=model_id(pair), prompt="the cat sat", stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_the_next_turn_reports_cached_tokens(pair, client):
    first = client.chat.completions.create(model=model_id(pair), messages=QUESTION, **GREEDY)
    history = [
        *QUESTION,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and then a dog ran by"},
    ]
    second = client.chat.completions.create(model=model_id(pair), messages=history, **GREEDY)
    assert (
        second.choices[0].message.content == macspec.generate(pair, messages=history, **GREEDY).text
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert len(api.prompt_ids(pair, messages=QUESTION)) <= cached < second.usage.prompt_tokens


def test_four_clients_together_get_what_each_gets_alone(pair, client):
    asks = [
        [{"role": "user", "content": f"tell me about the {w} box"}]
        for w in "red big old odd".split()
    ]
    options = {"max_tokens": 60, "temperature": 0.0}
    alone = [macspec.generate(pair, messages=m, **options).text for m in asks]

    def ask(messages):
        return (
            client.chat.completions.create(model=model_id(pair), messages=messages, **options)
            .choices[0]
            .message.content
        )

    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, asks))
    assert together == alone


def test_a_client_that_goes_away_cancels_its_answer(pair, url):
    body = {"messages": QUESTION, "max_tokens": 1900, "stream": True, "temperature": 0.0}
    served = httpx.get(url + "/health").json()["served"]
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        next(lines)
    for _ in range(100):  # cancelled at its next round
        health = httpx.get(url + "/health").json()
        if health["active"] == 0:
            break
        time.sleep(0.05)
    assert health["active"] == 0 and health["served"] == served  # stopped, not finished
    again = httpx.post(url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 5})
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5


LONG = "x" * 3000  # more characters (tokens) than the 2048-token context
BAD = [
    ("{not json", 400, None),
    ("[1, 2]", 400, None),
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0]"),
    ({"messages": QUESTION, "temperature": -1}, 400, "temperature"),
    ({"messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
    ({"messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": QUESTION, "max_completion_tokens": -5}, 400, "max_completion_tokens"),
    ({"messages": QUESTION, "max_tokens": "10"}, 400, "max_tokens"),
    ({"messages": QUESTION, "top_p": 0}, 400, "top_p"),
    ({"messages": QUESTION, "seed": 1.5}, 400, "seed"),
    ({"messages": QUESTION, "stop": 7}, 400, "stop"),
    ({"messages": QUESTION, "stream": "yes"}, 400, "stream"),
    ({"messages": QUESTION, "stream_options": {"include_usage": 1}}, 400, None),
    ({"messages": QUESTION, "n": 2}, 400, "n"),
    ({"messages": QUESTION, "num_draft": 0}, 400, "num_draft"),
    ({"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ({"messages": QUESTION, "model": "gpt-4o"}, 404, "model"),
]


@pytest.mark.parametrize("body, status, param", BAD, ids=range(len(BAD)))
def test_a_bad_request_gets_an_error_object(url, body, status, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + "/v1/chat/completions", content=data)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param:
        assert error["param"] == param
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_bad_completions_oversized_bodies_and_unknown_routes(url):
    r = httpx.post(url + "/v1/completions", json={"prompt": [], "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url + "/v1/completions", json={"prompt": LONG})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    big = json.dumps({"messages": QUESTION, "pad": "x" * (5 << 20)})
    r = httpx.post(url + "/v1/chat/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(url + "/v1/nothing").status_code == 404
    unset = {"messages": QUESTION, "max_tokens": 2, "n": None, "logprobs": None, "seed": None}
    assert httpx.post(url + "/v1/chat/completions", json=unset).status_code == 200  # null = unset
    assert httpx.get(url + "/v1/models/gpt-4o").status_code == 404


def test_the_client_sees_errors_as_its_own_exceptions(pair, client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id(pair), messages=QUESTION, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert [m.id for m in client.models.list()] == [model_id(pair)]


def test_the_api_key_is_required_when_set(pair):
    with serving(pair, api_key="sesame") as base:
        assert httpx.get(base + "/health").status_code == 200  # no secrets there
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = httpx.get(base + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(base + "/v1/chat/completions", json={"messages": QUESTION})
        assert r.status_code == 401
        good = openai.OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0)
        got = good.chat.completions.create(model=model_id(pair), messages=QUESTION, max_tokens=3)
        assert got.usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.subprocess
def test_a_signal_ends_the_stream_and_the_server_cleanly(chat_dirs, sig):
    target, draft = chat_dirs
    cmd = [sys.executable, "-m", "macspec", "serve", "--target", str(target), "--draft", str(draft)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*cmd, "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    try:
        port = None
        for line in proc.stderr:
            if "serving" in line:
                port = line.split("127.0.0.1:")[1].split("/")[0]
                break
        assert port, "the server did not start"
        body = {"messages": QUESTION, "max_tokens": 1900, "stream": True}
        lines = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
            for line in filter(None, r.iter_lines()):
                lines.append(line)
                if len(lines) == 3:
                    proc.send_signal(sig)  # a stream in flight
        assert proc.wait(60) == 0
        rest = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length"
    assert "terminate called" not in rest and "Traceback" not in rest
    assert "stopped" in rest


def test_only_loopback_hosts_go_without_a_warning():
    from macspec.server.command import _loopback

    assert all(_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "localhost"))
    assert not any(_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.4", "example.org"))


def test_a_taken_port_is_a_message_not_a_traceback(chat_dirs, capsys):
    from macspec import cli

    with _bind_taken() as port:
        assert cli.main(["serve", "--target", str(chat_dirs[0]), "--port", str(port)]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


@contextmanager
def _bind_taken():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()
