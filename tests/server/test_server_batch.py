"""`macspec serve` verifying several clients in one target pass: four `openai` clients at once,
mixing speculative, plain, n-gram and seeded requests, each get exactly what the request gets
alone; /health says the passes were shared, or why requests take turns."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import macspec
from macspec.api.options import GenerationOptions
from macspec.api.stream import prompt_ids
from macspec.server.batching import BatchScheduler, alone_reason
from macspec.server.command import serving

# (messages, options): the pair's drafter copies n-grams where the context repeats (the
# second), the draft model elsewhere; one plain; one sampled with a seed (fixed K: an adaptive
# K follows measured times, and a sampled answer follows K).
REQUESTS = [
    ("tell me about the red box", {"temperature": 0.0}),
    ("one two three one two three one two three one two", {"temperature": 0.0}),
    ("a story about a very long and winding road", {"temperature": 0.0, "speculative": False}),
    ("the old odd box", {"temperature": 1.0, "seed": 11, "adaptive": False, "num_draft": 3}),
]


@pytest.fixture(scope="module")
def pair(chat_dirs):
    return macspec.load(*chat_dirs)


def ask_all(url, pair, requests, max_tokens=48):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(request):
        text, options = request
        extra = {k: v for k, v in options.items() if k != "temperature"}
        answer = client.chat.completions.create(
            model=pair.target_path.name,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=options["temperature"],
            extra_body=extra,
        )
        return answer.choices[0].message.content

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(ask, requests))


def alone(pair, requests, max_tokens):
    """What each (text, generate options) request gets from `macspec.generate` alone."""
    return [
        macspec.generate(
            pair, messages=[{"role": "user", "content": t}], max_tokens=max_tokens, **o
        ).text
        for t, o in requests
    ]


def test_four_clients_in_one_pass_get_what_each_gets_alone(pair):
    want = alone(pair, REQUESTS, 48)
    with serving(pair, parallel=4) as url:
        together = ask_all(url, pair, REQUESTS)
        health = httpx.get(url + "/health").json()
    assert together == want
    assert health["batched"] is True and "batch_reason" not in health
    assert health["shared_passes"] > 0 and health["rows_per_shared_pass"] > 1
    assert health["requests_taking_turns"] == 0


def test_taking_turns_gives_the_same_answers_and_health_says_why(pair):
    with serving(pair, parallel=4, batch=False) as url:
        together = ask_all(url, pair, REQUESTS[:2], max_tokens=16)
        health = httpx.get(url + "/health").json()
    assert together == alone(pair, REQUESTS[:2], 16)
    assert health["batched"] is False and "--no-batch" in health["batch_reason"]
    assert health["shared_passes"] == 0


def test_constrained_requests_take_turns():
    assert alone_reason(GenerationOptions.from_kwargs(json_schema={"type": "object"})) == (
        "constrained decoding takes turns"
    )
    assert alone_reason(GenerationOptions.from_kwargs(top_logprobs=2)) == (
        "log probabilities take turns"
    )
    assert alone_reason(GenerationOptions.from_kwargs()) == ""


def test_a_pair_that_cannot_share_takes_turns(pair, monkeypatch):
    monkeypatch.setattr(pair, "cache_kinds", {"attention": 1, "window": 1})
    scheduler = BatchScheduler(pair, 2)
    with serving(pair, scheduler=scheduler) as url:
        got = ask_all(url, pair, REQUESTS[:2], max_tokens=8)
        health = httpx.get(url + "/health").json()
    monkeypatch.undo()
    assert got == alone(pair, REQUESTS[:2], 8)
    assert health["batched"] is False and "window" in health["batch_reason"]
    assert health["requests_taking_turns"] == 2


def test_the_pair_is_checked_before_the_server_takes_requests(pair, monkeypatch):
    """shared_reason runs model passes: at startup, not in front of the first request (a lone
    client used to wait for it). A slow check shows which: the server is up only after it."""
    from macspec.server import batching

    def slow_check(*args):
        time.sleep(0.5)
        return ""

    monkeypatch.setattr(batching, "shared_reason", slow_check)
    scheduler = BatchScheduler(pair, 2)
    with serving(pair, scheduler=scheduler) as url:
        assert scheduler.reason == ""
        assert httpx.get(url + "/health").json()["batched"] is True


def test_constrained_and_logprob_requests_take_turns_beside_a_batch(pair):
    grammar = 'start: "the " /[a-z]+/ " box"'  # what the tiny character tokenizer can write
    requests = [
        *REQUESTS[:2],
        ("tell me about a box", {"temperature": 0.0, "grammar": grammar}),
        ("tell me about the old box", {"temperature": 0.0, "logprobs": True, "top_logprobs": 2}),
    ]
    with serving(pair, parallel=4) as url:
        together = ask_all(url, pair, requests, max_tokens=24)
        health = httpx.get(url + "/health").json()
    options = [o for _, o in REQUESTS[:2]] + [
        {"grammar": grammar, "temperature": 0.0},
        {"top_logprobs": 2, "temperature": 0.0},
    ]
    want = alone(pair, [(t, o) for (t, _), o in zip(requests, options, strict=True)], 24)
    assert together == want and together[2].startswith("the ")
    assert health["batched"] is True and health["requests_taking_turns"] == 2


def test_clients_in_one_pass_resume_from_a_plain_answers_states(pair):
    """A plain answer keeps the target's states only; two speculative clients at once, in one
    pass, restore them, their draft model reading the prompt in its own turns, and get what
    each gets alone."""
    pair.prompt_cache.clear()
    first = [{"role": "user", "content": "tell me about the green box and the old road"}]
    with serving(pair, parallel=4) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        plain = client.chat.completions.create(
            model=pair.target_path.name,
            messages=first,
            max_tokens=24,
            temperature=0.0,
            extra_body={"speculative": False},
        )
        said = {"role": "assistant", "content": plain.choices[0].message.content}
        turns = [[*first, said, {"role": "user", "content": w}] for w in ("and then?", "why?")]

        def ask(messages):
            answer = client.chat.completions.create(
                model=pair.target_path.name, messages=messages, max_tokens=32, temperature=0.0
            )
            return answer.choices[0].message.content, answer.usage

        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(ask, turns))
        health = httpx.get(url + "/health").json()
    assert health["shared_passes"] > 0
    for (text, usage), messages in zip(got, turns, strict=True):
        assert text == macspec.generate(pair, messages=messages, max_tokens=32).text
        assert usage.prompt_tokens_details.cached_tokens >= len(prompt_ids(pair, messages=first))
        assert usage.model_extra["speculative"]["drafted"] > 0
