"""The drain, in this process (the SIGTERM tests in test_shutdown.py run it in a real server): it waits for every
request past the gate, even one whose body is still arriving, and after its timeout it aborts every request in
flight, even one that reaches the engine after the first abort went out."""

import asyncio
import functools
import time
import types

import httpx
from processes import pace_steps

from nanoserve.config import EngineArgs
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.server import shutdown
from nanoserve.server.gate import GateMiddleware, GateState
from nanoserve.server.routes import build_app


def test_drain_waits_for_a_request_whose_body_is_still_arriving():
    async def main():
        gate, server = GateState(), types.SimpleNamespace(should_exit=False)
        statuses, ran = [], []

        async def app(scope, receive, send):
            ran.append(server.should_exit)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        body_arrives = asyncio.Event()

        async def receive():
            await body_arrives.wait()
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message):
            statuses.append(message.get("status"))

        gate_app = GateMiddleware(app, gate, api_key=None, max_body_bytes=1 << 20)
        request = asyncio.create_task(gate_app({"type": "http", "path": "/v1/completions", "headers": []},
                                               receive, send))
        await asyncio.sleep(0.05)  # past the draining check, waiting for its body
        drain = asyncio.create_task(shutdown._drain(server, gate, engine=None, timeout=30))
        await asyncio.sleep(0.3)
        stopped_early = server.should_exit
        body_arrives.set()
        await request
        await drain
        return stopped_early, ran, statuses[0], server.should_exit

    assert asyncio.run(main()) == (False, [False], 200, True)


def test_drain_timeout_aborts_a_request_still_tokenizing(monkeypatch):
    engine = AsyncEngine.from_engine_args(EngineArgs(num_kv_blocks=16, engine_process=False))
    engine.setup(functools.partial(pace_steps, seconds=0.02))  # 150 tokens take 3 s: longer than the drain
    real_tokenize = engine.engine.tokenize

    def slow_tokenize(prompt):  # a long prompt, or one queued behind others in the tokenizer pool
        if isinstance(prompt, str):
            time.sleep(0.5)
        return real_tokenize(prompt)

    monkeypatch.setattr(engine.engine, "tokenize", slow_tokenize)
    gate = GateState()
    body = {"max_tokens": 150, "ignore_eos": True}

    async def main():
        transport = httpx.ASGITransport(app=build_app(engine, "m", gate=gate))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            running = asyncio.create_task(http.post("/v1/completions", json={**body, "prompt": [1, 2, 3]}))
            async with asyncio.timeout(30):
                while engine.stats.num_running < 1:
                    await asyncio.sleep(0.01)
            late = asyncio.create_task(http.post("/v1/completions", json={**body, "prompt": "Hi"}))
            await asyncio.sleep(0.1)  # past the gate, tokenizing: the first abort goes out before it is submitted
            server = types.SimpleNamespace(should_exit=False)
            await shutdown._drain(server, gate, engine, timeout=0.1)
            in_flight = gate.in_flight
            return in_flight, [(await r).json()["choices"][0]["finish_reason"] for r in (running, late)]

    try:
        assert asyncio.run(main()) == (0, ["abort", "abort"])
    finally:
        engine.shutdown()
