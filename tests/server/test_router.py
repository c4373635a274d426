"""`nanoserve router` over two real `nanoserve serve` processes on 127.0.0.1, with the official openai client.

Every request is answered once and streams arrive intact (the same chunks as from the backend itself), requests
sharing a long prefix land on one backend (its prefix-cache hits are what one server's would be), the API key is
checked at the router, a client that leaves has its request aborted on the backend, backends are removed and added
while the router runs, and a backend killed in the middle of a stream ends that stream with an error event while
its traffic moves to the other (a request sent to it before the router knows is retried there).
"""

import asyncio
import http.server
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from conftest import REPO, RunningServer, free_port
from prometheus_client.parser import text_string_to_metric_families

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHARED = "You are a careful assistant. Answer briefly and cite the manual where you can. " * 3  # ~200 tokens


@pytest.fixture(scope="module")
def backends(launch_together) -> list[RunningServer]:
    return launch_together([], [])


@pytest.fixture(scope="module")
def router(backends, tmp_path_factory):
    port = free_port()
    # Health checks far apart: a killed backend is found by the request that fails on it, not by a check.
    cmd = [
        sys.executable,
        "-m",
        "nanoserve.router.app",
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--health-check-interval",
        "60",
        *[arg for b in backends for arg in ("--backend", b.url)],
    ]
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT
        )
    server = RunningServer(proc, port, log_path, KEY)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, server.log()
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def _metric(server: RunningServer, name: str, **labels) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def _complete(client: openai.OpenAI, prompt: str, **kwargs):
    raw = client.completions.with_raw_response.create(model="tiny-llama", prompt=prompt, temperature=0, **kwargs)
    return raw.headers["x-nanoserve-backend"], raw.parse()


def test_every_request_answered_once_and_streams_intact(router, backends):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        prompt = f"{i} " * (2 + i) + "go"
        stream = await client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [c async for c in stream]
        assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
        return prompt, "".join(c.choices[0].text for c in chunks)

    async def main() -> list[tuple[str, str]]:
        async with router.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(10)))

    before = [_metric(b, "nanoserve_request_success_total") for b in backends]
    streamed = asyncio.run(main())
    after = [_metric(b, "nanoserve_request_success_total") for b in backends]
    assert sum(after) - sum(before) == 10  # each request ran once, on one backend
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)  # both took some
    # Streamed through the router: what the backend itself gives, unbuffered text and all.
    direct = backends[0].client()
    for prompt, text in streamed[:3]:
        out = direct.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == text


def test_api_key_is_checked_at_the_router(router):
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(router.url + "/router/backends").status_code == 401
    assert httpx.get(router.url + "/health").status_code == 200  # open to probes, as serve's


def test_shared_prefix_lands_on_one_backend(router, backends):
    client = router.client()
    hits = [_metric(b, "nanoserve_prefix_cache_hits_total") for b in backends]
    where = [_complete(client, SHARED + f"Question {i}?", max_tokens=2)[0] for i in range(5)]
    assert len(set(where)) == 1, where
    gained = [_metric(b, "nanoserve_prefix_cache_hits_total") - h for b, h in zip(backends, hits, strict=True)]
    # What one server alone finds: every later request finds the shared prefix's full blocks.
    shared_blocks = len(httpx.post(backends[0].url + "/tokenize", json={"prompt": SHARED}).json()["tokens"]) // 16
    assert max(gained) >= 4 * shared_blocks * 16 and min(gained) == 0, gained


def test_client_disconnect_aborts_on_the_backend(router, backends):
    aborted = [_metric(b, "nanoserve_request_success_total", finish_reason="abort") for b in backends]
    with httpx.stream(
        "POST",
        router.url + "/v1/completions",
        headers=AUTH,
        timeout=30,
        json={"model": "tiny-llama", "prompt": "leave early", "max_tokens": 400, "stream": True, "ignore_eos": True},
    ) as r:
        next(r.iter_lines())
    for backend in backends:
        assert backend.wait_idle()["running"] == 0
    now = [_metric(b, "nanoserve_request_success_total", finish_reason="abort") for b in backends]
    assert sum(now) - sum(aborted) == 1


def test_backends_removed_and_added_while_running(router, backends):
    gone = backends[1].url
    r = httpx.request("DELETE", router.url + "/router/backends", params={"url": gone}, headers=AUTH)
    assert r.status_code == 200 and r.json()["url"] == gone
    client = router.client()
    assert {_complete(client, f"only one {i}", max_tokens=1)[0] for i in range(4)} == {backends[0].url}
    assert (
        httpx.request("DELETE", router.url + "/router/backends", params={"url": gone}, headers=AUTH).status_code == 404
    )
    bad = httpx.post(router.url + "/router/backends", json={"url": "ftp://x"}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
    added = httpx.post(router.url + "/router/backends", json={"url": gone + "/"}, headers=AUTH).json()
    assert added == {"url": gone, "healthy": True, "in_flight": 0, "error": None}
    assert {_complete(client, f"both {i}", max_tokens=1)[0] for i in range(4)} == {b.url for b in backends}


class _HangsUp(http.server.BaseHTTPRequestHandler):
    """A backend that looks healthy and drops every request before answering it."""

    def do_GET(self) -> None:
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.close_connection = True

    def log_message(self, *args) -> None:
        pass


def test_backend_failing_before_answering_is_retried_on_another(router, backends):
    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HangsUp)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{fake.server_address[1]}"
    try:
        assert httpx.post(router.url + "/router/backends", json={"url": url}, headers=AUTH).json()["healthy"]
        # Equal loads take turns: one of these goes to the fake first, and is answered by a real backend.
        client = router.client()
        answered = [_complete(client, f"retry {i}", max_tokens=1)[0] for i in range(3)]
        assert set(answered) <= {b.url for b in backends}
        health = httpx.get(router.url + "/health").json()
        assert [b["healthy"] for b in health["backends"] if b["url"] == url] == [False]
        assert f"backend {url} failed before answering" in router.log()
    finally:
        httpx.request("DELETE", router.url + "/router/backends", params={"url": url}, headers=AUTH)
        fake.shutdown()


def test_killed_backend_ends_its_stream_with_an_error_and_traffic_moves(router, backends):
    client = router.client()
    with client.completions.with_streaming_response.create(
        model="tiny-llama", prompt="a long one", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    ) as response:
        victim = next(b for b in backends if b.url == response.headers["x-nanoserve-backend"])
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        victim.proc.send_signal(signal.SIGKILL)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"code": "backend_failed"' in rest[-2], rest[-3:]
    survivor = next(b for b in backends if b is not victim)
    assert {_complete(client, f"after {i}", max_tokens=1)[0] for i in range(4)} == {survivor.url}
    health = httpx.get(router.url + "/health").json()
    assert [b["healthy"] for b in health["backends"] if b["url"] == victim.url] == [False]
