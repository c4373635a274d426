"""Running uvicorn with a graceful drain on SIGTERM / SIGINT.

uvicorn's own handling stops listening at once (new clients get "connection refused", not 503) and
re-raises the signal after shutdown, so the process would die by SIGTERM instead of exiting 0. So
its handlers are replaced: the first signal turns the gate to draining (new requests get 503 while
the socket stays open), waits for in-flight requests up to drain_timeout, aborts what is left (they
end with finish_reason "abort"), and only then lets uvicorn shut down. A second signal skips the wait.
"""

import asyncio
import contextlib
import logging
import signal
import time

import uvicorn

from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.server.gate import GateState

logger = logging.getLogger(__name__)

# After aborting at the drain timeout, how long the aborted streams get to send their last chunk.
_ABORT_GRACE_S = 2.0


class _Server(uvicorn.Server):
    def capture_signals(self):
        return contextlib.nullcontext()  # serve_with_drain installs its own handlers


async def serve_with_drain(config: uvicorn.Config, gate: GateState, engine: AsyncEngine,
                           drain_timeout: float) -> None:
    server = _Server(config)
    loop = asyncio.get_running_loop()
    drain: asyncio.Task | None = None

    def on_signal(sig: signal.Signals) -> None:
        nonlocal drain
        if drain is None:
            logger.info("%s: draining %d in-flight requests (up to %.0f s)", sig.name, gate.in_flight,
                        drain_timeout)
            drain = loop.create_task(_drain(server, gate, engine, drain_timeout))
        else:
            logger.info("%s again: aborting in-flight requests now", sig.name)
            engine.abort_all()
            server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await server.serve()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if drain is not None:
            drain.cancel()


async def _drain(server: uvicorn.Server, gate: GateState, engine: AsyncEngine, timeout: float) -> None:
    gate.draining = True
    if not await _wait_idle(gate, timeout):
        logger.warning("drain timeout: aborting %d in-flight requests", gate.in_flight)
        engine.abort_all()
        await _wait_idle(gate, _ABORT_GRACE_S)
    server.should_exit = True


async def _wait_idle(gate: GateState, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while gate.in_flight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return gate.in_flight == 0
