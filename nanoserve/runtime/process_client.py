"""The client side of the engine core process: what an API server holds when the engine runs in a process.

- ChannelEngineClient: an API server's end of its channel to the engine core process (one per API server
  with --api-server-count N; api_servers.py).
- ProcessEngineClient (the default on CUDA, `--engine-process`): one API server in this process, over
  channel 0: a ChannelEngineClient that also starts and owns the engine core process (EngineCoreProcess,
  engine_core_process.py), so it can say how the process ended and stop it.

    API server process                                      engine core process (channels.py)
    event loop --commands--> outbox -> writer thread ==pipe==> ChannelMux -> EngineCore: LLMEngine.step()
    event loop <-call_soon-- reader thread <======pipe=== per-step deltas + EngineStats

The pipe is a multiprocessing Connection (pickle): no dependency beyond the standard library, and pickle
takes the messages as they are (dataclasses, SamplingParams, ValueError). Outputs cross as deltas
(output_delta.py), so a step costs what it produced, not what every request holds so far; the reader
thread rebuilds the cumulative RequestOutputs the serving code reads, and hands them to the event loop
with one call_soon_threadsafe per step. Commands go through a writer thread so that the event loop never
blocks on a full pipe while the engine is busy stepping.

Failures: if step() raises, the engine sends why and exits; if the engine process dies (killed, segfault),
the pipe reaches end of file, or the `watch` handle (the process's sentinel, or a pidfd) fires. Either way
every request in flight gets EngineDeadError and the engine stays dead for this client, as with
ThreadEngineClient.
"""

import logging
import pickle
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from nanoserve.config import EngineArgs
from nanoserve.engine.frontend import EngineFrontend, engine_config, load_tokenizer
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.outputs import RequestOutput
from nanoserve.runtime.channels import Failed, Ready, Step
from nanoserve.runtime.engine_core import AbortAll, AbortRequest, AddRequest, Command, Setup, Stop
from nanoserve.runtime.engine_core_process import EngineCoreProcess
from nanoserve.runtime.output_delta import OutputAssembler
from nanoserve.runtime.streams import EngineDeadError, RequestStream, deliver
from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Live:
    """A request in flight, as the server sees it: where its outputs go, and what it has so far."""

    stream: RequestStream
    assembler: OutputAssembler


class ChannelEngineClient:
    def __init__(self, conn: Connection, ready: Ready, tokenizer, watch: int | None = None,
                 stop_timeout: float = 10.0) -> None:
        """Serve requests over `conn`, a channel of a running engine process that sent `ready`. `watch`: a
        handle that becomes ready when the engine process ends (its sentinel, or a pidfd), or None."""
        self.engine = EngineFrontend(ready.config, tokenizer)
        self.stats = ready.stats  # replaced (never mutated) after every engine step
        self.error: str | None = None  # why the engine died
        self.stop_timeout = stop_timeout
        self._conn = conn
        self._watch = watch
        self._live: dict[str, _Live] = {}
        # Guards _live and error: a submit racing the engine's death is either refused or failed by it.
        self._lock = threading.Lock()
        self._stopping = False
        self._outbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="nanoserve-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="nanoserve-engine-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    # -- what AsyncEngine calls (on the event loop) -----------------------------------------------------
    def add(self, requests: list[tuple[str, list[int], SamplingParams, RequestStream]]) -> None:
        """Send requests; raises EngineDeadError, sending none, if the engine has died."""
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(self.error)
            for request_id, ids, _, stream in requests:
                self._live[request_id] = _Live(stream, OutputAssembler(request_id, ids))
        for request_id, ids, params, _ in requests:
            self._outbox.put(AddRequest(request_id, ids, params))

    def abort(self, request_id: str) -> None:
        self._outbox.put(AbortRequest(request_id))

    def abort_all(self) -> None:
        """Abort every request of this client (other API servers' requests run on)."""
        self._outbox.put(AbortAll())

    def setup(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run fn(engine) in the engine process; fn must pickle (a module-level function, or a
        functools.partial of one). Checked here, so that the caller sees it, not the writer thread."""
        pickle.dumps(fn)
        self._outbox.put(Setup(fn))

    def shutdown(self) -> None:
        """Close this client's channel: the engine aborts what this client still had running."""
        self._stopping = True
        self._outbox.put(Stop())
        deadline = time.monotonic() + self.stop_timeout
        self._writer.join(self.stop_timeout)  # it ends once the Stop is sent, or at once if the engine is gone
        # The reader ends at the channel's end of file, failing what was in flight.
        self._reader.join(max(0.0, deadline - time.monotonic()))
        self._close()

    def _close(self) -> None:
        """Close the connection once neither thread uses it; one stuck in the pipe (a hung engine) leaves it to
        the garbage collector. Nobody else may close it while they can: a thread that has read the fd number can
        lose the CPU before its write(2), then write into whatever took the number since."""
        if not self._reader.is_alive() and not self._writer.is_alive():
            self._conn.close()

    # -- the writer and reader threads --------------------------------------------------------------------
    def _write(self) -> None:
        while True:
            batch = [self._outbox.get()]
            while True:  # all that queued up while the last batch was sent: one message
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            try:
                self._conn.send(batch)
            except OSError:
                return  # the engine process is gone: the reader fails what is in flight
            except Exception as exc:  # a bug: without a writer no request could ever finish
                logger.exception("sending to the engine process failed")
                self._fail_all(f"the engine connection failed: {type(exc).__name__}: {exc}")
                self._on_broken()
                return
            if any(isinstance(c, Stop) for c in batch):
                return

    def _read(self) -> None:
        try:
            while True:
                msg = self._recv()
                if isinstance(msg, Failed):
                    self._fail_all(msg.message)
                    return
                self._on_step(msg)
        except EOFError:
            if self._stopping:
                self._fail_all("the engine was shut down")
            else:
                why = self._gone()
                logger.error(why)
                self._fail_all(why)
        except Exception as exc:  # a bug here must not leave requests waiting forever
            logger.exception("reading from the engine process failed")
            self._fail_all(f"the engine connection failed: {type(exc).__name__}: {exc}")
            self._on_broken()
            # Nothing reads this channel any more. Left open, it would fill, and the engine, which sends every
            # channel each step's stats, would block on it: every other API server's requests would stop. Hung up,
            # it is a channel whose client left: the engine aborts its requests and serves the others.
            self._hang_up()

    def _hang_up(self) -> None:
        """End the channel for both sides, as closing it would (the engine sees end of file; its sends and the
        writer's fail), but leave its fd number taken until _close: the writer may hold the number."""
        try:
            # A duplex Pipe is a socket pair; fromfd shuts it down through a copy of the fd.
            with socket.fromfd(self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already

    def _gone(self) -> str:
        """Why the engine's end of the pipe closed, as far as this process can tell."""
        return "the engine process exited (or was killed)"

    def _on_broken(self) -> None:
        """The connection is unusable (a bug): the process owner kills the engine process."""

    def _recv(self) -> Step | Failed:
        # The watch handle as well as the pipe: if a grandchild inherited the engine's end of the pipe, the
        # engine's death would never show as end of file.
        ready = wait([self._conn] if self._watch is None else [self._conn, self._watch])
        if self._conn not in ready:
            raise EOFError
        return self._conn.recv()  # EOFError once the engine's end is closed

    def _on_step(self, msg: Step) -> None:
        items: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        with self._lock:
            for request_id, exc in msg.errors:
                if (live := self._live.pop(request_id, None)) is not None:
                    items.append((live.stream, exc))
            lives = []
            for delta in msg.deltas:
                request_id, _, finished, *_ = delta
                # A finished request leaves the table: nothing more will come for it.
                live = self._live.pop(request_id, None) if finished else self._live.get(request_id)
                lives.append((live, delta))
        # Outside the lock: only this thread touches the assemblers.
        items += [(live.stream, live.assembler.apply(delta)) for live, delta in lives if live is not None]
        # Stats first: a caller woken by these outputs must not read the stats of the step before them.
        self.stats = msg.stats
        deliver(items)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            if self.error is None:  # the first reason is the one to report (a Failed, then the end of file)
                self.error = message
            lives, self._live = list(self._live.values()), {}
        deliver([(live.stream, EngineDeadError(self.error)) for live in lives])


class ProcessEngineClient(ChannelEngineClient):
    def __init__(self, args: EngineArgs, stop_timeout: float = 10.0, core_process: EngineCoreProcess | None = None,
                 tokenizer=None) -> None:
        """Start the engine core process and wait until its model is loaded; raises what loading raised.
        `core_process`: one started already (a data-parallel replica: all load at once), owned from here on;
        `tokenizer`: the model's, if loaded already."""
        if core_process is None:
            config = engine_config(args)  # bad arguments fail here, before a process is started
            core_process = EngineCoreProcess.spawn(args)
        elif tokenizer is None:
            config = engine_config(args)
        self.core_process = core_process
        self.process = self.core_process.process
        try:
            if tokenizer is None:
                tokenizer = load_tokenizer(config.tokenizer_dir)  # while the child loads the model
            ready = self.core_process.wait_ready()
        except BaseException:
            self.core_process.kill()
            self.core_process.close()
            raise
        super().__init__(self.core_process.channels[0], ready, tokenizer, watch=self.process.sentinel,
                         stop_timeout=stop_timeout)

    def shutdown(self) -> None:
        """Stop the engine process: it leaves its loop when its only channel closes; killed if it does not."""
        self._stopping = True
        self._outbox.put(Stop())
        self.process.join(self.stop_timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not stop in %.0f s: killing it", self.stop_timeout)
            self.core_process.kill()
        self._writer.join(timeout=5)  # the engine is gone: a send still to come fails at once
        self._reader.join(timeout=5)  # it fails whatever was still in flight
        self._close()
        self.core_process.control.close()

    def _gone(self) -> str:
        self.process.join(timeout=5)
        return f"the engine process {self.core_process.exit_status()}"

    def _on_broken(self) -> None:
        self.core_process.kill()
