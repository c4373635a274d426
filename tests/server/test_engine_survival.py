"""No request can take the engine down: after each hostile request a normal one still answers 200 and
/health stays 200, on a live server (both engine backends); and a fault inside the engine that belongs to
one request fails that request alone, with an error its client sees."""

import asyncio
import json

import httpx
import pytest

from nanoserve.config import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.server.routes import build_app

HOSTILE = [
    ({"top_k": 2**63}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 2**64 - 1, "n": 2}, "seed"),
    ({"seed": 2**63 - 1, "n": 2}, "seed"),  # seed + 1 for the second sample overflows int64
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"n": 2**40}, "n"),
    ({"logprobs": 2**63}, "logprobs"),
    ({"min_tokens": 2**63}, "min_tokens"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"logit_bias": {"5": 1e300}}, "logit_bias"),
]


def assert_alive(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200, health.text


@pytest.mark.parametrize("fields, param", HOSTILE, ids=[p for _, p in HOSTILE])
def test_hostile_sampling_fields_are_400_and_the_engine_lives(server, fields, param):
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions",
                       json={"prompt": "Hello", "max_tokens": 4, "stream": stream, **fields}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    assert_alive(server)


def test_hostile_fields_while_others_stream(server):
    """A stream in flight is untouched by a hostile request that arrives while it runs."""
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async def normal():
                r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 24, "ignore_eos": True,
                                                             "stream": True})
                return r.status_code, r.text
            task = asyncio.create_task(normal())
            bad = [await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **f}) for f, _ in HOSTILE]
            return await task, bad
    (status, body), bad = asyncio.run(main())
    assert status == 200 and '"finish_reason":"length"' in body.replace(" ", "") and "error" not in body
    assert all(r.status_code == 400 for r in bad)
    assert_alive(server)


# -- a fault injected into one request of a running batch (in-process app around a real engine) ------------
BAD_PROMPT = [5, 6, 7, 8]  # the request whose token handling raises


@pytest.fixture(scope="module")
def async_engine(model_dir):
    engine = LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=64, async_scheduling=True).create_config())
    real = engine._append_sampled

    def append_sampled(entry, launched, sampled, rows):
        request = entry.seq.request
        if request.prompt_token_ids == BAD_PROMPT and len(entry.seq.token_ids) > len(BAD_PROMPT) + 2:
            raise RuntimeError("injected fault")
        return real(entry, launched, sampled, rows)

    engine._append_sampled = append_sampled
    a = AsyncEngine(engine)
    yield a
    a.shutdown()


def test_a_fault_in_one_request_fails_it_alone(async_engine):
    app = build_app(async_engine, "tiny-llama")
    good = {"prompt": [9, 10, 11], "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    bad = {"prompt": BAD_PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as http:
            reference = await http.post("/v1/completions", json=good)
            results = await asyncio.gather(
                http.post("/v1/completions", json=good), http.post("/v1/completions", json=bad),
                http.post("/v1/completions", json={**bad, "stream": True}),
                http.post("/v1/completions", json={**good, "stream": True}))
            health = await http.get("/health")
            after = await http.post("/v1/completions", json=good)
            return reference, results, health, after

    reference, (ok, failed, failed_stream, ok_stream), health, after = asyncio.run(main())
    text = reference.json()["choices"][0]["text"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == text
    assert failed.status_code == 500
    err = failed.json()["error"]
    assert err["code"] == "request_failed" and "injected fault" in err["message"]
    events = [json.loads(line[6:]) for line in failed_stream.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["error"]["code"] == "request_failed"
    chunks = [json.loads(line[6:]) for line in ok_stream.text.splitlines() if line.startswith("data: {")]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert streamed == text
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == text
