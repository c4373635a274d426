"""The EngineCore in a process of its own, behind the server (as vLLM's EngineCoreProc).

With the engine on a thread of the server process (thread_client.py), the event loop's HTTP work and
the engine's host work share one GIL, and under load each waits for the other. Here the engine core process
runs the EngineCore (scheduling, the model, appending tokens, detokenizing, stop checks); the API server
process(es) keep HTTP, tokenizing prompts and the streams (their side: process_client.py).

- EngineCoreProcess: starting the process (spawn) with one channel per API server and a control connection,
  waiting for its model, and stopping it. A load error in the child is raised in the parent.
- run_engine_core_process: the child's main, the EngineCore over a ChannelMux (channels.py).

If step() raises, the child sends why on every channel and exits; if the child dies (killed, segfault),
the pipes reach end of file. Either way every request in flight gets EngineDeadError, on every server.
"""

import contextlib
import cProfile
import logging
import multiprocessing
import os
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch

from nanoserve.config import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.runtime.channels import ChannelMux, LoadFailed, Ready
from nanoserve.runtime.engine_core import EngineCore, EngineStats, Stop

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where one replica of several runs: its index, the environment it adds (CUDA_VISIBLE_DEVICES: its GPUs),
    and its share of the CPU threads (None: torch's default)."""

    index: int
    env: dict[str, str]
    num_threads: int | None = None


@dataclass
class EngineCoreProcess:
    """The engine core process as the process that started it holds it."""

    process: BaseProcess
    control: Connection
    channels: list[Connection]  # the API servers' ends, one per API server, to hand on

    @classmethod
    def spawn(cls, args: EngineArgs, num_channels: int = 1, placement: Placement | None = None
              ) -> "EngineCoreProcess":
        """Start loading the model in a new process; wait_ready() waits for it. `placement`: where a replica of
        several runs (runtime/data_parallel.py); None: as this process would."""
        # spawn, not fork: CUDA cannot be used in a child forked after the parent touched it.
        ctx = multiprocessing.get_context("spawn")
        control, child_control = ctx.Pipe()
        pipes = [ctx.Pipe() for _ in range(num_channels)]
        # A daemonic process may start no processes of its own, and with tensor parallelism the engine starts its
        # ranks; then its end of the control pipe (EOF when we are gone) is what stops it.
        name = "engine" if placement is None else f"engine {placement.index}"
        process = ctx.Process(target=run_engine_core_process, name=f"nanoserve-{name.replace(' ', '-')}",
                              daemon=args.tensor_parallel_size == 1,
                              args=(args, [child for _, child in pipes], child_control,
                                    logging.getLogger().getEffectiveLevel(), placement))
        with _environment(placement.env if placement is not None else {}):
            process.start()
        # The child's ends now live in the child only, so its exit is end of file here.
        for conn in (child_control, *(child for _, child in pipes)):
            conn.close()
        return cls(process, control, [ours for ours, _ in pipes])

    def wait_ready(self) -> Ready:
        """Wait until the model is loaded; raises what loading raised (the process is gone then)."""
        try:
            msg = self.control.recv() if self.control in wait([self.control, self.process.sentinel]) else None
        except EOFError:
            msg = None
        if isinstance(msg, Ready):
            return msg
        self.process.join(timeout=5)
        self.kill()
        self.close()
        if msg is None:
            raise RuntimeError(f"the engine process {self.exit_status()} while loading the model (see its "
                               "log above)")
        error = (ValueError if msg.is_value_error else RuntimeError)(msg.message)
        error.add_note(f"in the engine process:\n{msg.traceback}")
        raise error

    def stop(self, timeout: float) -> None:
        """Tell the engine process to stop and wait for it; killed if it does not stop in `timeout`."""
        try:
            self.control.send(Stop())
        except OSError:
            pass  # it has exited already
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not stop in %.0f s: killing it", timeout)
            self.kill()
        self.close()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)

    def close(self) -> None:
        for conn in (self.control, *self.channels):
            conn.close()

    def exit_status(self) -> str:
        code = self.process.exitcode
        if code is not None and code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                pass
        return f"exited with code {code}"


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """os.environ with `env` added while a child starts: a spawned child's environment is copied at its start, so
    CUDA_VISIBLE_DEVICES is there before its first import (the CUDA driver reads it once, at its initialization,
    whatever touches it first), and its tensor-parallel ranks inherit it."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# -- the engine core process ------------------------------------------------------------------------
def run_engine_core_process(args: EngineArgs, channels: list[Connection], control: Connection,
                            log_level: int, placement: Placement | None = None) -> None:
    """The engine core process's main: load the engine, say so, then run the EngineCore over the channels."""
    # The server decides when the engine stops. Ctrl-C in a terminal (and systemd's SIGTERM) reach the
    # whole process group; the engine must keep running while the server drains its requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    name = "engine" if placement is None else f"engine {placement.index}"
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s ({name}): %(message)s")
    if placement is not None and placement.num_threads is not None:
        torch.set_num_threads(placement.num_threads)
    try:
        engine = LLMEngine(args.create_config())
    except Exception as exc:
        control.send(LoadFailed(isinstance(exc, ValueError), str(exc), traceback.format_exc()))
        return
    control.send(Ready(engine.config, EngineStats.of(engine, 0)))
    mux = ChannelMux(channels, control)

    # --profile-engine PATH: cProfile the engine loop and write its stats there when it ends
    # (`python -m pstats PATH`), to see where the engine process's host time goes under load.
    profile_path = args.profile_engine
    profiler = cProfile.Profile() if profile_path else None
    if profiler is not None:
        profiler.enable()
    try:
        why = EngineCore(engine, mux.receive, mux.publish).run()
        if why is not None:
            mux.fail(why)
    finally:
        mux.close()
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile_path)
