"""AsyncEngine's per-request streams: a reader that falls behind gets the newest cumulative output
once, not every step's; tool-loop outputs and errors are never merged away."""

import asyncio

import pytest

from nanoserve.outputs import CompletionOutput, RequestOutput, ToolCompletionOutput
from nanoserve.runtime.streams import RequestGroup, RequestStream


def output(n: int, finished: bool = False, kind=CompletionOutput) -> RequestOutput:
    c = kind(index=0, text="x" * n, token_ids=list(range(n)), finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1], [c], finished)


def test_slow_reader_gets_merged_outputs():
    async def scenario():
        wake = asyncio.Event()
        stream = RequestStream("r", asyncio.get_running_loop(), wake)
        group = RequestGroup(engine=None, streams=[stream], wake=wake)
        for n in (1, 2, 3):  # three steps arrive before the reader runs
            stream.put(output(n))
        stream.put(output(4, kind=ToolCompletionOutput))  # a tool-loop output: kept apart
        stream.put(output(5, kind=ToolCompletionOutput))
        stream.put(output(6, finished=True))
        return [len(out.outputs[0].token_ids) async for _, out in group]

    assert asyncio.run(scenario()) == [3, 4, 5, 6]


def test_error_after_outputs_is_raised():
    async def scenario():
        wake = asyncio.Event()
        stream = RequestStream("r", asyncio.get_running_loop(), wake)
        stream.put(output(1))
        stream.put(RuntimeError("engine died"))
        seen = []
        with pytest.raises(RuntimeError, match="engine died"):
            async for _, out in RequestGroup(engine=None, streams=[stream], wake=wake):
                seen.append(len(out.outputs[0].token_ids))
        return seen

    assert asyncio.run(scenario()) == [1]
