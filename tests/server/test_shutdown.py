"""SIGTERM during load: new requests get 503, in-flight streams finish, the engine view's event stream ends
(tests/server/test_engine_view.py has the view), and the process exits 0."""

import json
import signal
import threading
import time

import httpx
import pytest
from processes import child_pids, is_alive


def _stream(server, max_tokens: int, results: list, started: threading.Event, out_index: int) -> None:
    body = {"prompt": f"stream {out_index}", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "logprobs": 0}
    tokens, reasons, done = 0, [], False
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += len(choice["logprobs"]["tokens"])
            reasons.append(choice["finish_reason"])
            started.set()
    results[out_index] = (tokens, [r for r in reasons if r], done)


def _load(server, n: int, max_tokens: int) -> tuple[list, list[threading.Thread]]:
    results: list = [None] * n
    events = [threading.Event() for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(server, max_tokens, results, events[i], i))
               for i in range(n)]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(60), "a stream never started"
    return results, threads


def _view_events(server, out: list) -> None:
    """The engine view's events (GET /v1/engine/events), appended to `out` until the stream ends."""
    with httpx.stream("GET", server.url + "/v1/engine/events", timeout=60) as r:
        out.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))


def test_sigterm_drains_in_flight_streams_and_exits_0(launch):
    server = launch("--drain-timeout", "60")
    results, threads = _load(server, n=6, max_tokens=300)
    events: list[dict] = []
    viewer = threading.Thread(target=_view_events, args=(server, events))
    viewer.start()
    while not events:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    assert httpx.get(server.url + "/health").status_code == 503
    # A draining server ends the event stream (it would hold the server open), its last event saying so.
    viewer.join(timeout=60)
    assert not viewer.is_alive() and events[-1]["status"] == "draining", events[-1:]
    for t in threads:
        t.join(60)
    assert results == [(300, ["length"], True)] * 6
    assert server.proc.wait(timeout=30) == 0
    # Objects frozen out of the collector's reach while serving are given back for the one at exit: frozen,
    # triton's were still alive then, and nanobind printed ~30 lines of leaks.
    assert "nanobind" not in server.log()


def test_second_sigterm_aborts_at_once_and_exits_0(launch):
    server = launch("--drain-timeout", "600")
    results, threads = _load(server, n=2, max_tokens=480)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    server.proc.send_signal(signal.SIGTERM)  # skips the 600 s wait: the aborts go out now
    for t in threads:
        t.join(60)
    assert all(reasons == ["abort"] and done and tokens < 480 for tokens, reasons, done in results), results
    assert server.proc.wait(timeout=30) == 0


@pytest.mark.parametrize("engine_flags", [["--no-engine-process"], ["--engine-process"]], ids=["thread", "process"])
def test_drain_timeout_aborts_what_is_left_and_exits_0(launch, engine_flags):
    # 0.2 s: at 0.5 s the streams had reached 285-381 of their 480 tokens, too little room should decoding speed up.
    server = launch("--drain-timeout", "0.2", *engine_flags)
    children = child_pids(server.proc.pid)  # the engine process, with --engine-process
    results, threads = _load(server, n=2, max_tokens=480)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    # Cut short by the drain timeout: finished with "abort", and the stream still ended properly.
    assert all(reasons == ["abort"] and done and tokens < 480 for tokens, reasons, done in results), results
    assert server.proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while any(is_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(pid) for pid in children), "a process of the server outlived it"


