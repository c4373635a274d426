"""How the engine clients publish (ThreadEngineClient, ProcessEngineClient). Both publish a step's stats before
its outputs: whoever a finished request wakes sees the engine without it (with the old order, outputs then
stats, a test that waited for its own requests to run could read the previous test's stats and act too early).
And a failure in publishing still ends every request with an error."""

import asyncio
import functools
import itertools
import time

import pytest

from nanoserve.config import EngineArgs
from nanoserve.runtime import process_client, thread_client
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.runtime.streams import EngineDeadError
from nanoserve.sampling_params import SamplingParams


def _late_deliver(real, items):
    real(items)
    time.sleep(0.2)  # whatever the client does after delivering now lags far behind the woken reader


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_finished_output_sees_its_own_stats(engine_process, monkeypatch):
    module = process_client if engine_process else thread_client
    monkeypatch.setattr(module, "deliver", functools.partial(_late_deliver, module.deliver))
    engine = AsyncEngine.from_engine_args(EngineArgs(num_kv_blocks=16, engine_process=engine_process))

    async def main():
        group = engine.submit([("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))])
        seen = []
        async for _, out in group:
            seen.append((out.finished, engine.stats.num_running, engine.stats.generation_tokens))
        return seen

    try:
        seen = asyncio.run(main())
    finally:
        engine.shutdown()
    assert seen[-1] == (True, 0, 4)


def _fail_first(real, calls, items):
    if next(calls) == 0:
        raise RuntimeError("publish")
    real(items)


def test_thread_client_failing_to_publish_fails_its_requests(monkeypatch):
    monkeypatch.setattr(thread_client, "deliver", functools.partial(_fail_first, thread_client.deliver,
                                                                    itertools.count()))
    engine = AsyncEngine.from_engine_args(EngineArgs(num_kv_blocks=16, engine_process=False))

    async def main():
        async with asyncio.timeout(30):  # before the fix: the thread died, and the request waited forever
            async for _ in engine.submit([("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))]):
                pass

    try:
        with pytest.raises(EngineDeadError, match="the engine thread failed: RuntimeError: publish"):
            asyncio.run(main())
    finally:
        engine.shutdown()
    assert engine.dead
