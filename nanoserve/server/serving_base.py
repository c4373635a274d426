"""What completions and chat share: checking a request against the model, turning prompts into
engine requests, and turning the engine's cumulative outputs into per-choice deltas.

The engine reports each sample's text, token ids and logprobs cumulatively; a stream sends only what
is new since the last chunk, so `ChoiceState` remembers how much of each choice was sent.

A stream's body is written by one coroutine (ServingBase.stream) that reads the engine outputs, feeds
the metrics, and has a StreamChunks turn each output into SSE text: every chunk an output makes goes out
in one write, and the last output's chunks go out with the usage chunk and [DONE].
"""

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from starlette.types import Send

from nanoserve.engine.frontend import check_token_ids
from nanoserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from nanoserve.runtime.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, RequestGroup
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.errors import APIError, bad_request, error_body
from nanoserve.server.metrics import RequestTracker, ServerMetrics
from nanoserve.server.protocol import SamplingFields
from nanoserve.server.streaming import SSE_DONE, sse

logger = logging.getLogger(__name__)


@dataclass
class ChoiceState:
    """How much of one choice has been sent so far."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False

    def delta(self, c: CompletionOutput) -> tuple[str, list[int], list[TokenLogprobs] | None]:
        text, ids = c.text[self.text_len:], c.token_ids[self.num_tokens:]
        logprobs = c.logprobs[self.num_tokens:] if c.logprobs is not None else None
        self.text_len, self.num_tokens = len(c.text), len(c.token_ids)
        self.finished = c.finish_reason is not None
        return text, ids, logprobs


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Generation:
    """One HTTP request's engine work in flight: its id, prompts and merged outputs."""

    response_id: str
    created: int
    model: str
    prompts: list[list[int]]
    n: int
    group: RequestGroup
    tracker: RequestTracker
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    arrival: float = field(default_factory=time.monotonic)  # when the HTTP request came in

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.n + sample_index

    def usage(self, finals: dict[int, RequestOutput]) -> Usage:
        usage = Usage(prompt_tokens=sum(len(p) for p in self.prompts))
        for out in finals.values():
            usage.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
            usage.cached_tokens += out.num_cached_tokens
        return usage

    def usage_chunk(self, obj: str, finals: dict[int, RequestOutput]) -> str:
        """The stream's closing chunk that stream_options.include_usage asks for."""
        return sse({"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                    "choices": [], "usage": self.usage(finals).to_dict()})


class ServingBase:
    def __init__(self, engine: AsyncEngine, model_names: list[str], metrics: ServerMetrics,
                 max_waiting_requests: int | None, log_requests: bool = False) -> None:
        """model_names: the names this server answers to, the first the default; log_requests: one INFO line
        per request when it is over."""
        self.engine = engine
        self.model_names = model_names
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.log_requests = log_requests

    def check_model(self, model: str | None) -> str:
        """The served name a request asked for (the first one if it named none): its response echoes it."""
        if model is None:
            return self.model_names[0]
        if model not in self.model_names:
            served = ", ".join(repr(name) for name in self.model_names)
            raise APIError(404, f"model: {model!r} is not served here; this server serves {served}", "model",
                           "model_not_found")
        return model

    def check_stream_options(self, req: SamplingFields) -> None:
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options: only allowed with stream=true", "stream_options")

    def check_capacity(self, num_prompts: int) -> None:
        """503 if the engine has died; 400 if the queue could never take this many prompts, 429 if it cannot now.
        Called before the prompts are tokenized (to spare the work) and again, with no await before the submit,
        by start()."""
        if self.engine.dead:
            # Before the queue check: a dead engine's last stats still count the requests it failed, so the queue
            # would look full for good and clients would retry a dead server forever.
            raise APIError(503, self.engine.error, code="engine_dead")
        limit = self.max_waiting_requests
        if limit is None:
            return
        if num_prompts > limit:
            raise APIError(400, f"prompt: {num_prompts} prompts in one request, over the server's limit of "
                                f"{limit} waiting requests", "prompt")
        waiting = self.engine.num_waiting
        if waiting + num_prompts > limit:
            raise APIError(429, f"{waiting} requests are waiting to run and this one adds {num_prompts} (limit "
                                f"{limit}); retry later", code="too_many_waiting_requests")

    def check_prompt(self, prompt_ids: list[int], max_tokens: int | None, param: str = "prompt") -> None:
        limit = self.engine.max_model_len
        if len(prompt_ids) >= limit:  # here, not left to validate_prompt, to carry OpenAI's code for it
            raise APIError(400, f"{param}: {len(prompt_ids)} tokens leave no room to generate in the model's context "
                                f"of {limit} tokens", param, "context_length_exceeded")
        try:
            self.engine.engine.validate_prompt(prompt_ids)
        except ValueError as exc:
            raise APIError(400, str(exc).replace("prompt:", f"{param}:", 1), param) from None
        if max_tokens is not None and len(prompt_ids) + max_tokens > limit:
            raise APIError(400, f"max_tokens: the prompt has {len(prompt_ids)} tokens and max_tokens is "
                                f"{max_tokens}, {len(prompt_ids) + max_tokens} in all, over the model's "
                                f"context of {limit} tokens", "max_tokens", "context_length_exceeded")

    def sampling_params(self, build: Callable[[], SamplingParams]) -> SamplingParams:
        """SamplingParams from build(), plus the limits only the engine knows; 400 naming the field."""
        try:
            params = build()
        except ValueError as exc:
            raise bad_request(exc) from None
        config = self.engine.engine.config
        if params.n > config.args.max_num_seqs:
            # The scheduler runs all n samples of a request together: more could never be scheduled.
            raise APIError(400, f"n: at most {config.args.max_num_seqs} (the server's max_num_seqs), "
                                f"got {params.n}", "n")
        vocab = config.model.vocab_size
        try:
            check_token_ids("stop_token_ids", params.stop_token_ids, vocab)
            check_token_ids("logit_bias", params.logit_bias or (), vocab)
        except ValueError as exc:
            raise bad_request(exc) from None
        return params

    def start(self, prefix: str, prompts: list[list[int]], params: SamplingParams, model: str,
              arrival: float) -> Generation:
        """Submit one engine request per prompt; raises 429 / 503 at once when it cannot run.
        No await between the check and the submit, so concurrent handlers cannot both slip in.
        `model`: the name the response echoes; `arrival`: time.monotonic() when the request came in."""
        self.check_capacity(len(prompts))
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        requests = [(f"{response_id}-{i}", ids, params) for i, ids in enumerate(prompts)]
        try:
            group = self.engine.submit(requests)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        return Generation(response_id, int(time.time()), model, prompts, params.n, group,
                          self.metrics.tracker(params), arrival=arrival)

    def close(self, gen: Generation) -> None:
        """The HTTP side is done with `gen` (finished, client gone, or failed): abort what still runs."""
        gen.tracker.flush()
        aborted = gen.group.abort()
        if aborted:  # their last outputs have no reader, so the tracker never sees them finish
            self.metrics.count_finished("abort", aborted * gen.n)
        if self.log_requests:
            _log_request(gen, aborted * gen.n)

    async def collect(self, gen: Generation) -> dict[int, RequestOutput]:
        """Every prompt's final output. Engine failure becomes a 500 in OpenAI's shape."""
        finals: dict[int, RequestOutput] = {}
        try:
            async for prompt_index, out in gen.group:
                gen.tracker.observe(out)
                if out.finished:
                    finals[prompt_index] = out
        except EngineDeadError as exc:
            raise APIError(500, str(exc), code="engine_dead") from None
        except RequestFailedError as exc:
            raise APIError(500, f"the request failed in the engine: {exc}", code="request_failed") from None
        except ValueError as exc:  # the engine refused the request after the edge checks passed
            raise bad_request(exc) from None
        return finals

    async def stream(self, gen: Generation, chunks: "StreamChunks", send: Send) -> None:
        """Send a streamed request's SSE body, ending with [DONE] in the message that has more_body=False; an
        engine failure mid-stream becomes an error event, so the client raises instead of waiting forever. A
        coroutine, not an async generator of the body's parts: each layer of those costs a good part of what
        sending a chunk does."""
        finals: dict[int, RequestOutput] = {}
        last = ""  # the final output's chunks, held to go out in one write with the end of the stream
        try:
            async for prompt_index, out in gen.group:
                gen.tracker.observe(out)
                text = chunks.render(prompt_index, out)
                if out.finished:
                    finals[prompt_index] = out
                    if len(finals) == len(gen.prompts):
                        last = text
                        continue
                if text:
                    await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
            last += chunks.end(gen, finals)
        except OSError:
            raise  # a send failed, the client is gone: no one to tell
        except EngineDeadError as exc:
            last += sse(error_body(500, str(exc), code="engine_dead"))
        except RequestFailedError as exc:
            last += sse(error_body(500, f"the request failed in the engine: {exc}", code="request_failed"))
        except ValueError as exc:  # the engine refused the request after the edge checks passed
            last += sse(bad_request(exc).to_dict())
        except Exception as exc:  # a bug here must still end the stream with an error, not a cut
            logger.exception("stream failed")
            last += sse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"))
        await send({"type": "http.response.body", "body": (last + SSE_DONE).encode(), "more_body": False})


def _log_request(gen: Generation, num_aborted: int) -> None:
    """One line for a request that is over: its finish reasons, one per sample ("stop x3, length" for four)."""
    reasons = Counter(gen.tracker.finish_reasons + ["abort"] * num_aborted)
    logger.info("request %s: %d prompt tokens, %d generated, finish_reason %s, %.3f s", gen.response_id,
                sum(len(p) for p in gen.prompts), gen.tracker.generated_tokens,
                ", ".join(f"{r} x{k}" if k > 1 else r for r, k in sorted(reasons.items())) or "none",
                time.monotonic() - gen.arrival)


class StreamChunks(Protocol):
    """Turns one streamed request's engine outputs into SSE text."""

    def render(self, prompt_index: int, out: RequestOutput) -> str:
        """The chunks for what `out` adds (possibly none: "")."""

    def end(self, gen: Generation, finals: dict[int, RequestOutput]) -> str:
        """What follows the last output's chunks, before [DONE] (the usage chunk, when asked for)."""
