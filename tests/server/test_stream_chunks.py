"""Streamed chunks are encoded from templates (serving_completions.CompletionChunks, serving_chat.ChatChunks)
and written by ServingBase.stream; their bytes must stay exactly what json.dumps(chunk, ensure_ascii=False)
framed as SSE gave, with the line breaks JSON leaves raw (U+0085, U+2028, U+2029) escaped. Latencies are batched
into the inter-token histogram (metrics.RequestTracker): the histogram must end up as if every token had been
observed on its own."""

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram

from nanoserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, ToolCompletionOutput
from nanoserve.runtime.streams import EngineDeadError
from nanoserve.server import metrics as metrics_module
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.serving_base import Generation, ServingBase
from nanoserve.server.serving_chat import ChatChunks
from nanoserve.server.serving_completions import CompletionChunks

TEXTS = ["", " hello", 'quote " backslash \\ slash /', "tab\tnew\nline\r\x00\x1f\x7f", "é ü 中文 🙂", "\u2028\u2029",
         "next\x85line", "</script>"]
LOGPROBS = {"tokens": ["a", "é"], "token_logprobs": [-0.1, -1e-08], "top_logprobs": [{"a": -0.1}, {"é": -2.5}],
            "text_offset": [0, 1]}


def _gen(n: int = 1, prompts: int = 1, model: str = "tiny-llama", group=None, tracker=None) -> Generation:
    return Generation('cmpl-0123"\\é', 1_700_000_000, model, [[1, 2]] * prompts, n, group, tracker)


def _dumps(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _sse(chunk: dict) -> str:
    return f"data: {_dumps(chunk)}\n\n"


def _events(text: str) -> list[dict]:
    """The chunks of SSE text, each checked to be byte-for-byte what json.dumps gives for it (json.loads keeps
    key order and float reprs round-trip, so re-encoding what was parsed must give the same string)."""
    assert text.endswith("\n\n")
    payloads = [e[len("data: "):] for e in text[:-2].split("\n\n")]
    assert all(_dumps(json.loads(p)) == p for p in payloads)
    return [json.loads(p) for p in payloads]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("rest", [(None, None, None), (LOGPROBS, None, None), (None, "stop", "\n\n"),
                                  (None, "stop", 2), (LOGPROBS, "length", None)])
def test_completion_chunk_is_json_dumps(text, rest):
    gen = _gen(model="m/ü")
    logprobs, finish_reason, stop_reason = rest
    expected = {"id": gen.response_id, "object": "text_completion", "created": gen.created, "model": gen.model,
                "choices": [{"index": 3, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                             "stop_reason": stop_reason}]}
    assert CompletionChunks(gen, False, None).chunk(3, text, logprobs, finish_reason, stop_reason) == _sse(expected)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("logprobs,finish_reason", [(None, None), ({"content": []}, None), (None, "stop"),
                                                    ({"content": [{"token": "é", "logprob": -0.5}]}, "length")])
def test_chat_chunk_is_json_dumps(text, logprobs, finish_reason):
    gen = _gen()
    chunks = ChatChunks(gen, False, 0)
    for delta in ({"content": text}, {}, {"content": text, "tool_output": True}, {"role": "assistant", "content": ""}):
        expected = {"id": gen.response_id, "object": "chat.completion.chunk", "created": gen.created,
                    "model": gen.model, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                     "finish_reason": finish_reason}]}
        assert chunks.chunk(0, _dumps(delta), logprobs, finish_reason) == _sse(expected)


@pytest.mark.parametrize("text", TEXTS)
def test_a_chunk_is_one_line_to_httpx(text):
    """httpx's iter_lines splits as str.splitlines does: on U+2028 too, which json.dumps leaves raw."""
    chunk = CompletionChunks(_gen(), False, None).chunk(0, text, LOGPROBS, None, None)
    lines = [line for line in httpx._decoders.LineDecoder().decode(chunk) if line]
    assert len(lines) == 1 and json.loads(lines[0][len("data: "):])["choices"][0]["text"] == text


def _out(request_id: str, samples: list[CompletionOutput], finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2], samples, finished)


def test_chat_render_deltas_roles_tool_output_and_finish():
    gen = _gen(n=2)
    chunks = ChatChunks(gen, False, 0)
    first = chunks.render(0, _out("r", [CompletionOutput(0, "Hi", [7]), CompletionOutput(1, "", [])]))
    forced = ToolCompletionOutput(0, "Hi 408", [7, 8, 9], token_masks=[1, 0, 0])
    second = chunks.render(0, _out("r", [forced, CompletionOutput(1, "Yo", [5], finish_reason="stop")]))
    done = chunks.render(0, _out("r", [CompletionOutput(0, "Hi 408", [7, 8, 9], finish_reason="length"),
                                       CompletionOutput(1, "Yo", [5], finish_reason="stop")], finished=True))
    got = [(e["choices"][0]["index"], e["choices"][0]["delta"], e["choices"][0]["finish_reason"])
           for e in _events(first + second + done)]
    assert got == [(0, {"role": "assistant", "content": ""}, None), (0, {"content": "Hi"}, None),
                   (1, {"role": "assistant", "content": ""}, None),
                   (0, {"content": " 408", "tool_output": True}, None), (1, {"content": "Yo"}, "stop"),
                   (0, {}, "length")]


def test_completion_render_multi_prompt_indices_and_logprob_offsets():
    gen = _gen(n=1, prompts=2)
    chunks = CompletionChunks(gen, False, None)

    def entry(token_id, piece):
        return {token_id: Logprob(-0.5, 1, piece)}

    a = chunks.render(1, _out("r1", [CompletionOutput(0, "ab", [3], logprobs=[entry(3, "ab")])]))
    b = chunks.render(1, _out("r1", [CompletionOutput(0, "abc", [3, 4], logprobs=[entry(3, "ab"), entry(4, "c")],
                                                      finish_reason="stop", stop_reason=4)], finished=True))
    events = _events(a + b)
    assert [e["choices"][0]["index"] for e in events] == [1, 1]
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in events] == [[0], [2]]
    assert events[1]["choices"][0] | {"logprobs": None} == {"index": 1, "text": "c", "logprobs": None,
                                                             "finish_reason": "stop", "stop_reason": 4}
    assert chunks.render(1, _out("r1", [CompletionOutput(0, "abc", [3, 4], finish_reason="stop")])) == ""


class _Group:
    def __init__(self, items):
        self.items = items

    async def __aiter__(self):
        for item in self.items:
            if isinstance(item, BaseException):
                raise item
            yield item


def _sent(items, include_usage: bool) -> list[str]:
    metrics = ServerMetrics(SimpleNamespace())
    gen = _gen(prompts=2, group=_Group(items), tracker=metrics.tracker())
    messages = []

    async def send(message):
        assert message["type"] == "http.response.body"
        messages.append((message["body"].decode(), message["more_body"]))

    serving = ServingBase(None, ["tiny-llama"], metrics, None)
    asyncio.run(serving.stream(gen, CompletionChunks(gen, include_usage, None), send))
    assert [more for _, more in messages] == [True] * (len(messages) - 1) + [False]
    return [body for body, _ in messages]


def test_stream_sends_the_last_chunks_usage_and_done_together():
    items = [(0, _out("r0", [CompletionOutput(0, "a", [5])])),
             (0, _out("r0", [CompletionOutput(0, "ab", [5, 6], finish_reason="length")], finished=True)),
             (1, _out("r1", [CompletionOutput(0, "x", [7], finish_reason="length")], finished=True))]
    messages = _sent(items, include_usage=True)
    assert len(messages) == 3  # one per output: the last one's chunk goes with the usage chunk and [DONE]
    assert messages[2].endswith("data: [DONE]\n\n")
    tail = _events(messages[2][:-len("data: [DONE]\n\n")])
    assert [e["choices"][0]["text"] for e in tail[:1]] == ["x"]
    assert tail[1]["choices"] == [] and tail[1]["usage"]["completion_tokens"] == 3
    assert tail[1]["usage"]["prompt_tokens"] == 4


def test_engine_failure_mid_stream_is_an_error_event_then_done():
    items = [(0, _out("r0", [CompletionOutput(0, "a", [5])])), EngineDeadError("the engine died")]
    messages = _sent(items, include_usage=True)
    assert json.loads(messages[0][len("data: "):])["choices"][0]["text"] == "a"
    error, done = messages[1][:-2].split("\n\n")
    assert "the engine died" in json.loads(error[len("data: "):])["error"]["message"] and done == "data: [DONE]"


def _histogram(histogram: Histogram) -> dict:
    """A histogram's samples as /metrics would show them: {("bucket", le) | ("count", None) | ("sum", None): value}."""
    return {(s.name.rsplit("_", 1)[1], s.labels.get("le")): s.value for f in histogram.collect()
            for s in f.samples if not s.name.endswith("created")}


COUNT = ("count", None)


def test_tracker_histogram_equals_one_observe_per_token(monkeypatch):
    metrics = ServerMetrics(SimpleNamespace())
    reference = Histogram("ref", "per-token observes", buckets=metrics.itl_bounds, registry=CollectorRegistry())
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock.now)
    tracker = metrics.tracker()
    # Two samples, whose token counts grow as below (the first arrival of each has no gap to measure); the
    # second step's gap of sample 0 is a bucket's bound exactly, which belongs in that bucket.
    steps = [(0.0, (1, 0)), (0.005, (2, 2)), (0.009, (5, 3)), (0.039, (5, 4)), (0.2, (6, 4)), (3.5, (7, 9))]
    last = {0: (None, 0), 1: (None, 0)}
    for step, (now, counts) in enumerate(steps):
        clock.now = now
        finished = step == len(steps) - 1
        if finished:
            assert _histogram(metrics.itl)[COUNT] == 0  # fewer than 64 so far: still held by the tracker
        tracker.observe(_out("r", [CompletionOutput(i, "", list(range(n)), finish_reason="length" if finished
                                                    else None) for i, n in enumerate(counts)], finished))
        for i, n in enumerate(counts):
            t, seen = last[i]
            if n > seen:
                for _ in range(n - seen if t is not None else 0):
                    reference.observe((now - t) / (n - seen))
                last[i] = (now, n)
    got, want = _histogram(metrics.itl), _histogram(reference)
    assert got.keys() == want.keys() and got[COUNT] == 6 + 7
    assert got[("bucket", "0.005")] == 5  # buckets are cumulative: 0.005 itself, three of 0.00133 and one of 0.004
    for key in got:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), key


def test_tracker_adds_latencies_every_64_tokens_and_at_flush(monkeypatch):
    metrics = ServerMetrics(SimpleNamespace())
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: 1.0)
    tracker = metrics.tracker()
    for n in range(1, 66):  # one token per output; the first has no gap
        tracker.observe(_out("r", [CompletionOutput(0, "", list(range(n)))]))
        assert _histogram(metrics.itl)[COUNT] == (64 if n >= 65 else 0)
    tracker.observe(_out("r", [CompletionOutput(0, "", list(range(70)))]))
    assert _histogram(metrics.itl)[COUNT] == 64
    tracker.flush()  # what closing the request does, finished or not
    assert _histogram(metrics.itl)[COUNT] == 69


def test_finished_output_records_request_timings():
    metrics = ServerMetrics(SimpleNamespace())
    out = _out("r", [CompletionOutput(0, "a", [1], finish_reason="stop")], finished=True)
    out.metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0, finished_time=4.0)
    metrics.tracker().observe(out)
    assert {s.labels["finish_reason"]: s.value for f in metrics.finished.collect() for s in f.samples
            if s.name.endswith("_total")} == {"stop": 1}
    assert [_histogram(h)[("sum", None)] for h in (metrics.e2e, metrics.ttft, metrics.queue_time)] == [3.0, 1.0, 0.5]


def _raw_events(server, path: str, body: dict) -> str:
    """The SSE body of a streamed request, without its closing [DONE]."""
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert r.headers["cache-control"] == "no-cache"
        raw = r.read().decode()
    assert raw.endswith("\n\ndata: [DONE]\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return raw[:-len("data: [DONE]\n\n")]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ["Hello", "a b"], "n": 2, "logprobs": 2, "echo": True,
                         "stop": ["zz"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hé"}], "n": 2, "logprobs": True,
                              "top_logprobs": 2})])
def test_streamed_events_are_exactly_json_dumps(server, path, body):
    body = {**body, "model": "tiny-llama", "max_tokens": 6, "temperature": 0.7, "seed": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    parsed = _events(_raw_events(server, path, body))
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"]["completion_tokens"] > 0
    choices = [c for e in parsed[:-1] for c in e["choices"]]
    n_choices = 4 if path == "/v1/completions" else 2
    assert sorted({c["index"] for c in choices}) == list(range(n_choices))
    assert sum(c["finish_reason"] is not None for c in choices) == n_choices
    assert len({(e["id"], e["created"], e["model"], e["object"]) for e in parsed}) == 1
