"""POST /v1/completions: one or more prompts, n choices each, streamed or not.

Choice i of prompt p has index p * n + i, as in OpenAI's API. With echo, a choice's text starts with
its prompt; with echo and logprobs, the prompt's tokens are scored too (the first one has nothing
before it, so its logprob is null), as OpenAI does.
"""

import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.outputs import RequestOutput, TokenLogprobs
from nanoserve.server.errors import bad_request
from nanoserve.server.protocol import CompletionRequest
from nanoserve.server.serving_base import ChoiceState, Generation, ServingBase
from nanoserve.server.streaming import (
    CHUNK_END,
    ChunkHead,
    EngineStreamResponse,
    json_str,
    json_value,
    run_until_disconnected,
)


class ServingCompletions(ServingBase):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        model = self.check_model(req.model)
        self.check_stream_options(req)
        scored_prompt = req.logprobs if req.echo else None
        params = self.sampling_params(lambda: req.sampling_params(req.max_tokens, req.logprobs, scored_prompt))
        self.check_capacity(len(req.prompts()))
        prompts = []
        for prompt in req.prompts():
            try:
                ids = await self.engine.tokenize(prompt)
            except ValueError as exc:
                raise bad_request(exc) from None
            self.check_prompt(ids, req.max_tokens)
            prompts.append(ids)
        echoes = [await self._echo(p) for p in prompts] if req.echo else None
        gen = self.start("cmpl", prompts, params, model, arrival)
        if req.stream:
            chunks = CompletionChunks(gen, req.include_usage, echoes)
            return EngineStreamResponse(lambda send: self.stream(gen, chunks, send), lambda: self.close(gen))
        finals = await run_until_disconnected(raw, self.collect(gen), lambda: self.close(gen))
        return JSONResponse(self._response(gen, finals, req, echoes))

    async def _echo(self, prompt_ids: list[int]) -> "Echo":
        text = await self.engine.detokenize(prompt_ids) if self.engine.engine.tokenizer else ""
        return Echo(prompt_ids, text, await self.engine.decode_each(prompt_ids))

    def _response(self, gen: Generation, finals: dict, req: CompletionRequest, echoes) -> dict:
        choices = []
        for prompt_index, out in sorted(finals.items()):
            for c in out.outputs:
                text = c.text
                block = _logprobs(c.token_ids, c.logprobs, 0)[0] if c.logprobs is not None else None
                if echoes is not None:
                    echo = echoes[prompt_index]
                    text = echo.text + text
                    block = echo.join(block, out.prompt_logprobs)
                choices.append({"index": gen.choice_index(prompt_index, c.index), "text": text,
                                "logprobs": block, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        choices.sort(key=lambda ch: ch["index"])
        return {"id": gen.response_id, "object": "text_completion", "created": gen.created,
                "model": gen.model, "choices": choices, "usage": gen.usage(finals).to_dict()}


class CompletionChunks:
    """A completion stream's chunks (StreamChunks): {"id", "object": "text_completion", "created", "model",
    "choices": [{"index", "text", "logprobs", "finish_reason", "stop_reason"}]}, one choice per chunk."""

    def __init__(self, gen: Generation, include_usage: bool, echoes: list["Echo"] | None) -> None:
        self.gen = gen
        self.head = ChunkHead(gen.response_id, "text_completion", gen.created, gen.model)
        self.include_usage = include_usage
        self.echoes = echoes
        self.offsets: dict[int, int] = {}  # choice index -> text offset of its next token

    def render(self, prompt_index: int, out: RequestOutput) -> str:
        gen, text_out = self.gen, ""
        for c in out.outputs:
            index = prompt_index * gen.n + c.index
            state = gen.choices.get(index)
            if state is None:
                state = gen.choices[index] = ChoiceState()
            if state.finished:
                continue
            first = state.num_tokens == 0 and state.text_len == 0
            text, ids, logprobs = state.delta(c)
            if not text and not ids and c.finish_reason is None:
                continue
            block = None
            if logprobs is not None:
                block, self.offsets[index] = _logprobs(ids, logprobs, self.offsets.get(index, 0))
            if first and self.echoes is not None:
                echo = self.echoes[prompt_index]
                text = echo.text + text
                block = echo.join(block, out.prompt_logprobs)
            text_out += self.chunk(index, text, block, c.finish_reason, c.stop_reason)
        return text_out

    def chunk(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
              stop_reason: int | str | None) -> str:
        if logprobs is None and finish_reason is None and stop_reason is None:
            return f"{self.head[index]}\"text\": {json_str(text)}{_PLAIN_END}"
        return (f"{self.head[index]}\"text\": {json_str(text)}, \"logprobs\": {json_value(logprobs)}, "
                f"\"finish_reason\": {json_value(finish_reason)}, \"stop_reason\": {json_value(stop_reason)}"
                f"{CHUNK_END}")

    def end(self, gen: Generation, finals: dict[int, RequestOutput]) -> str:
        return gen.usage_chunk("text_completion", finals) if self.include_usage else ""


# How a chunk with no logprobs, finish_reason or stop_reason ends: most chunks of a stream.
_PLAIN_END = f', "logprobs": null, "finish_reason": null, "stop_reason": null{CHUNK_END}'


def _logprobs(ids: list[int], entries: list[TokenLogprobs], offset: int) -> tuple[dict, int]:
    """OpenAI's legacy logprobs block for these tokens, and the text offset after them."""
    block = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(ids, entries, strict=True):
        chosen = entry[token_id]
        block["tokens"].append(chosen.decoded_token)
        block["token_logprobs"].append(chosen.logprob)
        block["top_logprobs"].append(_top(entry))
        block["text_offset"].append(offset)
        offset += len(chosen.decoded_token)
    return block, offset


@dataclass
class Echo:
    """A prompt sent back in front of its completion."""

    token_ids: list[int]
    text: str
    pieces: list[str]  # each token's own text

    def join(self, generated: dict | None, prompt_logprobs: list[TokenLogprobs | None] | None) -> dict | None:
        """The prompt's logprobs block followed by the generated one's (offsets shifted past the prompt)."""
        if generated is None:
            return None
        entries = prompt_logprobs or [None] * len(self.token_ids)
        block = {"tokens": list(self.pieces), "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for token_id, piece, entry in zip(self.token_ids, self.pieces, entries, strict=True):
            block["token_logprobs"].append(entry[token_id].logprob if entry else None)
            block["top_logprobs"].append(_top(entry) if entry else None)
            block["text_offset"].append(offset)
            offset += len(piece)
        shifted = [o + len(self.text) for o in generated["text_offset"]]
        return {key: block[key] + (shifted if key == "text_offset" else generated[key]) for key in block}


def _top(entry: TokenLogprobs) -> dict[str, float]:
    return {lp.decoded_token: lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank)}
