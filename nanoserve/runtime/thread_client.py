"""ThreadEngineClient: the LLMEngine driven by a background thread of the server's own process.

The simplest way to run the engine behind the event loop, and the default on the CPU: the client starts
the EngineCore on a daemon thread, commands reach it through a queue, and its outputs go straight to the
request streams. The cost is the GIL: the event loop's HTTP work and the engine's host work (scheduling,
detokenizing, building outputs) take turns on one core. ProcessEngineClient (process_client.py) moves the
engine out of the process.
"""

import logging
import queue
import threading
from collections.abc import Callable

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.outputs import RequestOutput
from nanoserve.runtime.engine_core import (
    AbortAll,
    AbortRequest,
    AddRequest,
    Command,
    EngineCore,
    EngineStats,
    RequestError,
    Setup,
    Stop,
)
from nanoserve.runtime.streams import EngineDeadError, RequestStream, deliver
from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ThreadEngineClient:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stats = EngineStats.of(engine, 0)  # replaced (never mutated) after every iteration
        self.error: str | None = None  # why the engine died
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        # Guards _streams and error: a submit racing the loop's death must either be refused or be
        # among the streams the death fails, so no add is left unanswered.
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self._thread.start()

    def add(self, requests: list[tuple[str, list[int], SamplingParams, RequestStream]]) -> None:
        """Queue requests; raises EngineDeadError, queueing none, if the engine has died."""
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(self.error)
            for request_id, ids, params, stream in requests:
                self._streams[request_id] = stream
                self._commands.put(AddRequest(request_id, ids, params))

    def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))

    def abort_all(self) -> None:
        self._commands.put(AbortAll())

    def setup(self, fn: Callable[[LLMEngine], object]) -> None:
        self._commands.put(Setup(fn))

    def shutdown(self) -> None:
        self._commands.put(Stop())
        self._thread.join(timeout=10)

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            why = EngineCore(self.engine, self._receive, self._publish).run() or "the engine was shut down"
        except Exception as exc:  # from publishing (the loop catches the engine's own): no request may be left waiting
            logger.exception("the engine thread failed")
            why = f"the engine thread failed: {type(exc).__name__}: {exc}"
        self._fail_all(why)

    def _receive(self, block: bool) -> list[Command]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _publish(self, outputs: list[RequestOutput], errors: list[RequestError], stats: EngineStats) -> None:
        items: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        with self._lock:
            for request_id, exc in errors:
                if (stream := self._streams.pop(request_id, None)) is not None:
                    items.append((stream, exc))
            for out in outputs:
                # A finished request leaves the table: nothing more will come for it.
                stream = (self._streams.pop if out.finished else self._streams.get)(out.request_id, None)
                if stream is not None:
                    items.append((stream, out))
        # Stats first: a caller woken by these outputs must not read the stats of the step before them.
        self.stats = stats
        deliver(items)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            self.error = message
            streams, self._streams = list(self._streams.values()), {}
        deliver([(stream, EngineDeadError(message)) for stream in streams])
