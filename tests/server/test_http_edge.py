"""The HTTP edge: what a request must pass before (and besides) the engine. Lone surrogates, the waiting
queue counted in prompts, request head limits (size, slowloris), error types, stream_options, the developer
role, logit_bias, /docs behind the key, vLLM's metric names, several served model names, and the request log.

`edge` is one server with an API key, one running sequence, a queue of four and two model names (two API server
processes with the names, request logging off and uvicorn at warning: tests/server/test_api_servers.py, on the
deployment it starts anyway). The head limits are also tested with short limits on a bare uvicorn server in this
process, which serves a stub app.
"""

import asyncio
import contextlib
import json
import re
import select
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.runtime.async_engine import TokenizerPools
from nanoserve.server.http_limits import limited_http_protocol

KEY = "sk-edge"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAMES = ("tiny-llama", "alias")


@pytest.fixture(scope="module")
def edge(launch):
    s = launch("--max-num-seqs", "1", "--max-waiting-requests", "4", "--served-model-name", *NAMES, api_key=KEY)
    yield s
    s.stop()


def _post(server, path: str, body: dict | bytes, headers=AUTH) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800 (httpx's own encoding would fail on it in the client).
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={**headers, "content-type": "application/json"},
                      timeout=60)


def _error(r: httpx.Response, status: int, param: str | None = None, error_type: str = "invalid_request_error"):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == error_type, err
    assert err["param"] == param, err
    if param is not None:
        assert param in err["message"], err
    return err


# -- 1. lone surrogates -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi \ud800 there"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "\udc00"]}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["ok", "\ud800"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]}, "messages.1.content"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x\ud800"}]}, "messages.0.content"),
])
def test_lone_surrogate_is_400_naming_the_field(edge, path, body, param):
    err = _error(_post(edge, path, {**body, "max_tokens": 2}), 400, param)
    assert "surrogate" in err["message"]


def test_valid_non_ascii_text_still_works(edge):
    r = _post(edge, "/v1/completions", {"prompt": "café 😀 日本", "max_tokens": 2})
    assert r.status_code == 200, r.text


# -- 2. the waiting queue counts prompts; tokenizing a large prompt does not stall small ones ----------------
def test_more_prompts_than_the_queue_holds_is_400(edge):
    err = _error(_post(edge, "/v1/completions", {"prompt": ["a"] * 5, "max_tokens": 1}), 400, "prompt")
    assert "5" in err["message"] and "4" in err["message"]


def test_prompts_that_would_overfill_the_queue_are_429(edge):
    edge.wait_idle()

    async def main():
        async with httpx.AsyncClient(base_url=edge.url, headers=AUTH, timeout=60) as http:
            long = {"max_tokens": 480, "ignore_eos": True, "stream": True}
            opened = []

            async def stream(prompts: list[str]) -> httpx.Response:
                body = {**long, "prompt": prompts}
                opened.append(await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True))
                assert opened[-1].status_code == 200
                return opened[-1]

            try:
                await stream(["a", "b", "c", "d"])  # four prompts: one runs (max_num_seqs=1), three wait
                async with asyncio.timeout(60):
                    while (h := (await http.get("/health")).json())["running"] == 0 or h["waiting"] < 3:
                        await asyncio.sleep(0.01)
                # 3 waiting + 2 > 4. Counted in requests, as before, this was 1 + 3 < 4 and went through.
                r = await http.post("/v1/completions", json={"prompt": ["e", "f"], "max_tokens": 1})
                err = _error(r, 429, error_type="rate_limit_error")
                assert err["code"] == "too_many_waiting_requests"
                await stream(["g"])  # 3 + 1 fits
            finally:
                for response in opened:
                    await response.aclose()

    asyncio.run(main())
    assert edge.wait_idle()["waiting"] == 0


def test_small_tokenize_does_not_queue_behind_a_large_one():
    pools = TokenizerPools()
    release = threading.Event()

    async def main():
        large = asyncio.ensure_future(pools.run(TokenizerPools.LARGE_INPUT, release.wait))
        await asyncio.sleep(0)  # the large job is on its pool's only thread now, waiting for `release`
        try:
            # With one pool for both it would wait for `release` for ever (the wait_for bound only stops a hang).
            assert await asyncio.wait_for(pools.run(10, lambda: "small"), timeout=60) == "small"
            assert not large.done()
        finally:
            release.set()
        assert await large is True

    try:
        asyncio.run(main())
    finally:
        pools.shutdown()


# -- 3. request head limits ----------------------------------------------------------------------------------
async def _stub_app(scope, receive, send) -> None:
    """200 "ok"; /slow answers after a second, longer than the header timeout the tests set."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.contextmanager
def _limited_server(max_header_bytes: int, header_timeout: float):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_stub_app, lifespan="off", log_level="warning",
                            http=limited_http_protocol(max_header_bytes, header_timeout))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(600):
            if server.started:
                break
            time.sleep(0.05)
        assert server.started
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _exchange(port: int, data: bytes) -> bytes:
    """Send `data`, then read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        return _read_to_close(sock)


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; a reset fails the test (a refusal must close gracefully)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def _trickle(port: int, head: bytes, max_bytes: int) -> tuple[bytes, bool]:
    """Send `head`, then one more header byte at a time; returns what came back and whether the server
    closed the connection before max_bytes were trickled."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        for _ in range(max_bytes):
            if select.select([sock], [], [], 0.05)[0]:
                return _read_to_close(sock), True
            try:
                sock.send(b"a")
            except OSError:
                return _read_to_close(sock), True
        return b"", False


def _status(reply: bytes) -> int:
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", reply)
    return int(match.group(1)) if match else 0


def test_a_client_that_trickles_its_headers_is_cut_off():
    with _limited_server(max_header_bytes=1 << 20, header_timeout=0.5) as port:
        # 600 bytes at one per 50 ms would take 30 s: far past the 0.5 s the head may take.
        reply, closed = _trickle(port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ", max_bytes=600)
        assert closed and _status(reply) == 408
        body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["type"] == "invalid_request_error" and "0.5 s" in body["error"]["message"]


def test_an_idle_connection_is_closed_after_the_header_timeout():
    with _limited_server(max_header_bytes=1 << 20, header_timeout=0.5) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            assert _status(_read_to_close(sock)) == 408


def test_a_head_over_the_size_limit_is_431():
    with _limited_server(max_header_bytes=1024, header_timeout=30) as port:
        complete = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1500 + b"\r\n\r\n"
        reply = _exchange(port, complete)
        assert _status(reply) == 431 and b"1024 bytes" in reply
        # Never complete: refused as soon as more than the limit has arrived, not left to grow.
        endless, closed = _trickle(port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1000, max_bytes=600)
        assert closed and _status(endless) == 431


def test_requests_within_the_limits_are_served():
    with _limited_server(max_header_bytes=1024, header_timeout=0.5) as port:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            # Two requests on one kept-alive connection, the first answered after the header timeout: the timer
            # stops when a head is complete and starts again for the next one.
            assert http.get("/slow", headers={"X-Fine": "a" * 500}).text == "ok"
            assert http.post("/", content=b"x" * 4096).text == "ok"


def _json_error(reply: bytes, status: int) -> dict:
    head, body = reply.split(b"\r\n\r\n", 1)
    assert _status(reply) == status and b"content-type: application/json" in head.lower(), reply[:300]
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == str(status), err
    return err


def test_the_server_refuses_a_huge_head_by_default(edge):
    # 1 MB: the server reads a part, answers, and must drain the rest before closing, or the kernel resets the
    # connection (data unread) and the client may never see the 431 (_read_to_close fails on a reset).
    reply = _exchange(edge.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
    assert "65536 bytes" in _json_error(reply, 431)["message"]
    assert _status(_exchange(edge.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) == 200


@pytest.mark.parametrize("request_bytes, says", [
    (b"GARBAGE\r\n\r\n", "Invalid method"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n", "Invalid header token")])
def test_a_request_that_is_not_http_is_a_json_400(edge, request_bytes, says):
    err = _json_error(_exchange(edge.port, request_bytes), 400)
    assert "not valid HTTP" in err["message"] and says in err["message"], err


# -- 4. error types ------------------------------------------------------------------------------------------
def test_wrong_method_is_405_invalid_request_error(edge):
    r = httpx.get(edge.url + "/v1/completions", headers=AUTH)
    err = _error(r, 405)
    assert "GET" in err["message"] and r.headers["allow"] == "POST"
    _error(httpx.get(edge.url + "/v1/nothing", headers=AUTH), 404, error_type="not_found_error")


def test_json_decode_error_has_no_param(edge):
    err = _error(_post(edge, "/v1/completions", b'{"prompt": '), 400, None)
    assert "not valid JSON" in err["message"]


# -- 5. stream_options needs stream ----------------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_stream_options_without_stream_is_400(edge, path, body):
    opts = {"stream_options": {"include_usage": True}, "max_tokens": 1}
    _error(_post(edge, path, {**body, **opts}), 400, "stream_options")
    _error(_post(edge, path, {**body, **opts, "stream": False}), 400, "stream_options")
    assert _post(edge, path, {**body, "max_tokens": 1, "stream_options": None}).status_code == 200


# -- 6. the developer role -----------------------------------------------------------------------------------
def test_developer_role_is_system(edge):
    def tokens(role: str) -> list[int]:
        r = _post(edge, "/tokenize", {"messages": [{"role": role, "content": "Be brief."},
                                                   {"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert tokens("developer") == tokens("system") != tokens("user")
    reply = edge.client().chat.completions.create(
        model="tiny-llama", max_tokens=2, messages=[{"role": "developer", "content": "Be brief."},
                                                    {"role": "user", "content": "Hi"}])
    assert reply.usage.prompt_tokens == len(tokens("system"))


# -- 7. logit_bias -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [{"abc": 1}, {"-3": 1}, {"384": 1}, {"5": 101}])
def test_bad_logit_bias_is_400(edge, bias):
    _error(_post(edge, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logit_bias": bias}), 400, "logit_bias")


def test_logit_bias_steers_sampling(edge):
    forced = _post(edge, "/tokenize", {"prompt": "quick"}).json()["tokens"][0]  # a whole character or more
    reply = edge.client().completions.create(model="tiny-llama", prompt="Hello", max_tokens=4, temperature=0,
                                             logit_bias={str(forced): 100})
    want = _post(edge, "/detokenize", {"tokens": [forced] * 4}).json()["prompt"]
    assert reply.choices[0].text == want


# -- 8. /docs and /openapi.json ------------------------------------------------------------------------------
def test_docs_are_served_behind_the_api_key(edge):
    for path in ("/docs", "/openapi.json"):
        _error(httpx.get(edge.url + path), 401, error_type="authentication_error")
        assert httpx.get(edge.url + path, headers=AUTH).status_code == 200
    spec = httpx.get(edge.url + "/openapi.json", headers=AUTH).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
    assert "swagger-ui" in httpx.get(edge.url + "/docs", headers=AUTH).text
    for open_path in ("/health", "/metrics"):
        assert httpx.get(edge.url + open_path).status_code == 200


# -- 9. vLLM's metric names ----------------------------------------------------------------------------------
def _samples(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples, name: str, **labels) -> float:
    found = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_vllm_metrics_after_a_request(edge):
    edge.wait_idle()
    before = _samples(edge)
    reply = edge.client().completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=5,
                                             extra_body={"ignore_eos": True})
    after = _samples(edge)

    def delta(name: str, **labels) -> float:
        return _value(after, name, model_name="tiny-llama", **labels) - _value(before, name, model_name="tiny-llama",
                                                                               **labels)

    usage = reply.usage
    assert delta("vllm:request_prompt_tokens_sum") == usage.prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == usage.completion_tokens == 5
    assert delta("vllm:request_params_max_tokens_sum") == 5
    assert delta("vllm:request_params_n_sum") == 1 and delta("vllm:request_params_n_count") == 1
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:prompt_tokens_total") == usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 5
    # Every token the request added was counted in some engine step.
    assert delta("vllm:iteration_tokens_total_sum") == usage.prompt_tokens + 5
    assert delta("vllm:iteration_tokens_total_count") >= 1
    phases = {name: delta(f"vllm:request_{name}_time_seconds_sum") for name in ("inference", "prefill", "decode")}
    assert all(v > 0 for v in phases.values()) and phases["inference"] >= phases["decode"]
    for name in ("inference", "prefill", "decode", "queue"):
        assert delta(f"vllm:request_{name}_time_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == delta("vllm:time_to_first_token_seconds_count") == 1
    assert _value(after, "vllm:num_preemptions_total", model_name="tiny-llama") >= 0
    assert _value(after, "vllm:num_requests_running", model_name="tiny-llama") == 0
    assert _value(after, "vllm:cache_config_info", block_size="16", num_gpu_blocks="256",
                  enable_prefix_caching="True") == 1
    assert _value(after, "nanoserve_generation_tokens_total") >= 5  # nanoserve's own names stay


# -- 10. several served model names --------------------------------------------------------------------------
def test_every_served_name_is_listed_and_echoed(edge):
    client = edge.client()
    assert [m.id for m in client.models.list().data] == list(NAMES)
    for name in NAMES:
        assert client.completions.create(model=name, prompt="Hi", max_tokens=1).model == name
        assert client.chat.completions.create(model=name, max_tokens=1,
                                              messages=[{"role": "user", "content": "Hi"}]).model == name
    default = _post(edge, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).json()
    assert default["model"] == NAMES[0]
    err = _error(_post(edge, "/v1/completions", {"model": "gpt-9", "prompt": "Hi"}), 404, "model",
                 error_type="not_found_error")
    assert all(name in err["message"] for name in NAMES)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="Hi", max_tokens=1)


# -- 11. the request log and the log flags -------------------------------------------------------------------
def _wait_for_log(server, pattern: str) -> re.Match | None:
    for _ in range(200):
        if match := re.search(pattern, server.log()):
            return match
        time.sleep(0.05)
    return None


def test_each_request_is_logged_when_it_finishes(edge):
    reply = edge.client().completions.create(model="alias", prompt="Hello", max_tokens=3,
                                             extra_body={"ignore_eos": True})
    match = _wait_for_log(edge, rf"INFO .*request {reply.id}: (\d+) prompt tokens, (\d+) generated, "
                                rf"finish_reason (\w+), [\d.]+ s")
    assert match, edge.log()[-2000:]
    assert match.groups() == (str(reply.usage.prompt_tokens), "3", "length")
    assert f"on http://127.0.0.1:{edge.port}" in edge.log()
