"""`macspec serve` with a long prompt: `return_progress` (llama.cpp's server's field) streams
prompt_progress chunks as the prompt is read, before the answer, which is the engine's own; a
client that goes away while its prompt is read stops the reading at its next turn (the real
engine on tiny random models with a 2,048-id context)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from support.tinymodels import make_tiny_model

import macspec
from macspec.api import stream as api
from macspec.core.batch_rounds import PREFILL_CHUNK as ROW_CHUNK
from macspec.core.loop import READ_CHUNK
from macspec.server.batching import BatchScheduler
from macspec.server.command import serving
from macspec.server.scheduler import END, PromptRead

LONG = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog. " * 30}]
GREEDY = {"max_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    target = make_tiny_model(root / "target", seed=0, context=2048)
    draft = make_tiny_model(root / "draft", seed=1, context=2048)
    return macspec.load(str(target), str(draft))


def _forget(pair):
    if pair.prompt_cache is not None:
        pair.prompt_cache.clear()  # every request reads the whole prompt


def _chunks(url, pair, **extra):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=pair.target_path.name, messages=LONG, stream=True, extra_body=extra, **GREEDY
    )
    return list(stream)


@pytest.mark.parametrize("batch", [True, False], ids=["batch-row", "turns"])
def test_progress_chunks_come_before_the_answer(long_pair, batch):
    ids = api.prompt_ids(long_pair, messages=LONG)
    total = len(ids) - 1  # the target holds all but the last id before its first pass
    assert total > 1024  # three turns of 512
    _forget(long_pair)
    want = macspec.generate(long_pair, messages=LONG, **GREEDY)
    _forget(long_pair)
    with serving(long_pair, batch=batch) as url:
        chunks = _chunks(url, long_pair, return_progress=True)
        told = [
            c.model_extra["prompt_progress"] for c in chunks if "prompt_progress" in c.model_extra
        ]
        turn = ROW_CHUNK if batch else READ_CHUNK  # a batch's row reads in shorter turns
        assert [t["processed"] for t in told] == [*range(turn, total, turn), total]
        assert {t["total"] for t in told} == {total} and {t["cache"] for t in told} == {0}
        times = [t["time_ms"] for t in told]
        assert times == sorted(times) and times[0] >= 0
        first_text = next(
            i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content
        )
        last_told = max(i for i, c in enumerate(chunks) if "prompt_progress" in c.model_extra)
        assert last_told < first_text
        for c in chunks:
            if "prompt_progress" in c.model_extra:  # no text, no finish in a progress chunk
                assert not c.choices[0].delta.content and c.choices[0].finish_reason is None
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.text

        # The same prompt again: the prompt cache holds it, and the chunks say how much.
        again = _chunks(url, long_pair, return_progress=True)
        told = [
            c.model_extra["prompt_progress"] for c in again if "prompt_progress" in c.model_extra
        ]
        assert told and told[-1]["processed"] == total and told[0]["cache"] > 0
        assert all(t["processed"] >= t["cache"] for t in told)
        assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == want.text

        # /v1/completions, the prompt as ids: the same chunks, in its own shape.
        _forget(long_pair)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        raw = list(
            client.completions.create(
                model=long_pair.target_path.name,
                prompt=ids,
                stream=True,
                extra_body={"return_progress": True},
                **GREEDY,
            )
        )
        told = [c.model_extra["prompt_progress"] for c in raw if "prompt_progress" in c.model_extra]
        assert [t["processed"] for t in told] == [*range(turn, total, turn), total]
        assert all(c.choices[0].text == "" for c in raw if "prompt_progress" in c.model_extra)
        assert "".join(c.choices[0].text for c in raw if c.choices) == want.text

        # Not asked: no progress chunk.
        _forget(long_pair)
        plain = _chunks(url, long_pair)
        assert not any("prompt_progress" in c.model_extra for c in plain)
        assert "".join(c.choices[0].delta.content or "" for c in plain if c.choices) == want.text


@pytest.mark.parametrize("batch", [True, False], ids=["batch-row", "turns"])
def test_a_client_gone_while_its_prompt_is_read_stops_the_reading(long_pair, batch):
    """The client hangs up as the first progress reaches it (/health's "reading" lists it
    then): the reading ends at its next turn, with no answer, no failure counted, and the next
    request is answered as before."""
    ids = api.prompt_ids(long_pair, messages=LONG)
    _forget(long_pair)
    want = macspec.generate(long_pair, prompt=ids, **GREEDY)

    async def run():
        scheduler = BatchScheduler(long_pair, batch=batch)
        await scheduler.start()
        try:
            _forget(long_pair)
            job = scheduler.submit(ids, dict(GREEDY), progress=True)
            put = job.put

            health = []

            def hang_up(item):  # the client is gone once it has seen the first progress
                if isinstance(item, PromptRead):
                    health.append(scheduler.status()["reading"])  # what /health says then
                    job.cancelled = True
                put(item)

            job.put = hang_up
            seen = [await asyncio.wait_for(job.events.get(), 30)]
            await asyncio.sleep(0.5)  # what else would come, comes
            while not job.events.empty():
                seen.append(job.events.get_nowait())
            assert [type(i) for i in seen if i is not END] == [PromptRead]
            turn = ROW_CHUNK if batch else READ_CHUNK
            assert seen[0].processed == turn
            assert health == [[{"processed": turn, "total": len(ids) - 1}]]
            assert scheduler.status()["reading"] == []
            assert scheduler.failed == 0 and scheduler.served == 0
            _forget(long_pair)
            nxt = scheduler.submit(ids, dict(GREEDY))
            parts = []
            while (item := await asyncio.wait_for(nxt.events.get(), 30)) is not END:
                parts.append(item.text)
            assert "".join(parts) == want.text
        finally:
            await scheduler.wait_closed()
            scheduler.shutdown()

    asyncio.run(run())


def test_return_progress_must_be_a_flag(long_pair):
    with serving(long_pair) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="return_progress must be true or false"):
            client.chat.completions.create(
                model=long_pair.target_path.name,
                messages=LONG,
                extra_body={"return_progress": "yes"},
                **GREEDY,
            )
