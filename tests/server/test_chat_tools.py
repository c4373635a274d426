"""Chat completions on the bundled model run the calculator tool loop; forced chunks are marked, and the
text shows the call and its result apart from the answer."""

import json

import httpx
import pytest

from nanoserve.config import bundled_model_dir

QUESTION = [{"role": "user", "content": "What is 12*34?"}]


@pytest.fixture(scope="module", params=["--no-engine-process", "--engine-process"])
def bundled(launch, request):
    # The engine process sends text as deltas (runtime/output_delta.py): the tool loop's text must only grow.
    server = launch("--model", bundled_model_dir(), "--served-model-name", "nanoserve-tiny", request.param)
    yield server
    server.stop()


def _stream(server, **fields) -> list[dict]:
    body = {"model": "nanoserve-tiny", "messages": QUESTION, "max_tokens": 48, "temperature": 0, "stream": True,
            **fields}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_chat_completion_uses_the_calculator(bundled):
    out = bundled.client().chat.completions.create(model="nanoserve-tiny", messages=QUESTION, max_tokens=48,
                                                   temperature=0)
    text = out.choices[0].message.content
    assert text.startswith("[calculator: 12*34] 408\n") and out.choices[0].finish_reason == "stop", text
    assert "408" in text.split("\n", 1)[1]  # the answer, on a line of its own, uses the result
    streamed = _stream(bundled)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed) == text


@pytest.mark.parametrize("skip_special_tokens,forced_text", [
    (True, "408\n"), (False, "<|output_start|>408<|output_end|>")])
def test_streamed_tool_output_is_marked(bundled, skip_special_tokens, forced_text):
    chunks = _stream(bundled, skip_special_tokens=skip_special_tokens)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    tool = [d for d in deltas if d.get("tool_output")]
    assert "".join(d.get("content", "") for d in tool) == forced_text
    assert all(d.get("tool_output") in (None, True) for d in deltas)
    if not skip_special_tokens:  # the call comes before the forced output, in sampled chunks
        text = "".join(d.get("content", "") for d in deltas)
        assert text.index("<|python_end|>") < text.index(forced_text)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("tools", [None, [WEATHER]])
def test_history_with_another_tools_call_renders(bundled, tools):
    # The bundled template once read every call as the calculator's: a 500 on chat and on /tokenize.
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    extra = {"tools": tools} if tools else {}
    out = bundled.client().chat.completions.create(model="nanoserve-tiny", messages=messages, max_tokens=4,
                                                   temperature=0, **extra)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = httpx.post(bundled.url + "/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    text = httpx.post(bundled.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
