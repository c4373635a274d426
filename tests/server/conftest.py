"""Real server processes for the server tests: a tiny random Llama, a free port on 127.0.0.1.

`server` is shared by the modules that need a plain server (one process for them all keeps the suite
fast), once per engine backend. Tests that need other flags and only send requests share one with `shared_server`
(strict_server is one); a test that stops or kills its server starts its own with `launch` (or several at once
with `launch_together`). Every server start costs seconds of the CI's budget: share where the test allows.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from checkpoints import write_checkpoint  # tests/checkpoints.py (tests/ is on sys.path via its conftest)

REPO = Path(__file__).resolve().parents[2]
# Sized for the tests: 64 streams of short prompts, or one long request, fit with room to spare. Async
# scheduling is forced on (it is the default only on CUDA) so the servers run the path GPU users get.
DEFAULT_FLAGS = ["--num-kv-blocks", "256", "--max-num-batched-tokens", "2048", "--seed", "0", "--async-scheduling"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("server") / "tiny-llama", "llama")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    proc: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None
    model: str = "tiny-llama"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=60, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                                  timeout=60, **kwargs)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """The /health body once nothing runs, waits or is in flight (a request still being read or tokenized is
        neither running nor waiting); or the last one seen at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["running"] == 0 and h["waiting"] == 0 and h["in_flight"] == 0) or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def spawn_server(model_dir: Path, log_dir: Path, *flags: str, api_key: str | None = None) -> RunningServer:
    """A server process started, not yet waited for: wait_until_up(server) waits."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanoserve.server.app", "--model", str(model_dir), "--port", str(port),
           *DEFAULT_FLAGS, *flags]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return RunningServer(proc, port, log_path, api_key)


def wait_until_up(server: RunningServer) -> RunningServer:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server did not come up in 120 s:\n{server.log()}")


def start_server(model_dir: Path, log_dir: Path, *flags: str, api_key: str | None = None) -> RunningServer:
    return wait_until_up(spawn_server(model_dir, log_dir, *flags, api_key=api_key))


class ServerPool:
    """The servers of a session: each stopped at its end, and those that tests only send requests to shared."""

    def __init__(self, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.model_dir, self.tmp_path_factory = model_dir, tmp_path_factory
        self.started: list[RunningServer] = []
        self.running: dict[tuple, RunningServer] = {}  # the shared ones, by (flags, api_key)

    def launch_together(self, *flag_lists: tuple[str, ...], api_key: str | None = None) -> list[RunningServer]:
        """Servers started at once, then waited for: a plain start keeps one core busy (imports, the model load)
        while the test process only polls, so on two cores a second one started alongside costs little more."""
        servers = [spawn_server(self.model_dir, self.tmp_path_factory.mktemp("logs"), *flags, api_key=api_key)
                   for flags in flag_lists]
        self.started.extend(servers)
        return [wait_until_up(s) for s in servers]

    def launch(self, *flags: str, api_key: str | None = None) -> RunningServer:
        return self.launch_together(flags, api_key=api_key)[0]

    def shared(self, *flag_lists: tuple[str, ...], api_key: str | None = None) -> list[RunningServer]:
        """The session's one server for each of flag_lists (and api_key), those not running yet started together
        and left running: for tests that only send them requests (a test that stops or kills its server launches
        its own)."""
        missing = [flags for flags in dict.fromkeys(flag_lists) if (flags, api_key) not in self.running]
        for flags, started in zip(missing, self.launch_together(*missing, api_key=api_key), strict=True):
            self.running[flags, api_key] = started
        return [self.running[flags, api_key] for flags in flag_lists]

    def stop_all(self) -> None:
        for s in self.started:
            s.stop()


@pytest.fixture(scope="session")
def server_pool(model_dir, tmp_path_factory):
    pool = ServerPool(model_dir, tmp_path_factory)
    yield pool
    pool.stop_all()


@pytest.fixture(scope="session")
def launch(server_pool):
    """launch(*flags, api_key=None) -> RunningServer; whatever is still running is stopped at the end."""
    return server_pool.launch


@pytest.fixture(scope="session")
def launch_together(server_pool):
    """launch_together(flags, ...) -> [RunningServer, ...], started at once; stopped at the end, as launch's."""
    return server_pool.launch_together


@pytest.fixture(scope="session")
def shared_server(server_pool):
    """shared_server(*flags, api_key=None) -> the session's one server with these flags and key (ServerPool.shared)."""
    return lambda *flags, api_key=None: server_pool.shared(flags, api_key=api_key)[0]


STRICT_KEY = "sk-test"


@pytest.fixture(scope="session")
def strict_server(shared_server) -> RunningServer:
    """A server with an API key (STRICT_KEY), one running sequence at most and a waiting queue of two, so that
    backpressure is easy to reach: test_errors.py's, and test_engine_view.py's for its key checks."""
    return shared_server("--max-num-seqs", "1", "--max-waiting-requests", "2", api_key=STRICT_KEY)


PLACEMENTS = {"thread": ("--no-engine-process",), "process": ("--engine-process",)}


@pytest.fixture(scope="session", params=list(PLACEMENTS))
def server(server_pool, request) -> RunningServer:
    """The shared server, run twice over: the engine on a thread of the server process, and the engine in
    a process of its own (--engine-process). Both are asked for by name: the default depends on the device.
    pytest runs every test of one before starting the other; both start at the first ask, together."""
    return server_pool.shared(*PLACEMENTS.values())[list(PLACEMENTS).index(request.param)]
