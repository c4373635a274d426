"""--api-server-count 2: two API server processes in front of one engine process, as real `nanoserve serve`
processes on 127.0.0.1. Requests land on both (every response names its server in x-nanoserve-api-server),
every one completes, /metrics on either server counts them all, a client leaving one server disturbs
nothing on the other, and every way the deployment can end (SIGTERM, the engine killed, an API server
killed, a bad start) ends without a hang or a process left behind.

The engine's side of the channels (request ids, abort-all, a channel closing) is also tested in this
process: one engine process, two ChannelEngineClients.
"""

import asyncio
import functools
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from processes import child_pids, fail_from_step, is_alive, pace_steps

from nanoserve import cli
from nanoserve.args import engine_args_from
from nanoserve.bench import serve
from nanoserve.config import EngineArgs
from nanoserve.runtime.async_engine import AsyncEngine, EngineDeadError
from nanoserve.runtime.engine_core_process import EngineCoreProcess
from nanoserve.runtime.process_client import ChannelEngineClient
from nanoserve.sampling_params import SamplingParams
from nanoserve.server import app

HEADER = "x-nanoserve-api-server"
REPO = Path(__file__).resolve().parents[2]


NAMES = ("tiny-llama", "alias")


@pytest.fixture(scope="module")
def pair(launch):
    """A deployment of two API servers, shared by the tests that leave it running; with two model names, request
    logging off and uvicorn at warning, whose effect on API server processes test_names_and_log_flags checks."""
    return launch("--api-server-count", "2", "--served-model-name", *NAMES, "--disable-log-requests",
                  "--uvicorn-log-level", "warning")


def _pids(server) -> tuple[list[int], int]:
    """(API server pids, engine pid), from the supervisor's "serving" log line."""
    match = re.search(r"API server processes \(pids ([\d, ]+)\) .* \(pid (\d+)\)", server.log())
    assert match, server.log()
    return [int(p) for p in match.group(1).split(", ")], int(match.group(2))


def _on_each_server(server, method: str, path: str, **kwargs) -> dict[str, httpx.Response]:
    """One response from each API server: fresh connections until both have answered."""
    seen: dict[str, httpx.Response] = {}
    for _ in range(64):  # each new connection goes to either server, as a hash of its address says
        with httpx.Client(base_url=server.url, timeout=30) as http:
            r = http.request(method, path, **kwargs)
        seen.setdefault(r.headers[HEADER], r)
        if len(seen) == 2:
            return seen
    raise AssertionError(f"64 connections all reached API server {list(seen)}")


def _success_total(metrics: str, reason: str) -> float:
    match = re.search(rf'^nanoserve_request_success_total{{finish_reason="{reason}"}} (\S+)$', metrics, re.M)
    return float(match.group(1)) if match else 0.0


def test_requests_spread_over_both_servers_and_metrics_count_them_all(pair):
    before = {i: _success_total(r.text, "length") for i, r in _on_each_server(pair, "GET", "/metrics").items()}

    async def one(i: int) -> tuple[str, int, int]:
        # A client of its own per request: its own connection, so the kernel picks a server for each.
        async with pair.async_client() as client:
            if i % 2:
                raw = await client.completions.with_raw_response.create(
                    model="tiny-llama", prompt=f"plain {i}", max_tokens=12, extra_body={"ignore_eos": True})
                out = raw.parse()
                return raw.headers[HEADER], out.usage.completion_tokens, len(out.choices)
            async with client.chat.completions.with_streaming_response.create(
                    model="tiny-llama", messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=12,
                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) as raw:
                usage, reasons = None, []
                async for chunk in await raw.parse():
                    usage = chunk.usage.completion_tokens if chunk.usage else usage
                    reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
                return raw.headers[HEADER], usage, len(reasons)

    async def main():
        return await asyncio.gather(*(one(i) for i in range(40)))

    results = asyncio.run(main())
    assert [(tokens, choices) for _, tokens, choices in results] == [(12, 1)] * 40
    servers = [s for s, _, _ in results]
    assert set(servers) == {"0", "1"}, servers
    # Counters live in files of every API server process: a scrape of either one counts all 40.
    for index, r in _on_each_server(pair, "GET", "/metrics").items():
        assert _success_total(r.text, "length") - before[index] == 40, r.text
        assert re.search(r"^nanoserve_e2e_request_latency_seconds_count \d+", r.text, re.M)
    pair.wait_idle()


def test_health_models_and_engine_view_on_every_server(pair):
    for r in _on_each_server(pair, "GET", "/health").values():
        assert r.status_code == 200 and r.json()["status"] == "ok"
    for r in _on_each_server(pair, "GET", "/v1/models").values():
        assert r.json()["data"][0]["id"] == "tiny-llama"
    # The engine view (tests/server/test_engine_view.py) is served by every API server, each naming itself.
    for index, r in _on_each_server(pair, "GET", "/v1/engine/stats").items():
        body = r.json()
        assert body["kv_grid"] is not None and body["config"]["api_server"] == int(index)
        assert body["config"]["engine_process"] is True


def _open_stream(server, max_tokens: int, on: str | None = None, avoid: str | None = None):
    """A streamed completion on a fresh connection, reopened until it lands on server `on` (or off
    `avoid`); returns (client, response, lines) with the response open, its first chunk read and checked,
    and lines starting again from that chunk."""
    body = {"prompt": "to and fro", "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "logprobs": 0}
    for _ in range(64):
        http = httpx.Client(base_url=server.url, timeout=60)
        r = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
        index = r.headers[HEADER]
        if (on is None or index == on) and index != avoid:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            return http, r, itertools.chain([first], lines)
        r.close()
        http.close()
    raise AssertionError("64 connections never reached the server asked for")


def test_client_leaving_one_server_does_not_disturb_the_other(pair):
    http_a, stream_a, lines_a = _open_stream(pair, max_tokens=480)
    a = stream_a.headers[HEADER]
    http_b, stream_b, lines_b = _open_stream(pair, max_tokens=200, avoid=a)
    for _ in range(3):
        next(lines_a)
    stream_a.close()  # the client on server `a` leaves mid-stream
    http_a.close()
    tokens, reasons, done = 0, [], False
    for event in _events(lines_b):
        if event == "[DONE]":
            done = True
        else:
            choice = event["choices"][0]
            tokens += len(choice["logprobs"]["tokens"])
            reasons += [choice["finish_reason"]] if choice["finish_reason"] else []
    stream_b.close()
    http_b.close()
    # Tokens, not chunks: a chunk carries every token of an engine output, and when the event loop lags behind
    # the engine, an output holds several.
    assert (tokens, reasons, done) == (200, ["length"], True)
    health = pair.wait_idle()
    assert health["kv_blocks_free"] == health["kv_blocks_total"], health
    aborted = [_success_total(r.text, "abort") for r in _on_each_server(pair, "GET", "/metrics").values()]
    assert aborted[0] == aborted[1] >= 1


def _events(lines) -> list:
    """The rest of an SSE stream: its JSON events, then "[DONE]"."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def _finished(events: list) -> bool:
    return events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if is_alive(pid)], "a process of the deployment outlived it"


def test_names_and_log_flags_reach_every_server(pair):
    client = pair.client()
    assert [m.id for m in client.models.list().data] == list(NAMES)
    reply = client.completions.create(model="alias", prompt="Hi", max_tokens=2)
    assert reply.model == "alias"
    # uvicorn's head limit holds in API server processes too: an 80 KB header is refused with 431.
    with socket.create_connection(("127.0.0.1", pair.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (80 * 1024) + b"\r\n\r\n")
        reply_bytes = b""
        while chunk := sock.recv(65536):
            reply_bytes += chunk
    assert reply_bytes.startswith(b"HTTP/1.1 431 "), reply_bytes[:200]
    # Counted in the API server's metric files, summed by whichever server is scraped.
    metrics = httpx.get(pair.url + "/metrics", timeout=10).text
    match = re.search(r'^vllm:request_success_total{[^}]*finished_reason="length"[^}]*} (\S+)$', metrics, re.M)
    assert match and float(match.group(1)) >= 1, metrics
    log = pair.log()
    assert f"on http://127.0.0.1:{pair.port}" in log
    assert reply.id not in log  # --disable-log-requests
    assert "Uvicorn running" not in log and "Application startup complete" not in log  # uvicorn at warning


def test_sigterm_drains_and_leaves_no_process(pair):
    # Last of the tests on `pair`: it stops it.
    servers, engine = _pids(pair)
    children = child_pids(pair.proc.pid)
    assert set(servers) | {engine} <= set(children)
    http, stream, lines = _open_stream(pair, max_tokens=150)
    pair.proc.send_signal(signal.SIGTERM)
    rest = _events(lines)
    stream.close()
    http.close()
    assert _finished(rest), rest[-2:]  # drained, not cut
    assert pair.proc.wait(timeout=60) == 0
    _assert_gone(children)


def test_killed_engine_reaches_requests_on_both_servers(launch):
    server = launch("--api-server-count", "2")
    children = child_pids(server.proc.pid)
    _, engine = _pids(server)
    opened = [_open_stream(server, max_tokens=480, on=index) for index in ("0", "1")]
    os.kill(engine, signal.SIGKILL)
    for http, stream, lines in opened:
        events = _events(lines)
        stream.close()
        http.close()
        assert events[-1] == "[DONE]" and "engine process exited" in events[-2]["error"]["message"], events[-2:]
    for r in _on_each_server(server, "GET", "/health").values():
        assert r.status_code == 503 and r.json()["status"] == "dead"
    with pytest.raises(openai.APIStatusError, match="engine process exited") as err:
        server.client().completions.create(model="tiny-llama", prompt="after", max_tokens=2)
    assert err.value.status_code == 503
    assert server.stop() == 0  # the API servers were stopped in order; the engine's death is their news
    _assert_gone(children)


def test_killed_api_server_stops_the_deployment(launch):
    server = launch("--api-server-count", "2")
    children = child_pids(server.proc.pid)
    servers, _ = _pids(server)
    http, stream, lines = _open_stream(server, max_tokens=150, on="1")
    os.kill(servers[0], signal.SIGKILL)
    # The other server drains (this stream finishes) and the supervisor exits non-zero.
    rest = _events(lines)
    stream.close()
    http.close()
    assert _finished(rest), rest[-2:]
    assert server.proc.wait(timeout=60) == 1
    assert "API server 0 exited with code -9: stopping the others" in server.log()
    _assert_gone(children)


def test_killed_supervisor_leaves_no_process(launch):
    server = launch("--api-server-count", "2")
    children = child_pids(server.proc.pid)
    http, stream, lines = _open_stream(server, max_tokens=150)
    server.proc.kill()
    # The API servers see their control pipes close: they drain (this stream finishes), then exit, and the
    # engine exits when their channels have closed.
    rest = _events(lines)
    stream.close()
    http.close()
    assert _finished(rest), rest[-2:]
    _assert_gone(children)


def _serve_cli(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "nanoserve.cli", "serve", "--port", "0", *flags], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


def test_bad_count_is_refused_naming_the_flag(capsys):
    # `nanoserve serve`'s own parsing, in this process: a subprocess spent its seconds importing.
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--port", "0", "--api-server-count", "0"])
    assert exit_.value.code == 2
    assert "argument --api-server-count: must be at least 1, got 0" in capsys.readouterr().err


def test_startup_errors_exit_non_zero_with_the_message(model_dir, tmp_path):
    result = _serve_cli("--api-server-count", "2", "--model", str(tmp_path / "missing"))
    assert result.returncode == 2 and "is not a directory" in result.stderr
    # Found only once the engine process has read the checkpoint: the context does not fit the KV pool.
    result = _serve_cli("--api-server-count", "2", "--model", str(model_dir), "--num-kv-blocks", "1",
                        "--max-model-len", "512")
    assert result.returncode == 2 and "does not fit the KV pool" in result.stderr, result.stderr


def test_the_flag_reaches_the_server_from_the_command_lines():
    assert app.parse_args(["--api-server-count", "3"]).api_server_count == 3
    assert app.parse_args([]).api_server_count == 1
    _, server_flags = serve.parse_args(["--launch", "--api-server-count", "2", "--num-prompts", "5"])
    assert server_flags == ["--api-server-count", "2"]
    assert engine_args_from(app.parse_args(["--api-server-count", "2"])).engine_process is None  # implied, not set


# -- the engine's side of two channels, in this process ------------------------------------------------------
@pytest.fixture
def two_clients(model_dir):
    engine = EngineCoreProcess.spawn(EngineArgs(model=str(model_dir), num_kv_blocks=64, seed=0), num_channels=2)
    ready = engine.wait_ready()
    clients = [AsyncEngine(ChannelEngineClient(conn, ready, tokenizer=None)) for conn in engine.channels]
    yield engine, clients
    for client in clients:
        client.shutdown()
    engine.stop(timeout=10)


async def _run(client: AsyncEngine, request_id: str, max_tokens: int,
               streaming: asyncio.Event | None = None) -> tuple[int, str]:
    """Tokens and finish reason of a request; `streaming` is set once its first output has arrived."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    async for _, out in client.submit([(request_id, [5, 6, 7], params)]):
        if streaming is not None:
            streaming.set()
        last = out
    return len(last.outputs[0].token_ids), last.outputs[0].finish_reason


def test_channels_keep_their_own_requests(two_clients):
    engine, (a, b) = two_clients

    async def main():
        # The same request id on both channels: two requests, each answered on its own channel.
        same = await asyncio.gather(_run(a, "r", 5), _run(b, "r", 9))
        # abort_all (a drain that ran out of time) ends only the requests of the channel that sent it. Paced
        # steps and an abort once both stream: unpaced, x once decoded all 400 tokens before the abort landed.
        a.setup(functools.partial(pace_steps, seconds=0.005))
        streaming = asyncio.Event(), asyncio.Event()
        long_a = asyncio.create_task(_run(a, "x", 400, streaming[0]))
        long_b = asyncio.create_task(_run(b, "y", 100, streaming[1]))
        async with asyncio.timeout(30):
            await asyncio.gather(*(e.wait() for e in streaming))
        a.abort_all()
        return same, await long_a, await long_b

    same, long_a, long_b = asyncio.run(main())
    assert same == [(5, "length"), (9, "length")]
    assert long_a[1] == "abort" and long_a[0] < 400
    assert long_b == (100, "length")
    assert (a.stats.num_added, b.stats.num_added) == (2, 2)  # each counts its own adds
    assert a.num_waiting == b.num_waiting == 0

    # One channel closing leaves the engine serving the other; the last one closing stops it.
    a.shutdown()
    assert asyncio.run(_run(b, "z", 3)) == (3, "length")
    b.shutdown()
    engine.process.join(timeout=10)
    assert engine.process.exitcode == 0


def test_step_failure_reaches_both_channels(two_clients):
    engine, (a, b) = two_clients
    a.setup(functools.partial(fail_from_step, n=5))

    async def main():
        return await asyncio.gather(_run(a, "x", 100), _run(b, "y", 100), return_exceptions=True)

    for result in asyncio.run(main()):
        assert isinstance(result, EngineDeadError) and "boom" in str(result), result
    assert a.dead and b.dead
    engine.process.join(timeout=10)
    assert engine.process.exitcode == 0


def _reader_bug(msg) -> None:
    raise TypeError("a bug in the reader")


def test_a_broken_reader_does_not_stall_the_other_channel(two_clients):
    # Channel a's reader dies on the first message (as on one that does not unpickle). The engine sends every
    # channel each step's stats: had a's channel stayed open and unread, it would fill and block the engine, and
    # b's requests would stop mid-generation (left open, that took under 200 tokens).
    engine, (a, b) = two_clients
    a.client._on_step = _reader_bug

    async def main():
        results = []
        # 2 x 250 tokens: past the ~200 at which the unread channel blocked the engine (5 x 300 before: CI time).
        for i in range(2):
            async with asyncio.timeout(60):
                results.append(await _run(b, f"r{i}", 250))
        return results

    assert asyncio.run(main()) == [(250, "length")] * 2
    assert a.dead and "a bug in the reader" in a.error and not b.dead
