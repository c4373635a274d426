"""--api-server-count N: N API server processes in front of one engine process (vLLM's flag).

Under load one server process's event loop is what limits the server: with hundreds of streams it spends
~150 us of CPU per streamed chunk while the engine process idles. With N > 1, the process that
`nanoserve serve` runs in supervises the others:

1. it binds the listening sockets (a taken port fails here, before the model loads): one per API server,
   all on the one port with SO_REUSEPORT, so that the kernel spreads new connections evenly over them. (One
   shared socket spread a burst of connections badly: uvloop accepts until the backlog is empty, so the
   first server to wake took most of them, 161 of 200 in a test with two.)
2. starts the engine core process with one channel per API server (runtime/channels.py), and N API server
   processes (spawn) while the engine loads its model (their imports take seconds too);
3. hands each API server the engine's final configuration once the model is loaded; each builds the app
   around a ChannelEngineClient on its own channel, with its own event loop, tokenizer pool and streams, and
   says when it is ready;
4. once all are ready, tells them to serve: each listens on its socket;
5. relays SIGTERM / SIGINT to every API server over its control pipe: a drain, and a second signal aborts
   at once, as with one server. The API servers and the engine ignore signals themselves, so a Ctrl-C
   (which reaches the whole process group) drains once. When the API servers have all exited, it stops
   the engine process.

An API server that exits on its own makes the supervisor drain the others and exit 1, rather than serve
on with part of the deployment gone. The engine process dying is handled as with one server: every API
server fails what it has in flight, says "dead" on /health and refuses new requests (503) until stopped.

With --data-parallel-size D the supervisor starts D engine core processes (runtime/data_parallel.py's placements),
each with one channel per API server; every API server routes its own requests over its D channels with a
DataParallelClient of its own (so each keeps its own prefix index: requests sharing a prefix that arrive at
different API servers may start on different replicas, and then each follows its own). A replica that dies stops
the deployment: the supervisor drains the API servers and exits 1.

/metrics: PROMETHEUS_MULTIPROC_DIR names a temporary directory while the API servers live, so that their
request counters and latency histograms are summed over all of them, whichever one is scraped. The engine's
gauges and counters come from the engine's own stats, the same behind every API server.
"""

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from nanoserve.config import EngineArgs
from nanoserve.engine.frontend import engine_config, load_tokenizer
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.runtime.channels import Ready
from nanoserve.runtime.data_parallel import DataParallelClient, placements, replica_args
from nanoserve.runtime.engine_core_process import EngineCoreProcess
from nanoserve.runtime.process_client import ChannelEngineClient
from nanoserve.runtime.routing import RoutingConfig
from nanoserve.server.gate import GateState
from nanoserve.server.http_limits import HEADER_TIMEOUT_S, MAX_HEADER_BYTES
from nanoserve.server.routes import build_app
from nanoserve.server.shutdown import serve_with_drain
from nanoserve.server.uvicorn_setup import event_loop_factory, startup_objects_frozen, uvicorn_config

logger = logging.getLogger(__name__)

_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class ServerOptions:
    """How every API server serves: run_server's arguments besides the engine's and the address."""

    served_model_name: list[str]
    api_key: str | None
    max_waiting_requests: int | None
    drain_timeout: float
    uvicorn_log_level: str = "info"
    log_requests: bool = True
    max_header_bytes: int = MAX_HEADER_BYTES
    header_timeout: float = HEADER_TIMEOUT_S
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False


def run_api_servers(engine_args: EngineArgs, host: str, port: int, count: int, options: ServerOptions) -> int:
    """Serve with `count` API server processes until SIGTERM / SIGINT; returns the exit status."""
    engine_args = replace(engine_args, engine_process=True)  # implied, whatever was asked
    engine_config(engine_args)  # bad arguments fail here, before any process starts
    return _Supervisor(count, options).run(engine_args, host, port)


@dataclass
class _ApiServer:
    index: int
    process: BaseProcess
    control: Connection  # the parent's end: the engine's Ready goes out, "ready" comes back, then "serve", signals


class _Supervisor:
    def __init__(self, count: int, options: ServerOptions) -> None:
        self.count = count
        self.options = options
        self.engines: list[EngineCoreProcess] = []  # one, or one a replica (--data-parallel-size)
        self.servers: list[_ApiServer] = []
        self.serving = False
        self.stopping = False
        self.signals: list[str] = []  # received, not yet relayed
        # The signal handler writes here, so that the supervisor's wait() wakes up to relay the signal.
        self.wake, self.wake_handler_end = socket.socketpair()
        self.wake_handler_end.setblocking(False)

    def run(self, engine_args: EngineArgs, host: str, port: int) -> int:
        sockets = _bind(host, port, self.count)
        address = sockets[0].getsockname()[:2]
        metrics_dir = tempfile.mkdtemp(prefix="nanoserve-metrics-")
        previous_env = os.environ.get(_MULTIPROC_ENV)
        previous_handlers = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}
        try:
            if engine_args.data_parallel_size > 1:
                for p in placements(engine_args):  # appended one by one: a failed start stops those before it
                    self.engines.append(EngineCoreProcess.spawn(replica_args(engine_args, p.index), self.count, p))
            else:
                self.engines.append(EngineCoreProcess.spawn(engine_args, self.count))
            self.routing = RoutingConfig(policy=engine_args.data_parallel_routing)
            # Set before the API servers start: prometheus_client picks its multiprocess mode on import.
            os.environ[_MULTIPROC_ENV] = metrics_dir
            self._start_servers(sockets)
            readies = [engine.wait_ready() for engine in self.engines]
            self._wait_servers(readies)
            for sock in sockets:  # the API servers hold them now: a dead one's socket must close with it
                sock.close()
            for server in self.servers:
                server.control.send("serve")
            self.serving = True
            logger.info("serving %s (max_model_len %d) on http://%s:%d with %d API server processes (pids %s) "
                        "and the engine in its own process (pid %s)",
                        ", ".join(map(repr, self.options.served_model_name)),
                        readies[0].config.max_model_len, *address, self.count,
                        ", ".join(str(server.process.pid) for server in self.servers),
                        ", ".join(str(engine.process.pid) for engine in self.engines))
            return self._supervise()
        finally:
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
            self._stop_all()
            for sock in sockets:
                sock.close()
            self.wake.close()
            self.wake_handler_end.close()
            if previous_env is None:
                os.environ.pop(_MULTIPROC_ENV, None)
            else:
                os.environ[_MULTIPROC_ENV] = previous_env
            shutil.rmtree(metrics_dir, ignore_errors=True)

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self.serving:
            raise SystemExit(f"{name} while starting: stopped")  # the finally of run() stops what started
        self.signals.append(name)
        try:
            self.wake_handler_end.send(b"\0")
        except BlockingIOError:
            pass  # a wake-up is pending already

    def _start_servers(self, sockets: list[socket.socket]) -> None:
        ctx = multiprocessing.get_context("spawn")
        log_level = logging.getLogger().getEffectiveLevel()
        for index in range(self.count):
            channels = [engine.channels[index] for engine in self.engines]  # its own channel into each engine
            control, child_control = ctx.Pipe()
            process = ctx.Process(target=run_api_server, name=f"nanoserve-api-server-{index}", daemon=True,
                                  args=(index, sockets[index % len(sockets)], channels, child_control,
                                        [engine.process.pid for engine in self.engines], self.options, log_level,
                                        self.routing))
            process.start()
            child_control.close()
            for channel in channels:
                channel.close()  # the API server's now: its exit must be end of file in the engine
            self.servers.append(_ApiServer(index, process, control))

    def _wait_servers(self, readies: list[Ready]) -> None:
        for server in self.servers:
            try:
                server.control.send(readies)
            except OSError:
                pass  # it died: its sentinel says so below
        engine_sentinels = [engine.process.sentinel for engine in self.engines]
        for server in self.servers:
            handles = wait([server.control, server.process.sentinel, *engine_sentinels])
            if server.control in handles:
                try:
                    if server.control.recv() == "ready":
                        continue
                except EOFError:
                    pass
            dead = [engine for engine in self.engines if engine.process.sentinel in handles]
            if server.process.sentinel not in handles and dead:
                raise RuntimeError(f"the engine process {dead[0].exit_status()} while the API servers started")
            server.process.join(timeout=5)
            raise RuntimeError(f"API server {server.index} exited with code {server.process.exitcode} while "
                               "starting (see its log above)")

    def _supervise(self) -> int:
        """Wait for the API servers to exit, relaying signals; returns the exit status."""
        failed = False
        live = {server.process.sentinel: server for server in self.servers}
        engines = {engine.process.sentinel: index for index, engine in enumerate(self.engines)}
        while live:
            for handle in wait([*live, self.wake, *engines]):
                if handle is self.wake:
                    self.wake.recv(4096)
                    signals, self.signals = self.signals, []
                    for name in signals:
                        self._relay(name, live.values())
                elif handle in engines:
                    engine = self.engines[engines.pop(handle)]
                    engine.process.join(timeout=5)
                    if self.stopping:
                        continue  # it stopped when the last API server closed its channel
                    if len(self.engines) == 1:
                        logger.error("the engine process %s: the API servers refuse requests (503) until stopped",
                                     engine.exit_status())
                    else:
                        # A lost replica ends the deployment, as with one API server (runtime/data_parallel.py).
                        failed = True
                        logger.error("engine %d: the engine process %s: stopping the API servers",
                                     self.engines.index(engine), engine.exit_status())
                        self._relay("an engine replica died", live.values())
                else:
                    server = live.pop(handle)
                    server.process.join()
                    code = server.process.exitcode
                    if code != 0 or not self.stopping:
                        failed = True
                        logger.error("API server %d exited with code %s%s", server.index, code,
                                     "" if self.stopping else ": stopping the others")
                        self._relay(f"API server {server.index} exited", live.values())
        return 1 if failed else 0

    def _relay(self, why: str, servers) -> None:
        self.stopping = True
        for server in servers:
            try:
                server.control.send(why)
            except OSError:
                pass  # it is exiting: its sentinel will say so

    def _stop_all(self) -> None:
        for server in self.servers:
            if server.process.is_alive():  # only on the way out of a failure: on a stop they have exited
                server.process.kill()
            server.process.join(timeout=5)
            server.control.close()
        for engine in self.engines:
            engine.stop(timeout=10)


def _bind(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets bound to host:port with SO_REUSEPORT (one, shared, where there is none); not yet
    listening, so that no connection waits for an API server that is still starting."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    reuse_port = hasattr(socket, "SO_REUSEPORT")
    sockets: list[socket.socket] = []
    try:
        for _ in range(count if reuse_port else 1):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            # Port 0 picks a free port once; the others join it.
            sock.bind(address if len(sockets) == 1 else (address[0], sockets[0].getsockname()[1], *address[2:]))
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sockets


def _pidfd(pid: int) -> int | None:
    """A handle that becomes readable when process `pid` (not our child) exits; None where Linux has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


# -- an API server process ----------------------------------------------------------------------------------
def run_api_server(index: int, sock: socket.socket, channels: list[Connection], control: Connection,
                   engine_pids: list[int], options: ServerOptions, log_level: int,
                   routing: RoutingConfig | None = None) -> None:
    """An API server process's main: the app around a ChannelEngineClient on its channel to the engine (or, with
    data parallelism, a DataParallelClient over one a replica, routing by `routing`), served on `sock`."""
    # The supervisor relays signals over `control`; taking them here too would drain twice.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s %(name)s (api server {index}): %(message)s")
    readies: list[Ready] = control.recv()  # once every engine has loaded its model
    watches = [_pidfd(pid) for pid in engine_pids]
    tokenizer = load_tokenizer(readies[0].config.tokenizer_dir)
    clients = [ChannelEngineClient(channel, ready, tokenizer, watch)
               for channel, ready, watch in zip(channels, readies, watches, strict=True)]
    async_engine = AsyncEngine(clients[0] if len(clients) == 1 else DataParallelClient(clients, routing))
    try:
        gate = GateState()
        app = build_app(async_engine, options.served_model_name, options.api_key, options.max_waiting_requests,
                        gate=gate, api_server=index, log_requests=options.log_requests,
                        tool_call_parser=options.tool_call_parser,
                        enable_auto_tool_choice=options.enable_auto_tool_choice)
        config = uvicorn_config(app, options.uvicorn_log_level, options.max_header_bytes, options.header_timeout)
        control.send("ready")
        control.recv()  # "serve": every API server is ready, and the socket listens
        with startup_objects_frozen(), asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(serve_with_drain(config, gate, async_engine, options.drain_timeout, sockets=[sock],
                                        control=control))
    finally:
        async_engine.shutdown()
        for watch in watches:
            if watch is not None:
                os.close(watch)
