"""The engine core process's pipes: one channel per API server, multiplexed into one EngineCore.

`nanoserve serve` puts one API server process (on CUDA, or --engine-process) or several (--api-server-count N)
in front of one engine core process. Each API server has a channel of its own to the engine (a multiprocessing
Connection; a ChannelEngineClient, process_client.py, holds the other end), and the process that started the
engine holds a control connection. ChannelMux, on the engine side, is the EngineCore's `receive` and `publish`
over all of them:

- receive: the commands of every channel. With more than one channel, request ids are made unique inside
  the engine by a suffix naming the channel ("@2"; chat's tool loop knows its requests by the id's prefix,
  which stays), and an abort-all aborts only the requests of the channel that sent it.
- publish: each output delta goes only to the channel that owns the request, under the id that channel
  gave it; every channel gets the engine's stats, with num_added counting its own adds (AsyncEngine works
  out what is still on its way to the engine from it).

A channel's Stop, or its end of file (that API server died), closes it, aborting the requests it still
had in the engine. The loop stops when the control connection says Stop, or when the last channel closes.
(The control connection's end of file alone does not stop it: if whoever started the engine dies, the API
servers drain what they have in flight, then close their channels.)
"""

import dataclasses
import logging
import selectors
from dataclasses import dataclass
from multiprocessing.connection import Connection

from nanoserve.config import EngineConfig
from nanoserve.outputs import RequestOutput
from nanoserve.runtime.engine_core import AbortAll, AbortRequest, AddRequest, Command, EngineStats, RequestError, Stop
from nanoserve.runtime.output_delta import DeltaEncoder, RequestDelta

logger = logging.getLogger(__name__)


# -- messages from the engine core process -------------------------------------------------------------------
@dataclass
class Ready:
    """On the control connection, once the model is loaded."""

    config: EngineConfig  # final: max_model_len may be lowered to the KV pool, eos ids filled from the tokenizer
    stats: EngineStats


@dataclass
class LoadFailed:
    """On the control connection, instead of Ready. The exception as text: not every exception class
    survives a pickle round trip."""

    is_value_error: bool  # a bad argument (the CLI prints those as "error: ..."), not a crash
    message: str
    traceback: str


@dataclass
class Step:
    """On a channel: what one loop iteration produced for that channel's requests."""

    deltas: list[RequestDelta]
    errors: list[RequestError]
    stats: EngineStats


@dataclass
class Failed:
    """On every channel, last: the engine failed and its process is exiting."""

    message: str


class ChannelMux:
    def __init__(self, channels: list[Connection], control: Connection) -> None:
        self._channels: list[Connection | None] = list(channels)  # None: closed
        self._num_added = [0] * len(channels)
        self._suffixed = len(channels) > 1
        # engine request id -> (channel, the id that channel gave it); a request leaves when it finishes.
        self._routes: dict[str, tuple[int, str]] = {}
        # Aborts for the requests of channels found closed while publishing: the next receive returns them.
        self._pending: list[Command] = []
        self._encoder = DeltaEncoder()
        self._selector = selectors.DefaultSelector()
        for index, conn in enumerate(channels):
            self._selector.register(conn, selectors.EVENT_READ, index)
        self._selector.register(control, selectors.EVENT_READ, None)
        self._control = control

    # -- EngineCore's receive and publish ----------------------------------------------------------------------
    def receive(self, block: bool) -> list[Command]:
        commands, self._pending = self._pending, []
        while True:
            stop = False
            for key, _ in self._selector.select(None if block and not commands else 0):
                if key.data is None:
                    stop = self._take_control()
                else:
                    commands += self._take(key.data)
            if stop or all(conn is None for conn in self._channels):
                return [*commands, Stop()]
            if commands or not block:
                return commands

    def publish(self, outputs: list[RequestOutput], errors: list[RequestError], stats: EngineStats) -> None:
        deltas: list[list[RequestDelta]] = [[] for _ in self._channels]
        refused: list[list[RequestError]] = [[] for _ in self._channels]
        for delta in self._encoder.encode(outputs):
            engine_id, finished = delta[0], delta[2]
            route = self._routes.pop(engine_id, None) if finished else self._routes.get(engine_id)
            if route is not None:  # None: its channel closed
                index, request_id = route
                deltas[index].append((request_id, *delta[1:]) if self._suffixed else delta)
        for engine_id, exc in errors:
            self._encoder.forget(engine_id)  # a request that failed after some outputs were sent
            if (route := self._routes.pop(engine_id, None)) is not None:
                refused[route[0]].append((route[1], exc))
        for index, conn in enumerate(self._channels):
            if conn is None:
                continue
            own_stats = dataclasses.replace(stats, num_added=self._num_added[index]) if self._suffixed else stats
            try:
                conn.send(Step(deltas[index], refused[index], own_stats))
            except OSError:  # that API server is gone
                logger.warning("API server channel %d closed while sending to it", index)
                self._pending += self._close(index)

    def fail(self, message: str) -> None:
        """Tell every open channel that the engine failed (the process exits next)."""
        for conn in self._channels:
            if conn is not None:
                try:
                    conn.send(Failed(message))
                except OSError:
                    pass

    def close(self) -> None:
        for index, conn in enumerate(self._channels):
            if conn is not None:
                self._close(index)
        self._selector.close()

    def _take_control(self) -> bool:
        """Whether the control connection said Stop."""
        try:
            return isinstance(self._control.recv(), Stop)
        except (EOFError, OSError):
            self._selector.unregister(self._control)
            return False

    # -- one channel ----------------------------------------------------------------------------------------------
    def _take(self, index: int) -> list[Command]:
        """The commands waiting on channel `index`, in engine terms."""
        conn = self._channels[index]
        received: list[Command] = []
        try:
            received += conn.recv()
            while conn.poll():
                received += conn.recv()
        except (EOFError, OSError):
            logger.warning("API server channel %d closed without a Stop: aborting its requests", index)
            return self._translate(index, received) + self._close(index)
        return self._translate(index, received)

    def _translate(self, index: int, received: list[Command]) -> list[Command]:
        commands: list[Command] = []
        for command in received:
            if isinstance(command, AddRequest):
                self._num_added[index] += 1
                engine_id = self._engine_id(index, command.request_id)
                self._routes[engine_id] = (index, command.request_id)
                commands.append(AddRequest(engine_id, command.prompt_token_ids, command.params)
                                if self._suffixed else command)
            elif isinstance(command, AbortRequest):
                commands.append(AbortRequest(self._engine_id(index, command.request_id)))
            elif isinstance(command, AbortAll):
                commands += self._aborts_of(index)
            elif isinstance(command, Stop):
                return commands + self._close(index)  # nothing follows a Stop
            else:
                commands.append(command)  # Setup: for the whole engine (the tool loop installs once per prefix)
        return commands

    def _engine_id(self, index: int, request_id: str) -> str:
        return f"{request_id}@{index}" if self._suffixed else request_id

    def _aborts_of(self, index: int) -> list[Command]:
        return [AbortRequest(engine_id) for engine_id, (owner, _) in self._routes.items() if owner == index]

    def _close(self, index: int) -> list[Command]:
        """Close channel `index` (its API server sees end of file); returns aborts for what it had running."""
        conn = self._channels[index]
        self._channels[index] = None
        self._selector.unregister(conn)
        conn.close()
        aborts = self._aborts_of(index)
        for abort in aborts:  # nobody is left to tell how they end
            del self._routes[abort.request_id]
        return aborts
