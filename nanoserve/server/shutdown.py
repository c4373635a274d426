"""Running uvicorn with a graceful drain on SIGTERM / SIGINT.

uvicorn's own handling stops listening at once (new clients get "connection refused", not 503) and
re-raises the signal after shutdown, so the process would die by SIGTERM instead of exiting 0. So
its handlers are replaced: the first signal turns the gate to draining (new requests get 503 while
the socket stays open), waits for in-flight requests up to drain_timeout, aborts what is left (they
end with finish_reason "abort"), and only then lets uvicorn shut down. A second signal skips to the aborts.

An API server process among several (api_servers.py) takes no signals: its parent relays them over a
control pipe, one message per signal, and the pipe's end of file (the parent is gone) counts as one too.
"""

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import uvicorn

from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.server.gate import GateState

logger = logging.getLogger(__name__)

# After aborting at the drain timeout, how long the aborted streams get to send their last chunk.
_ABORT_GRACE_S = 2.0


class _Server(uvicorn.Server):
    def capture_signals(self):
        return contextlib.nullcontext()  # serve_with_drain installs its own handlers


async def serve_with_drain(config: uvicorn.Config, gate: GateState, engine: AsyncEngine, drain_timeout: float,
                           sockets: list[socket.socket] | None = None, control: Connection | None = None,
                           exit_when_engine_dies: bool = False) -> int:
    """Serve (on `sockets` if given, else config's host and port) until told to stop: by SIGTERM / SIGINT,
    or with `control`, by what arrives on it; with exit_when_engine_dies, also when the engine dies. Returns the
    exit status: 1 if the engine died, else 0."""
    server = _Server(config)
    loop = asyncio.get_running_loop()
    drain: asyncio.Task | None = None
    status = 0

    def stop(why: str) -> None:
        nonlocal drain
        if drain is None:
            logger.info("%s: draining %d in-flight requests (up to %.0f s)", why, gate.in_flight, drain_timeout)
            drain = loop.create_task(_drain(server, gate, engine, drain_timeout))
        else:
            logger.info("%s again: aborting in-flight requests now", why)
            drain.cancel()
            drain = loop.create_task(_drain(server, gate, engine, 0))

    def on_control() -> None:
        try:
            why = f"{control.recv()} (from the parent process)"
        except EOFError:
            loop.remove_reader(control.fileno())
            why = "the parent process is gone"
        stop(why)

    async def watch_engine() -> None:
        nonlocal status
        while not engine.dead:
            await asyncio.sleep(0.25)
        logger.error("the engine died (%s): the server stops", engine.error)
        status = 1
        stop("the engine died")

    if control is None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop, sig.name)
    else:
        loop.add_reader(control.fileno(), on_control)
    watcher = loop.create_task(watch_engine()) if exit_when_engine_dies else None
    try:
        await server.serve(sockets)
        return status
    finally:
        if watcher is not None:
            watcher.cancel()
        if control is None:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        else:
            loop.remove_reader(control.fileno())
        if drain is not None:
            drain.cancel()


async def _drain(server: uvicorn.Server, gate: GateState, engine: AsyncEngine, timeout: float) -> None:
    gate.draining = True
    if not await _wait_idle(gate, timeout):
        logger.warning("drain timeout: aborting %d in-flight requests", gate.in_flight)
        # Again at every poll: a request still reading its body or tokenizing when an abort went out reaches the
        # engine after it, and would run on until uvicorn cut its connection, with no finish_reason.
        await _wait_idle(gate, _ABORT_GRACE_S, every_poll=engine.abort_all)
    server.should_exit = True


async def _wait_idle(gate: GateState, timeout: float, every_poll: Callable[[], None] | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while gate.in_flight > 0 and time.monotonic() < deadline:
        if every_poll is not None:
            every_poll()
        await asyncio.sleep(0.05)
    return gate.in_flight == 0
