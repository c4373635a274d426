"""`bench serve --launch`: start `nanoserve serve` on the address the benchmark then loads, and wait until it answers.

The server's log goes on to this process's stderr (stdout stays for the JSON line), and its last lines are kept: a
server that exits, or never answers, ends the benchmark at once with them, rather than after the launch timeout.
"""

import collections
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

# After the server logs that it serves (its model loaded), binding the port takes uvicorn a moment: a server
# that does not answer /health well after that never will (a wrong address, a hung start-up).
ANSWER_GRACE_S = 60.0
TAIL_LINES = 20


class LaunchError(Exception):
    """The launched server exited or never answered; `status` is the benchmark's exit status (the server's 2, a
    usage or config error, passes through)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ServerLog:
    """Forwards a process's output line by line to stderr, keeping the last ones and noting when it says it serves."""

    lines: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    serving_since: float | None = None

    def follow(self, stream) -> threading.Thread:
        thread = threading.Thread(target=self._pump, args=(stream,), name="server-log", daemon=True)
        thread.start()
        return thread

    def _pump(self, stream) -> None:
        for line in stream:
            sys.stderr.write(line)
            sys.stderr.flush()
            self.lines.append(line.rstrip("\n"))
            if self.serving_since is None and " serving " in line:  # server/app.py's and api_servers.py's line
                self.serving_since = time.monotonic()

    def tail(self) -> str:
        return "\n".join("    " + line for line in self.lines) or "    (nothing)"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def client_host(host: str) -> str:
    """The address to reach a server listening on `host` from this machine."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


@dataclass
class LaunchedServer:
    proc: subprocess.Popen
    url: str
    log: ServerLog
    reader: threading.Thread

    def stop(self) -> None:
        """SIGTERM (the server drains), then its log's last lines are through before the summary is printed."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=10)


def launch(host: str, port: int | None, server_args: list[str], timeout: float) -> LaunchedServer:
    """`nanoserve serve --host host --port port SERVER_ARGS` (a free port if None), once /health answers 200.
    LaunchError, with the server's last lines, if it exits first, does not answer within ANSWER_GRACE_S of
    saying it serves, or is not ready after `timeout` seconds."""
    if port is None:
        port = free_port(host)
    elif port_in_use(host, port):
        # Another server there would answer /health, and be benchmarked in this one's place.
        raise ValueError(f"--port: {port} is in use on {host}")
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--host", host, "--port", str(port), *server_args]
    print("launching:", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    log = ServerLog()
    server = LaunchedServer(proc, f"http://{client_host(host)}:{port}", log, log.follow(proc.stdout))
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            server.reader.join(timeout=10)
            raise LaunchError(f"the launched server exited with status {proc.returncode} before it answered; its "
                              f"last lines:\n{log.tail()}", 2 if proc.returncode == 2 else 1)
        if _healthy(server.url):
            return server
        now = time.monotonic()
        silent = log.serving_since is not None and now - log.serving_since > ANSWER_GRACE_S
        if silent or now > deadline:
            server.stop()
            why = (f"says it serves but {server.url}/health did not answer in {ANSWER_GRACE_S:.0f} s" if silent
                   else f"was not ready after {timeout:.0f} s (--launch-timeout)")
            raise LaunchError(f"the launched server {why}; its last lines:\n{log.tail()}")
        time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:  # refused while it starts, and urllib's HTTPError (a 503 while loading) alike
        return False
