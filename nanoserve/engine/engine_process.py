"""ProcessEngineCore: the LLMEngine in a process of its own, behind the server (as vLLM's EngineCore).

With the engine on a thread of the server process (engine_thread.py), the event loop's HTTP work and
the engine's host work share one GIL, and under load each waits for the other. Here the engine process
runs the EngineLoop (scheduling, the model, appending tokens, detokenizing, stop checks); the server
process keeps HTTP, tokenizing prompts and the streams.

    server process                                          engine process (spawned)
    event loop --commands--> outbox -> writer thread ==pipe==> EngineLoop: LLMEngine.step()
    event loop <-call_soon-- reader thread <======pipe=== per-step deltas + EngineStats

The pipe is a multiprocessing Connection (pickle): no dependency beyond the standard library, and pickle
takes the messages as they are (dataclasses, SamplingParams, ValueError, the EngineConfig). Outputs cross
as deltas (output_delta.py), so a step costs what it produced, not what every request holds so far; the
reader thread rebuilds the cumulative RequestOutputs the serving code reads, and hands them to the event
loop with one call_soon_threadsafe per step. Commands go through a writer thread so that the event loop
never blocks on a full pipe while the engine is busy stepping.

Failures: a load error in the child is raised in the parent by the constructor. If step() raises, the
child sends why and exits; if the child dies (killed, segfault), the pipe reaches EOF (or its sentinel
fires). Either way every request in flight gets EngineDeadError and the engine stays dead, as the thread
backend does.
"""

import cProfile
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from nanoserve.config import EngineArgs, EngineConfig
from nanoserve.engine.engine_loop import (
    AbortAll,
    AbortRequest,
    AddError,
    AddRequest,
    Command,
    EngineLoop,
    EngineStats,
    Setup,
    Stop,
)
from nanoserve.engine.frontend import EngineFrontend, load_tokenizer
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.output_delta import DeltaEncoder, OutputAssembler, RequestDelta
from nanoserve.engine.streams import EngineDeadError, RequestStream, deliver
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# -- messages from the engine process ------------------------------------------------------------------
@dataclass
class _Ready:
    config: EngineConfig  # final: max_model_len may be lowered to the KV pool, eos ids filled from the tokenizer
    stats: EngineStats


@dataclass
class _LoadFailed:
    # The exception as text: not every exception class survives a pickle round trip.
    is_value_error: bool  # a bad argument (the CLI prints those as "error: ..."), not a crash
    message: str
    traceback: str


@dataclass
class _Step:
    deltas: list[RequestDelta]
    errors: list[AddError]
    stats: EngineStats


@dataclass
class _Failed:
    message: str


@dataclass
class _Live:
    """A request in flight, as the server sees it: where its outputs go, and what it has so far."""

    stream: RequestStream
    assembler: OutputAssembler


class ProcessEngineCore:
    def __init__(self, args: EngineArgs, stop_timeout: float = 10.0) -> None:
        """Start the engine process and wait until its model is loaded; raises what loading raised."""
        config = args.create_config()  # bad arguments fail here, before a process is started
        # spawn, not fork: CUDA cannot be used in a child forked after the parent touched it.
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=run_engine_process, name="nanoserve-engine", daemon=True,
                                   args=(args, child_conn, logging.getLogger().getEffectiveLevel()))
        self.process.start()
        child_conn.close()  # the child's end now lives in the child only, so its exit is EOF here
        try:
            tokenizer = load_tokenizer(config.tokenizer_dir)  # while the child loads the model
            ready = self._handshake()
        except BaseException:
            self._kill()
            self._conn.close()
            raise
        self.engine = EngineFrontend(ready.config, tokenizer)
        self.stats = ready.stats  # replaced (never mutated) after every engine step
        self.error: str | None = None  # why the engine died
        self.stop_timeout = stop_timeout
        self._live: dict[str, _Live] = {}
        # Guards _live and error: a submit racing the engine's death is either refused or failed by it.
        self._lock = threading.Lock()
        self._stopping = False
        self._outbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="nanoserve-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="nanoserve-engine-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    def _handshake(self) -> _Ready:
        try:
            msg = self._recv()
        except EOFError:
            self.process.join(timeout=5)
            raise RuntimeError(f"the engine process {_exit_status(self.process.exitcode)} while loading the "
                               "model (see its log above)") from None
        if isinstance(msg, _LoadFailed):
            self.process.join(timeout=5)
            error = (ValueError if msg.is_value_error else RuntimeError)(msg.message)
            error.add_note(f"in the engine process:\n{msg.traceback}")
            raise error
        return msg

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
        self._outbox.put(AbortAll())

    def setup(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run fn(engine) in the engine process; fn must pickle (a module-level function, or a
        functools.partial of one). Checked here, so that the caller sees it, not the writer thread."""
        pickle.dumps(fn)
        self._outbox.put(Setup(fn))

    def shutdown(self) -> None:
        """Stop the engine process: it leaves its loop at the Stop command; killed if it does not."""
        self._stopping = True
        self._outbox.put(Stop())
        self.process.join(self.stop_timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not stop in %.0f s: killing it", self.stop_timeout)
            self._kill()
        self._reader.join(timeout=5)  # it fails whatever was still in flight
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
                self._kill()
                return
            if any(isinstance(c, Stop) for c in batch):
                return

    def _read(self) -> None:
        try:
            while True:
                msg = self._recv()
                if isinstance(msg, _Failed):
                    self._fail_all(msg.message)
                    return
                self._on_step(msg)
        except EOFError:
            if self._stopping:
                self._fail_all("the engine was shut down")
            else:
                self.process.join(timeout=5)
                status = _exit_status(self.process.exitcode)
                logger.error("the engine process %s", status)
                self._fail_all(f"the engine process {status}")
        except Exception as exc:  # a bug here must not leave requests waiting forever
            logger.exception("reading from the engine process failed")
            self._fail_all(f"the engine connection failed: {type(exc).__name__}: {exc}")
            self._kill()

    def _recv(self):
        # The sentinel as well as the pipe: if a grandchild inherited the child's end of the pipe, the
        # child's death would never show as EOF.
        if self._conn not in wait([self._conn, self.process.sentinel]):
            raise EOFError
        return self._conn.recv()  # EOFError once the child's end is closed

    def _on_step(self, msg: _Step) -> None:
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
        deliver(items)
        self.stats = msg.stats

    def _fail_all(self, message: str) -> None:
        with self._lock:
            if self.error is None:  # the first reason is the one to report (a _Failed, then the EOF)
                self.error = message
            lives, self._live = list(self._live.values()), {}
        deliver([(live.stream, EngineDeadError(self.error)) for live in lives])

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exited with code {code}"


# -- the engine process ---------------------------------------------------------------------------------
def run_engine_process(args: EngineArgs, conn: Connection, log_level: int) -> None:
    """The engine process's main: load the engine, say so, then run the EngineLoop over the pipe."""
    # The server decides when the engine stops. Ctrl-C in a terminal (and systemd's SIGTERM) reach the
    # whole process group; the engine must keep running while the server drains its requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s (engine): %(message)s")
    try:
        engine = LLMEngine(args.create_config())
    except Exception as exc:
        conn.send(_LoadFailed(isinstance(exc, ValueError), str(exc), traceback.format_exc()))
        return
    conn.send(_Ready(engine.config, EngineStats.of(engine, 0)))
    encoder = DeltaEncoder()

    def receive(block: bool) -> list[Command]:
        commands = conn.recv() if block else []
        while conn.poll():
            commands += conn.recv()
        return commands

    def publish(outputs: list[RequestOutput], errors: list[AddError], stats: EngineStats) -> None:
        conn.send(_Step(encoder.encode(outputs), errors, stats))

    # NANOSERVE_PROFILE_ENGINE=path: cProfile the engine loop and write its stats there when it ends
    # (`python -m pstats path`), to see where the engine process's host time goes under load.
    profile_path = os.environ.get("NANOSERVE_PROFILE_ENGINE")
    profiler = cProfile.Profile() if profile_path else None
    if profiler is not None:
        profiler.enable()
    try:
        why = EngineLoop(engine, receive, publish).run()
        if why is not None:
            conn.send(_Failed(why))
    except (EOFError, OSError):
        pass  # the server closed its end of the pipe (it exited): nobody is left to serve
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile_path)
