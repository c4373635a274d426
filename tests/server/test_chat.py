"""/v1/chat/completions through the official openai client (sync and async)."""

import asyncio

import httpx

EXACT = {"ignore_eos": True}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]


def _chat(client, max_tokens=16, **kwargs):
    return client.chat.completions.create(model="tiny-llama", messages=kwargs.pop("messages", MESSAGES),
                                          max_tokens=max_tokens, temperature=0, extra_body=EXACT, **kwargs)


def test_chat_completion(server):
    out = _chat(server.client(), max_tokens=10)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 10
    prompt = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert out.usage.prompt_tokens == prompt["count"]


def test_streamed_chat_equals_non_streamed(server):
    client = server.client()
    full = _chat(client, max_tokens=20).choices[0].message.content
    chunks = list(_chat(client, max_tokens=20, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_completion_tokens_and_text_parts(server):
    client = server.client()
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo!"}]}]
    plain = [{"role": "user", "content": "Hello!"}]
    a = client.chat.completions.create(model="tiny-llama", messages=parts, max_completion_tokens=7,
                                       temperature=0, extra_body=EXACT)
    b = client.chat.completions.create(model="tiny-llama", messages=plain, max_tokens=7, temperature=0,
                                       extra_body=EXACT)
    assert a.usage.completion_tokens == 7
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_n_and_seed(server):
    client = server.client()
    kwargs = dict(model="tiny-llama", messages=MESSAGES, max_tokens=8, n=3, temperature=1.0, seed=7,
                  extra_body=EXACT)
    a, b = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 24


def test_chat_logprobs(server):
    out = _chat(server.client(), max_tokens=5, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())


def test_chat_stream_usage(server):
    chunks = list(_chat(server.client(), max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_async_chat_clients(server):
    async def one(client):
        stream = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=6,
                                                      temperature=0, stream=True, extra_body=EXACT,
                                                      stream_options={"include_usage": True})
        return [c async for c in stream][-1].usage.completion_tokens

    async def main():
        async with server.async_client() as client:
            sync_text = (await client.chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                                              max_tokens=6, temperature=0, extra_body=EXACT))
            return sync_text, await asyncio.gather(*(one(client) for _ in range(4)))

    full, counts = asyncio.run(main())
    assert full.usage.completion_tokens == 6 and counts == [6] * 4
