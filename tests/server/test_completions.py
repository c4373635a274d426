"""/v1/completions through the official openai client and raw httpx (random weights: assertions are
on token counts, finish reasons, shapes and determinism, never on the text itself)."""

import asyncio
import json

import httpx

EXACT = {"ignore_eos": True}  # so a random model's eos cannot cut a length test short


def _greedy(client, prompt="Hello world", max_tokens=16, **kwargs):
    return client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body=EXACT, **kwargs)


def test_completion_counts_and_usage(server):
    out = _greedy(server.client(), max_tokens=12)
    assert out.object == "text_completion" and out.model == "tiny-llama"
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_streamed_greedy_text_equals_non_streamed(server):
    client = server.client()
    full = _greedy(client, max_tokens=24).choices[0].text
    chunks = list(_greedy(client, max_tokens=24, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_n_choices(server):
    out = server.client().completions.create(model="tiny-llama", prompt="Hi", n=3, max_tokens=8, seed=1,
                                             extra_body=EXACT)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 24


def test_n_choices_streamed(server):
    chunks = list(server.client().completions.create(model="tiny-llama", prompt="Hi", n=3, max_tokens=8,
                                                     stream=True, logprobs=0, extra_body=EXACT))
    tokens = {i: sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].index == i)
              for i in range(3)}
    assert tokens == {0: 8, 1: 8, 2: 8}
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2]


def test_stop_string_from_greedy_run(server):
    client = server.client()
    text = _greedy(client, max_tokens=32).choices[0].text
    # A two-character stop string whose first occurrence is past the start, and not a broken char.
    k = next(k for k in range(2, len(text) - 2)
             if "\ufffd" not in text[k:k + 2] and text.find(text[k:k + 2]) == k)
    stop = text[k:k + 2]
    out = _greedy(client, max_tokens=32, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:k]
    streamed = list(_greedy(client, max_tokens=32, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[:k]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(server):
    client = server.client()
    runs = [client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=16, temperature=1.0,
                                      seed=1234, extra_body=EXACT).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]


def test_logprobs_shape(server):
    out = _greedy(server.client(), max_tokens=6, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)  # the top 3, plus the sampled token
    # Greedy: the sampled token is the most likely one.
    assert all(lp.token_logprobs[i] >= max(lp.top_logprobs[i].values()) - 1e-4 for i in range(6))


def test_include_usage_chunk(server):
    chunks = list(_greedy(server.client(), max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"


def test_token_id_prompts_list_and_echo(server):
    body = {"model": "tiny-llama", "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"] == {**out["usage"], "prompt_tokens": 5, "completion_tokens": 8}
    detok = httpx.post(server.url + "/detokenize", json={"tokens": [5, 6, 7]}).json()["prompt"]
    assert out["choices"][0]["text"].startswith(detok)


def test_raw_sse_framing(server):
    body = {"prompt": "Hi", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_async_client_streams(server):
    async def one(client, i):
        stream = await client.completions.create(model="tiny-llama", prompt=f"Hello {i}", max_tokens=10,
                                                 temperature=0, stream=True, logprobs=0, extra_body=EXACT)
        return sum([len(c.choices[0].logprobs.tokens) async for c in stream])

    async def main():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(4)))

    assert asyncio.run(main()) == [10] * 4


def test_echo_with_logprobs_scores_the_prompt(server):
    prompt = [5, 6, 7, 8]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 2}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    lp = full["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 3
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
