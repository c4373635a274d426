"""POST /v1/chat/completions: a conversation rendered by the model's chat template, n choices.

A stream opens each choice with a chunk carrying the assistant role (as OpenAI does), then content
deltas, with finish_reason on the choice's last chunk.

On a model with the tool-use special tokens (the bundled one), chat requests without `tools` run under the
calculator tool loop (chat_engine.ToolLoop, inside the engine's step): the tool's output is forced into the
sample and streamed like sampled text, in chunks of its own whose delta says "tool_output": true.

With `tools` (ToolMode): tool_choice "required" or a named function constrains the reply with a grammar
(structured/tools.py) and reads it back as calls; "auto" (needs --enable-auto-tool-choice and a
--tool-call-parser, or the bundled model, whose calculator calls are read by the nanochat parser) reads the
model's own format with the parser, and with a tool marked `strict` holds the reply to a grammar of free text or
calls in that format (a parser whose format cannot: 400 naming the tool's `strict`). The message then carries
`tool_calls`, and finish_reason is "tool_calls" (a named function keeps "stop", as OpenAI does). A stream sends
content until the tool-call section starts, then each call's first delta (index, id, type, name) as its arguments
begin and their pieces as they are written (hermes, llama3_json, mistral, "required", named; the other parsers'
calls come whole once complete).
"""

import dataclasses
import functools
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.chat_engine import ToolLoop, ToolTokens
from nanoserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.sampling_params import SamplingParams
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
from nanoserve.structured.tool_parsers import PARSERS, ParsedReply, ToolParser
from nanoserve.structured.tool_parsers.grammar import Markers
from nanoserve.structured.tools import (
    ToolCallStream,
    forced_parser,
    strict_auto_constraint,
    tool_choice_constraint,
)

# Chat request ids start with this (ServingBase.start adds "-<hex>-<i>"); the tool loop tracks exactly these.
ID_PREFIX = "chatcmpl"


@dataclass
class ToolMode:
    """How one request's reply is read back as tool calls: by the model's format's parser ("auto"), or as the JSON a
    tool_choice grammar forced ("required", or a named function: tools.forced_parser)."""

    tool_choice: str | dict
    parser: ToolParser

    @property
    def auto(self) -> bool:
        return self.tool_choice == "auto"

    def finish_reason(self, reply: ParsedReply, finish_reason: str | None) -> str | None:
        named = isinstance(self.tool_choice, dict)
        return "tool_calls" if reply.tool_calls and finish_reason == "stop" and not named else finish_reason


class ServingChat(ServingBase):
    def __init__(self, engine: AsyncEngine, model_names: list[str], metrics: ServerMetrics,
                 max_waiting_requests: int | None, log_requests: bool = False, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False) -> None:
        """tool_call_parser: a name in structured.tool_parsers.PARSERS; with enable_auto_tool_choice, tool_choice
        "auto" reads replies with it. On a model with the calculator's tokens (the bundled one) both default to on,
        with the nanochat parser."""
        super().__init__(engine, model_names, metrics, max_waiting_requests, log_requests)
        # The tool loop is a step hook, so it is installed where the engine runs (its thread, or its
        # process), before any chat request; a model without the tool tokens gets none.
        engine.setup(functools.partial(ToolLoop.attach, prefix=ID_PREFIX + "-"))
        tokenizer = engine.engine.tokenizer
        self.tool_tokens = ToolTokens.from_tokenizer(tokenizer)
        if tool_call_parser is None and self.tool_tokens is not None:
            tool_call_parser, enable_auto_tool_choice = "nanochat", True
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser: one of {', '.join(PARSERS)}, got {tool_call_parser!r}")
        self.parser_class = PARSERS[tool_call_parser] if tool_call_parser is not None else None
        self.auto_tools = enable_auto_tool_choice and self.parser_class is not None
        self.special_tokens = list(getattr(tokenizer, "all_special_tokens", []) or [])
        # Added tokens by text: a strict grammar names a marker that is one by its id (tool_parsers/grammar.py).
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.markers = Markers({token.content: token_id for token_id, token in added.items()},
                               engine.engine.config.model.eos_token_ids)

    def tool_mode(self, req: ChatCompletionRequest) -> ToolMode | None:
        """How the reply is read back as calls (None: plain content); 400 naming the field for a bad combination."""
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if not req.tools:
            if choice != "none":
                raise APIError(400, "tool_choice: needs tools", "tool_choice")
            return None
        if choice == "none":
            return None
        names = [t.function.name for t in req.tools]
        if not isinstance(choice, str) and choice.function.name not in names:
            raise APIError(400, f"tool_choice: function {choice.function.name!r} is not among tools "
                                f"({', '.join(names)})", "tool_choice")
        if choice == "auto":
            if not self.auto_tools:
                raise APIError(400, 'tool_choice: "auto" needs the server started with --enable-auto-tool-choice '
                                    'and --tool-call-parser', "tool_choice")
            strict = next((i for i, t in enumerate(req.tools) if t.function.strict), None)
            if strict is not None and _constrained(req):
                raise APIError(400, f"tools.{strict}.function.strict: a strict tool under tool_choice \"auto\" "
                                    "constrains the reply itself; it cannot go with response_format or "
                                    "structured_outputs", f"tools.{strict}.function.strict")
            return ToolMode("auto", self.parser_class(self.special_tokens))
        if _constrained(req):
            raise APIError(400, f"tool_choice: {choice if isinstance(choice, str) else 'a named function'} "
                                "constrains the reply itself; it cannot go with response_format or "
                                "structured_outputs", "tool_choice")
        tool_choice = choice if isinstance(choice, str) else choice.model_dump()
        return ToolMode(tool_choice, forced_parser(tool_choice))

    def tool_params(self, params: SamplingParams, mode: ToolMode, req: ChatCompletionRequest) -> SamplingParams:
        """The request's SamplingParams as its tool mode needs them (a constraint, special tokens, a stop)."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        changes = {}
        try:
            if mode.auto:
                constraint = strict_auto_constraint(tools, mode.parser, req.parallel_tool_calls, self.markers)
            else:
                constraint = tool_choice_constraint(tools, mode.tool_choice, req.parallel_tool_calls)
        except ValueError as exc:
            raise bad_request(exc) from None
        if constraint is not None:
            changes["structured_outputs"] = constraint
        if mode.auto and (mode.parser.needs_special_tokens or set(mode.parser.markers) & set(self.special_tokens)):
            changes["skip_special_tokens"] = False  # its markers are special tokens
        if mode.parser.name == "nanochat" and self.tool_tokens is not None:
            # The call ends the reply: the client runs the calculator and sends its result as a tool message.
            changes["stop_token_ids"] = [*params.stop_token_ids, self.tool_tokens.python_end]
        return dataclasses.replace(params, **changes) if changes else params

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
        mode = self.tool_mode(req)
        if mode is not None:
            params = self.tool_params(params, mode, req)
        messages = [m.for_template() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            prompt_ids = await self.engine.apply_chat_template(messages, req.add_generation_prompt, tools)
        except ValueError as exc:
            raise bad_request(exc) from None
        self.check_prompt(prompt_ids, max_tokens, param="messages")
        gen = self.start(ID_PREFIX, [prompt_ids], params, model, arrival)
        if req.stream:
            chunks = ChatChunks(gen, req.include_usage, req.top_logprobs or 0, mode)
            return EngineStreamResponse(lambda send: self.stream(gen, chunks, send), lambda: self.close(gen))
        finals = await run_until_disconnected(raw, self.collect(gen), lambda: self.close(gen))
        return JSONResponse(self._response(gen, finals, req, mode))

    def _response(self, gen: Generation, finals: dict, req: ChatCompletionRequest, mode: ToolMode | None) -> dict:
        choices = []
        for prompt_index, out in finals.items():
            for c in out.outputs:
                block = (_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                         if c.logprobs is not None else None)
                # Under the tool loop the text shows each calculator call and its result with markers
                # (chat_engine.TOOL_MARKERS), as the stream's deltas do, until tool calls get OpenAI's shape.
                message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
                if mode is not None:
                    reply = mode.parser.parse(c.text)
                    message["content"] = reply.content
                    if reply.tool_calls:
                        message["tool_calls"] = [call.to_dict() for call in reply.tool_calls]
                    finish_reason = mode.finish_reason(reply, c.finish_reason)
                choices.append({"index": gen.choice_index(prompt_index, c.index), "message": message,
                                "logprobs": block, "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        choices.sort(key=lambda ch: ch["index"])
        return {"id": gen.response_id, "object": "chat.completion", "created": gen.created,
                "model": gen.model, "choices": choices, "usage": gen.usage(finals).to_dict()}


def _constrained(req: ChatCompletionRequest) -> bool:
    """Whether the request holds its reply to a format of its own (response_format or structured_outputs)."""
    return req.response_format is not None and req.response_format.type != "text" or bool(req.structured_outputs)


def _all_forced(c: CompletionOutput, start: int) -> bool:
    """Whether the tokens of `c` from `start` on were all forced by the tool loop. The loop hands
    forced tokens over in an output of their own, so a delta is all forced or all sampled."""
    masks = getattr(c, "token_masks", None)  # only on ToolCompletionOutput
    return masks is not None and not any(masks[start:])


class ChatChunks:
    """A chat stream's chunks (StreamChunks): {"id", "object": "chat.completion.chunk", "created", "model",
    "choices": [{"index", "delta", "logprobs", "finish_reason"}]}, one choice per chunk."""

    def __init__(self, gen: Generation, include_usage: bool, top_logprobs: int, mode: ToolMode | None = None) -> None:
        self.gen = gen
        self.head = ChunkHead(gen.response_id, "chat.completion.chunk", gen.created, gen.model)
        self.include_usage = include_usage
        self.top_logprobs = top_logprobs
        self.mode = mode
        self.tool_streams: dict[int, ToolCallStream] = {}  # choice index -> its reading

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
            if self.mode is not None:
                text_out += self.tool_chunks(index, c)
                continue
            block = _logprobs(ids, logprobs, self.top_logprobs) if logprobs is not None else None
            if ids and _all_forced(c, start):
                delta = json_value({"content": text, "tool_output": True} if text else {"tool_output": True})
            else:
                delta = f'{{"content": {json_str(text)}}}' if text else "{}"
            text_out += self.chunk(index, delta, block, c.finish_reason)
        return text_out

    def tool_chunks(self, index: int, c: CompletionOutput) -> str:
        """A choice's chunks under a tool mode: content deltas, then per call a first delta and argument pieces,
        one chunk per call that moved (logprobs are not sent in this mode)."""
        stream = self.tool_streams.get(index)
        if stream is None:
            stream = self.tool_streams[index] = ToolCallStream(self.mode.parser)
        final = c.finish_reason is not None
        content, calls = stream.update(c.text, final)
        out = self.chunk(index, '{"content": ' + json_str(content) + "}", None, None) if content else ""
        for delta in calls:
            out += self.chunk(index, json_value({"tool_calls": [delta]}), None, None)
        if final:
            out += self.chunk(index, "{}", None, self.mode.finish_reason(stream.reply, c.finish_reason))
        return out

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
