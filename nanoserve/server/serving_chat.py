"""POST /v1/chat/completions: a conversation rendered by the model's chat template, n choices.

A stream opens each choice with a chunk carrying the assistant role (as OpenAI does), then content
deltas, with finish_reason on the choice's last chunk.

On a model with the tool-use special tokens (the bundled one), chat requests run under the calculator
tool loop (chat_engine.ToolLoop, inside the engine's step): the tool's output is forced into the
sample and streamed like sampled text, in chunks of its own whose delta says "tool_output": true.
"""

import functools
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.chat_engine import ToolLoop
from nanoserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.server.errors import APIError, bad_request
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.protocol import ChatCompletionRequest
from nanoserve.server.serving_base import ChoiceState, Generation, ServingBase
from nanoserve.server.streaming import (
    CHUNK_END,
    ChunkHead,
    EngineStreamResponse,
    json_str,
    json_value,
    run_until_disconnected,
)

# Chat request ids start with this (ServingBase.start adds "-<hex>-<i>"); the tool loop tracks exactly these.
ID_PREFIX = "chatcmpl"


class ServingChat(ServingBase):
    def __init__(self, engine: AsyncEngine, model_names: list[str], metrics: ServerMetrics,
                 max_waiting_requests: int | None, log_requests: bool = False) -> None:
        super().__init__(engine, model_names, metrics, max_waiting_requests, log_requests)
        # The tool loop is a step hook, so it is installed where the engine runs (its thread, or its
        # process), before any chat request; a model without the tool tokens gets none.
        engine.setup(functools.partial(ToolLoop.attach, prefix=ID_PREFIX + "-"))

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        model = self.check_model(req.model)
        self.check_stream_options(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        try:
            params = self.sampling_params(lambda: req.sampling_params(max_tokens, top))
        except APIError as err:
            if err.param == "logprobs":  # the chat API calls the count top_logprobs
                raise APIError(400, err.message.replace("logprobs", "top_logprobs", 1), "top_logprobs") from None
            raise
        messages = [m.for_template() for m in req.messages]
        try:
            prompt_ids = await self.engine.apply_chat_template(messages, req.add_generation_prompt)
        except ValueError as exc:
            raise bad_request(exc) from None
        self.check_prompt(prompt_ids, max_tokens, param="messages")
        gen = self.start(ID_PREFIX, [prompt_ids], params, model, arrival)
        if req.stream:
            chunks = ChatChunks(gen, req.include_usage, req.top_logprobs or 0)
            return EngineStreamResponse(lambda send: self.stream(gen, chunks, send), lambda: self.close(gen))
        finals = await run_until_disconnected(raw, self.collect(gen), lambda: self.close(gen))
        return JSONResponse(self._response(gen, finals, req))

    def _response(self, gen: Generation, finals: dict, req: ChatCompletionRequest) -> dict:
        choices = []
        for prompt_index, out in finals.items():
            for c in out.outputs:
                block = (_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                         if c.logprobs is not None else None)
                # Under the tool loop the text shows each calculator call and its result with markers
                # (chat_engine.TOOL_MARKERS), as the stream's deltas do, until tool calls get OpenAI's shape.
                choices.append({"index": gen.choice_index(prompt_index, c.index),
                                "message": {"role": "assistant", "content": c.text},
                                "logprobs": block, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        choices.sort(key=lambda ch: ch["index"])
        return {"id": gen.response_id, "object": "chat.completion", "created": gen.created,
                "model": gen.model, "choices": choices, "usage": gen.usage(finals).to_dict()}


def _all_forced(c: CompletionOutput, start: int) -> bool:
    """Whether the tokens of `c` from `start` on were all forced by the tool loop. The loop hands
    forced tokens over in an output of their own, so a delta is all forced or all sampled."""
    masks = getattr(c, "token_masks", None)  # only on ToolCompletionOutput
    return masks is not None and not any(masks[start:])


class ChatChunks:
    """A chat stream's chunks (StreamChunks): {"id", "object": "chat.completion.chunk", "created", "model",
    "choices": [{"index", "delta", "logprobs", "finish_reason"}]}, one choice per chunk."""

    def __init__(self, gen: Generation, include_usage: bool, top_logprobs: int) -> None:
        self.gen = gen
        self.head = ChunkHead(gen.response_id, "chat.completion.chunk", gen.created, gen.model)
        self.include_usage = include_usage
        self.top_logprobs = top_logprobs

    def render(self, prompt_index: int, out: RequestOutput) -> str:
        gen, text_out = self.gen, ""
        for c in out.outputs:
            index = prompt_index * gen.n + c.index
            state = gen.choices.get(index)
            if state is None:
                state = gen.choices[index] = ChoiceState()
                text_out += self.chunk(index, _ROLE_DELTA, None, None)
            if state.finished:
                continue
            start = state.num_tokens
            text, ids, logprobs = state.delta(c)
            if not text and not ids and c.finish_reason is None:
                continue
            block = _logprobs(ids, logprobs, self.top_logprobs) if logprobs is not None else None
            if ids and _all_forced(c, start):
                delta = json_value({"content": text, "tool_output": True} if text else {"tool_output": True})
            else:
                delta = f'{{"content": {json_str(text)}}}' if text else "{}"
            text_out += self.chunk(index, delta, block, c.finish_reason)
        return text_out

    def chunk(self, index: int, delta_json: str, logprobs: dict | None, finish_reason: str | None) -> str:
        if logprobs is None and finish_reason is None:
            return f"{self.head[index]}\"delta\": {delta_json}{_PLAIN_END}"
        return (f"{self.head[index]}\"delta\": {delta_json}, \"logprobs\": {json_value(logprobs)}, "
                f"\"finish_reason\": {json_value(finish_reason)}{CHUNK_END}")

    def end(self, gen: Generation, finals: dict[int, RequestOutput]) -> str:
        return gen.usage_chunk("chat.completion.chunk", finals) if self.include_usage else ""


# The delta of a choice's first chunk, as OpenAI sends it.
_ROLE_DELTA = '{"role": "assistant", "content": ""}'
# How a chunk with no logprobs or finish_reason ends: most chunks of a stream.
_PLAIN_END = f', "logprobs": null, "finish_reason": null{CHUNK_END}'


def _logprobs(ids: list[int], entries: list[TokenLogprobs], top_n: int) -> dict:
    """The chat API's logprobs block: one entry per token, with its top_n alternatives."""
    content = []
    for token_id, entry in zip(ids, entries, strict=True):
        chosen = entry[token_id]
        top = sorted((lp for lp in entry.values() if lp.rank <= top_n), key=lambda lp: lp.rank)
        content.append({**_token(chosen), "top_logprobs": [_token(lp) for lp in top]})
    return {"content": content}


def _token(lp) -> dict:
    return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}
