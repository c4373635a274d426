"""The engine in a process of its own (--engine-process), in-process app (build_app + httpx's ASGI
transport) around it: the final config comes from the engine process, the tool loop runs there, and
every way the engine process can end (load error, step() raising, killed, shut down) reaches every
client as an error instead of a hang. The shared `server` fixture runs the other server tests on it too.
"""

import asyncio
import functools
import json
import os
import pstats
import signal

import httpx
import pytest
from processes import fail_once_running, pace_steps

from nanoserve.args import engine_args_from
from nanoserve.bench import serve
from nanoserve.config import EngineArgs, bundled_model_dir
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.runtime.process_client import ProcessEngineClient
from nanoserve.sampling_params import SamplingParams
from nanoserve.server import app
from nanoserve.server.routes import build_app

BODY = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": True}


def _start(model_dir, **kwargs) -> AsyncEngine:
    return AsyncEngine.from_engine_args(EngineArgs(model=str(model_dir), engine_process=True, **kwargs))


@pytest.fixture(scope="module")
def bundled():
    """The bundled model (it has the tool tokens), in a KV pool of 256 tokens: less than its context."""
    engine = _start(bundled_model_dir(), num_kv_blocks=16)
    yield engine
    engine.shutdown()


@pytest.fixture
def fresh(model_dir):
    """An engine process of its own, for a test that ends it."""
    engine = _start(model_dir, num_kv_blocks=64)
    yield engine
    engine.shutdown()


def _client(async_engine: AsyncEngine, name: str = "tiny-llama") -> httpx.AsyncClient:
    app = build_app(async_engine, name)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


async def _until_running(async_engine: AsyncEngine, n: int) -> None:
    async with asyncio.timeout(30):
        while async_engine.stats.num_running < n:
            await asyncio.sleep(0.01)


def _sse_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


def _assert_dead(stream: httpx.Response, plain: httpx.Response, health: httpx.Response, after: httpx.Response,
                 why: str) -> None:
    events = _sse_events(stream)
    assert events[-1] == "[DONE]"
    assert why in json.loads(events[-2])["error"]["message"]
    assert plain.status_code == 500 and why in plain.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["status"] == "dead" and why in health.json()["error"]
    assert after.status_code == 503


def test_final_config_comes_from_the_engine_process(bundled):
    # The engine lowered max_model_len to its KV pool; the server checks prompts against that.
    assert bundled.max_model_len == 256 and bundled.engine.config.max_model_len == 256
    assert bundled.engine.config.model.eos_token_ids  # filled in the engine process
    assert bundled.engine.config.args.engine_process is True

    async def main():
        async with _client(bundled, "nanoserve-tiny") as http:
            models = await http.get("/v1/models")
            long = await http.post("/v1/completions", json={"prompt": list(range(10, 266)), "max_tokens": 1})
            return models, long

    models, long = asyncio.run(main())
    assert models.json()["data"][0]["max_model_len"] == 256
    assert long.status_code == 400 and "256" in long.json()["error"]["message"]


def test_tool_loop_runs_in_the_engine_process(bundled):
    body = {"messages": [{"role": "user", "content": "What is 12*34?"}], "max_tokens": 48, "temperature": 0}

    async def main():
        async with _client(bundled, "nanoserve-tiny") as http:
            return await asyncio.gather(http.post("/v1/chat/completions", json=body),
                                        http.post("/v1/chat/completions", json={**body, "stream": True}))

    plain, stream = asyncio.run(main())
    text = plain.json()["choices"][0]["message"]["content"]
    assert "408" in text
    deltas = [json.loads(e)["choices"][0]["delta"] for e in _sse_events(stream)[:-1]]
    assert "".join(d.get("content", "") for d in deltas) == text
    # The tool turn ends its line (chat_engine.TOOL_MARKERS).
    assert "".join(d.get("content", "") for d in deltas if d.get("tool_output")) == "408\n"


def test_abort_all_ends_what_runs(bundled):
    # Paced steps: unpaced, this model can decode all 200 tokens between the wait below and the abort. (A request
    # that still ended 'length' at 50 ms a step was not a matter of pace: the cores published a step's stats after
    # its outputs, so the wait could read the previous test's two running requests and abort before these were
    # added. test_stats_order.py holds the cores to the other order.)
    bundled.setup(functools.partial(pace_steps, seconds=0.05))

    async def main():
        async with _client(bundled, "nanoserve-tiny") as http:
            requests = [asyncio.create_task(http.post("/v1/completions", json={**BODY, "max_tokens": 200}))
                        for _ in range(2)]
            await _until_running(bundled, 2)
            bundled.abort_all()
            return await asyncio.gather(*requests)

    try:
        responses = asyncio.run(main())
    finally:
        bundled.setup(functools.partial(pace_steps, seconds=0))
    for r in responses:
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort"


def test_setup_must_pickle(bundled):
    with pytest.raises(Exception, match="pickle"):
        bundled.setup(lambda engine: None)


async def _in_flight_then(async_engine: AsyncEngine, end) -> tuple[httpx.Response, ...]:
    """A streamed completion and a plain chat running when end() is called; then /health and one more."""
    async with _client(async_engine) as http:
        running = asyncio.gather(http.post("/v1/completions", json={**BODY, "stream": True}),
                                 http.post("/v1/chat/completions", json=CHAT))
        await _until_running(async_engine, 2)
        end()
        stream, plain = await running
        return stream, plain, await http.get("/health"), await http.post("/v1/completions", json=BODY)


def test_step_failure_reaches_every_client(fresh):
    fresh.setup(functools.partial(fail_once_running, n=2))
    _assert_dead(*asyncio.run(_in_flight_then(fresh, lambda: None)), why="boom")
    assert fresh.client.process.join(timeout=10) is None and fresh.client.process.exitcode == 0


def test_killed_engine_process_reaches_every_client(fresh):
    pid = fresh.client.process.pid
    _assert_dead(*asyncio.run(_in_flight_then(fresh, lambda: os.kill(pid, signal.SIGKILL))),
                 why="killed by SIGKILL")


def test_load_failure_is_raised_at_startup(model_dir):
    # Valid arguments, but the engine process finds that the context does not fit the KV pool.
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        ProcessEngineClient(EngineArgs(model=str(model_dir), num_kv_blocks=1, max_model_len=512))


def test_the_flag_reaches_the_server_from_the_command_lines():
    assert engine_args_from(app.parse_args(["--engine-process"])).engine_process is True
    assert engine_args_from(app.parse_args(["--no-engine-process"])).engine_process is False
    assert engine_args_from(app.parse_args([])).engine_process is None  # the device decides (tests/test_config.py)
    # bench serve --launch hands the flags it does not know to the server it starts.
    _, server_flags = serve.parse_args(["--launch", "--engine-process", "--num-prompts", "5"])
    assert server_flags == ["--engine-process"]


def test_profile_engine_writes_the_engine_loops_profile(model_dir, tmp_path):
    path = tmp_path / "engine.prof"
    assert engine_args_from(app.parse_args(["--profile-engine", str(path)])).profile_engine == str(path)
    engine = _start(model_dir, num_kv_blocks=64, profile_engine=str(path))

    async def main():
        async for _ in engine.submit([("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))]):
            pass

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    profiled = {(os.path.basename(file), name) for file, _, name in pstats.Stats(str(path)).stats}
    assert ("llm_engine.py", "step") in profiled


def test_shutdown_ends_what_runs_and_stops_the_process(bundled):
    # Last in this module: it shuts the module's engine down (the fixture's shutdown is then a no-op).
    async def main():
        async with _client(bundled, "nanoserve-tiny") as http:
            running = asyncio.create_task(http.post("/v1/completions", json={**BODY, "max_tokens": 200}))
            await _until_running(bundled, 1)
            await asyncio.get_running_loop().run_in_executor(None, bundled.shutdown)
            return await running

    plain = asyncio.run(main())
    assert plain.status_code == 500 and "shut down" in plain.json()["error"]["message"]
    assert bundled.dead and bundled.client.process.exitcode == 0

