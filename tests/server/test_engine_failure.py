"""In-process app (build_app + httpx's ASGI transport) around a real engine, for what a healthy server
process cannot show: an engine that fails mid-request, an idle loop that sleeps, a model without a
chat template."""

import asyncio
import json
import time

import httpx
import pytest

from nanoserve.config import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.server.routes import build_app


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=64).create_config())


@pytest.fixture
def async_engine(engine):
    a = AsyncEngine(engine)
    yield a
    a.shutdown()


def _client(async_engine) -> httpx.AsyncClient:
    app = build_app(async_engine, "tiny-llama")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30)


def test_idle_loop_does_not_step(async_engine, monkeypatch):
    calls = []
    real_step = async_engine.engine.step
    monkeypatch.setattr(async_engine.engine, "step", lambda: calls.append(1) or real_step())

    async def main():
        async with _client(async_engine) as http:
            r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200
    asyncio.run(main())
    busy = len(calls)
    time.sleep(0.3)
    assert busy == 3 and len(calls) == busy  # one step per token, then nothing while idle


def test_no_chat_template_is_400(async_engine, monkeypatch):
    monkeypatch.setattr(async_engine.engine.tokenizer, "chat_template", None)

    async def main():
        async with _client(async_engine) as http:
            return await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})

    r = asyncio.run(main())
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and "chat template" in err["message"]


@pytest.mark.parametrize("template,says", [
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),  # the template's own refusal
    ("{{ messages[0]['tool_calls'][0] }}", "tool_calls")])  # a field the template expects is missing
def test_a_template_that_cannot_render_the_messages_is_400(async_engine, monkeypatch, template, says):
    monkeypatch.setattr(async_engine.engine.tokenizer, "chat_template", template)
    messages = [{"role": "user", "content": "hi"}]

    async def main():
        async with _client(async_engine) as http:
            return [await http.post(path, json={"messages": messages}) for path in ("/v1/chat/completions",
                                                                                     "/tokenize")]

    for r in asyncio.run(main()):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and err["type"] == "invalid_request_error" and says in err["message"]


def test_engine_failure_reaches_every_client(async_engine, monkeypatch):
    real_step = async_engine.engine.step
    steps = []

    def failing_step():
        steps.append(1)
        # Only once both requests are in: the chat one is tokenized through a pool and, on a loaded machine, could
        # arrive after three steps, to an engine already dead (503, not the 500 this test is about).
        if len(steps) >= 3 and len(async_engine.engine.requests) == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(async_engine.engine, "step", failing_step)
    body = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True}

    async def main():
        async with _client(async_engine) as http:
            stream, plain = await asyncio.gather(
                http.post("/v1/completions", json={**body, "stream": True}),
                http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 50}))
            health = await http.get("/health")
            after = await http.post("/v1/completions", json=body)
            return stream, plain, health, after

    stream, plain, health, after = asyncio.run(main())
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "boom" in json.loads(events[-2])["error"]["message"]
    assert plain.status_code == 500 and "boom" in plain.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert after.status_code == 503


def test_dead_engine_with_a_queue_is_503_not_429(model_dir):
    # Requests waiting when the engine died stay in its last stats, so the queue looks full for good: the server
    # must still say the engine is dead, not ask clients to retry.
    engine = LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=64, max_num_seqs=1).create_config())
    real_step = engine.step

    def failing_step():
        if len(engine.scheduler.waiting) >= 2:  # one running, two queued behind it
            raise RuntimeError("boom")
        return real_step()

    engine.step = failing_step
    async_engine = AsyncEngine(engine)
    body = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True}

    async def main():
        app = build_app(async_engine, "tiny-llama", max_waiting_requests=2)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            # The queue takes two only while the first runs: a request counts as waiting until it is scheduled.
            running = asyncio.create_task(http.post("/v1/completions", json=body))
            async with asyncio.timeout(30):
                while async_engine.stats.num_running == 0:
                    await asyncio.sleep(0.01)
            first = await asyncio.gather(running, *(http.post("/v1/completions", json=body) for _ in range(2)))
            return first, await http.post("/v1/completions", json=body)

    try:
        first, after = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert [r.status_code for r in first] == [500] * 3
    assert async_engine.num_waiting >= 2  # what the queue check would have seen
    assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"
    assert "boom" in after.json()["error"]["message"]
