"""POST /v1/chat/completions: a conversation rendered by the model's chat template, n choices.

A stream opens each choice with a chunk carrying the assistant role (as OpenAI does), then content
deltas, with finish_reason on the choice's last chunk.

On a model with the tool-use special tokens (the bundled one), chat requests run under the calculator
tool loop (chat_engine.ToolLoop, inside the engine's step): the tool's output is forced into the
sample and streamed like sampled text, in chunks of its own whose delta says "tool_output": true.
"""

import functools
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.chat_engine import ToolLoop
from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.outputs import CompletionOutput, TokenLogprobs
from nanoserve.server.errors import APIError, bad_request
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.protocol import ChatCompletionRequest
from nanoserve.server.serving_base import ChoiceState, Generation, ServingBase, sse_with_errors
from nanoserve.server.streaming import EngineStreamResponse, run_until_disconnected

# Chat request ids start with this (ServingBase.start adds "-<hex>-<i>"); the tool loop tracks exactly these.
ID_PREFIX = "chatcmpl"


class ServingChat(ServingBase):
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics,
                 max_waiting_requests: int | None) -> None:
        super().__init__(engine, model_name, metrics, max_waiting_requests)
        # The tool loop is a step hook, so it is installed where the engine runs (its thread, or its
        # process), before any chat request; a model without the tool tokens gets none.
        engine.setup(functools.partial(ToolLoop.attach, prefix=ID_PREFIX + "-"))

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
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
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt_ids = await self.engine.apply_chat_template(messages, req.add_generation_prompt)
        except ValueError as exc:
            raise bad_request(exc) from None
        self.check_prompt(prompt_ids, max_tokens, param="messages")
        gen = self.start(ID_PREFIX, [prompt_ids], params)
        if req.stream:
            return EngineStreamResponse(sse_with_errors(self._chunks(gen, req)), lambda: self.close(gen))
        finals = await run_until_disconnected(raw, self.collect(gen), lambda: self.close(gen))
        return JSONResponse(self._response(gen, finals, req))

    async def _chunks(self, gen: Generation, req: ChatCompletionRequest) -> AsyncIterator[dict]:
        finals = {}
        async for prompt_index, out in self.outputs(gen):
            if out.finished:
                finals[prompt_index] = out
            for c in out.outputs:
                index = gen.choice_index(prompt_index, c.index)
                if index not in gen.choices:
                    gen.choices[index] = ChoiceState()
                    yield _chunk(gen, index, {"role": "assistant", "content": ""}, None, None)
                state = gen.choices[index]
                if state.finished:
                    continue
                start = state.num_tokens
                text, ids, logprobs = state.delta(c)
                if not text and not ids and c.finish_reason is None:
                    continue
                block = _logprobs(ids, logprobs, req.top_logprobs or 0) if logprobs is not None else None
                delta = {"content": text} if text else {}
                if ids and _all_forced(c, start):
                    delta["tool_output"] = True
                yield _chunk(gen, index, delta, block, c.finish_reason)
        if req.include_usage:
            yield {"id": gen.response_id, "object": "chat.completion.chunk", "created": gen.created,
                   "model": gen.model, "choices": [], "usage": gen.usage(finals).to_dict()}

    def _response(self, gen: Generation, finals: dict, req: ChatCompletionRequest) -> dict:
        choices = []
        for prompt_index, out in finals.items():
            for c in out.outputs:
                block = (_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                         if c.logprobs is not None else None)
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


def _chunk(gen: Generation, index: int, delta: dict, logprobs: dict | None, finish_reason) -> dict:
    return {"id": gen.response_id, "object": "chat.completion.chunk", "created": gen.created,
            "model": gen.model, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": finish_reason}]}


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
