"""Every error case, with its status and OpenAI's error shape, against a server with an API key, one
running sequence at most and a waiting queue of two (so backpressure is easy to reach)."""

import asyncio

import httpx
import openai
import pytest
from conftest import STRICT_KEY as KEY

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def strict(strict_server):
    return strict_server


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _post(server, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_api_key(strict):
    body = {"prompt": "Hi", "max_tokens": 1}
    _error(_post(strict, "/v1/completions", body, headers={}), 401)
    _error(_post(strict, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    assert _post(strict, "/v1/completions", body).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict.url + "/v1", api_key="wrong", max_retries=0).models.list()
    for open_path in ("/health", "/metrics", "/version"):
        assert httpx.get(strict.url + open_path).status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "Hi", "temperature": -1}, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "Hi", "n": 2}, "n"),  # over max_num_seqs=1: it could never be scheduled
    ({"prompt": "Hi", "stop_token_ids": [5000]}, "stop_token_ids"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [5, 100000]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
])
def test_validation_is_400_naming_the_field(strict, body, param):
    err = _error(_post(strict, "/v1/completions", body), 400, param)
    assert err["type"] == "invalid_request_error" and param in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
])
def test_chat_validation(strict, body, param):
    _error(_post(strict, "/v1/chat/completions", body), 400, param)


def test_malformed_json_is_400(strict):
    r = httpx.post(strict.url + "/v1/completions", content=b"{not json", headers=AUTH)
    _error(r, 400)


def test_context_overflow_states_both_numbers(strict):
    prompt = list(range(2, 102))  # 100 tokens
    err = _error(_post(strict, "/v1/completions", {"prompt": prompt, "max_tokens": 500}), 400, "max_tokens")
    assert "100" in err["message"] and "500" in err["message"] and "512" in err["message"]
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=strict.url + "/v1", api_key=KEY, max_retries=0).completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=500)
    assert err["code"] == "context_length_exceeded"
    err = _error(_post(strict, "/v1/completions", {"prompt": list(range(2, 600))}), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "598" in err["message"] and "512" in err["message"]
    long_chat = {"messages": [{"role": "user", "content": "x" * 600}]}
    assert _error(_post(strict, "/v1/chat/completions", long_chat), 400, "messages")["code"] == \
        "context_length_exceeded"


@pytest.mark.parametrize("field, value", [("stop_token_ids", [5000, 3, 7000]),
                                          ("logit_bias", {"5000": 1, "3": 1, "7000": 1})])
def test_out_of_vocabulary_ids_are_all_named(strict, field, value):
    err = _error(_post(strict, "/v1/completions", {"prompt": "Hi", field: value}), 400, field)
    assert "5000, 7000" in err["message"] and "384" in err["message"], err


def test_bad_logit_bias_keys_are_all_named(strict):
    err = _error(_post(strict, "/v1/completions", {"prompt": "Hi", "logit_bias": {"a": 1, "3": 1, "-2": 1}}), 400,
                 "logit_bias")
    assert "'a', '-2'" in err["message"], err
    too_big = {str(2**40): 1, "3": 1, str(2**41): 1}  # digits, but past any token id: SamplingParams' check
    err = _error(_post(strict, "/v1/completions", {"prompt": "Hi", "logit_bias": too_big}), 400, "logit_bias")
    assert f"{2**40}, {2**41}" in err["message"], err


@pytest.mark.parametrize("headers", [{}, {"content-type": "text/plain"},
                                     {"content-type": "application/x-www-form-urlencoded"}])  # curl -d's
def test_a_body_that_is_not_sent_as_json_says_so(strict, headers):
    r = httpx.post(strict.url + "/v1/completions", content=b'{"prompt": "Hi"}', headers={**AUTH, **headers})
    err = _error(r, 400)
    assert "must be JSON" in err["message"] and "Content-Type: application/json" in err["message"], err
    r = httpx.post(strict.url + "/v1/completions", headers={**AUTH, "content-type": "application/json"})
    assert "body is empty" in _error(r, 400)["message"]


def test_unknown_model_is_404(strict):
    err = _error(_post(strict, "/v1/completions", {"model": "gpt-9", "prompt": "Hi"}), 404, "model")
    assert "gpt-9" in err["message"]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=strict.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}])


def test_body_over_limit_is_413(strict):
    big = {"prompt": "x" * (1 << 20)}
    _error(_post(strict, "/v1/completions", big), 413)

    def chunks():  # no Content-Length: the real size must be checked as it arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * 65536
        yield b'"}'

    r = httpx.post(strict.url + "/v1/completions", content=chunks(), headers={**AUTH, "content-type":
                                                                              "application/json"})
    _error(r, 413)


def test_waiting_queue_over_limit_is_429(strict):
    strict.wait_idle()  # nothing left over from an earlier test counts against the queue

    async def main():
        async with httpx.AsyncClient(base_url=strict.url, headers=AUTH, timeout=60) as http:
            body = {"prompt": "busy", "max_tokens": 400, "stream": True, "ignore_eos": True}

            async def accepted_stream() -> httpx.Response:
                response = await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
                assert response.status_code == 200
                return response

            # One runs (max_num_seqs=1), two wait (the limit): all are accepted. A request counts as waiting
            # until the engine schedules it, so the first must be running before the other two are sent.
            streams = [await accepted_stream()]
            while (await http.get("/health")).json()["running"] == 0:
                await asyncio.sleep(0.01)
            streams += [await accepted_stream(), await accepted_stream()]
            r = await http.post("/v1/completions", json={**body, "stream": False})
            err = _error(r, 429)
            assert err["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                await openai.AsyncOpenAI(base_url=strict.url + "/v1", api_key=KEY, max_retries=0
                                         ).completions.create(model="tiny-llama", prompt="Hi", max_tokens=1)
            for response in streams:
                await response.aclose()

    asyncio.run(main())
    health = strict.wait_idle()
    assert health["running"] == 0 and health["kv_blocks_free"] == health["kv_blocks_total"]
    assert _post(strict, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
