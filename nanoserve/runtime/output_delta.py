"""Request outputs as deltas, to cross from the engine core process to the server.

The engine hands out cumulative RequestOutputs (every token id, the whole text and every logprob so
far), and the serving code is written against them. Sending those across a pipe every step would pickle
O(n) per request per step, O(n^2) over a request's life; so the engine core process sends only what each
request got since the last step (DeltaEncoder), and the server rebuilds the cumulative outputs from
those (OutputAssembler). The rebuilt outputs equal the engine's, field for field, with one exception:
`prompt` is None (the server always submits token ids, and keeps them).

Text only grows: the detokenizer shows a prefix of a growing string (a possible stop string is held
back, then cut before it was ever shown), so a text delta is what lies past the length sent before.
"""

import dataclasses
from dataclasses import dataclass, field

from nanoserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs, ToolCompletionOutput

# The deltas are plain tuples, not dataclasses: pickle writes and reads a tuple several times faster than
# an object, and with hundreds of requests a step that is most of what a step's message costs.
#
# What one sample (CompletionOutput) got since the last delta of its request:
#   (index, new token ids, new text, new logprobs (None: not asked for), new tool-loop token masks (None: a
#    plain CompletionOutput, not a ToolCompletionOutput), cumulative_logprob, finish_reason, stop_reason)
SampleDelta = tuple[int, list[int], str, list[TokenLogprobs] | None, list[int] | None, float | None, str | None,
                    int | str | None]
# What one request got: (request_id, a SampleDelta for every sample of the request in index order,
#   finished, num_cached_tokens, new prompt logprobs (they come per prefill chunk; None: none new or not
#   asked for), the RequestMetrics when they changed (first scheduled, first token, finished) or None)
RequestDelta = tuple[str, list[SampleDelta], bool, int, list[TokenLogprobs | None] | None, RequestMetrics | None]


@dataclass(slots=True)
class _SentSample:
    num_tokens: int = 0
    text_len: int = 0


@dataclass(slots=True)
class _SentRequest:
    samples: list[_SentSample] = field(default_factory=list)
    num_prompt_logprobs: int = 0
    metrics: tuple | None = None


class DeltaEncoder:
    """The engine side: remembers how much of each live request was sent."""

    def __init__(self) -> None:
        self._sent: dict[str, _SentRequest] = {}

    def encode(self, outputs: list[RequestOutput]) -> list[RequestDelta]:
        return [self._encode(out) for out in outputs]

    def forget(self, request_id: str) -> None:
        """Drop what was sent of a request that ends without a last output (it failed)."""
        self._sent.pop(request_id, None)

    def _encode(self, out: RequestOutput) -> RequestDelta:
        sent = self._sent.setdefault(out.request_id, _SentRequest())
        samples = []
        for c in out.outputs:
            while len(sent.samples) <= c.index:  # n > 1: samples are forked in after the prompt's prefill
                sent.samples.append(_SentSample())
            s = sent.samples[c.index]
            n = s.num_tokens
            samples.append((c.index, c.token_ids[n:], c.text[s.text_len:],
                            c.logprobs[n:] if c.logprobs is not None else None,
                            c.token_masks[n:] if isinstance(c, ToolCompletionOutput) else None,
                            c.cumulative_logprob, c.finish_reason, c.stop_reason))
            s.num_tokens, s.text_len = len(c.token_ids), len(c.text)
        prompt_logprobs = None
        if out.prompt_logprobs is not None and len(out.prompt_logprobs) > sent.num_prompt_logprobs:
            prompt_logprobs = out.prompt_logprobs[sent.num_prompt_logprobs:]
            sent.num_prompt_logprobs = len(out.prompt_logprobs)
        metrics = None
        if out.metrics is not None:
            m = out.metrics
            key = (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time)
            if key != sent.metrics:
                metrics, sent.metrics = m, key
        if out.finished:  # its last output: nothing more will be sent for it
            del self._sent[out.request_id]
        return (out.request_id, samples, out.finished, out.num_cached_tokens, prompt_logprobs, metrics)


@dataclass(slots=True)
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    token_masks: list[int] | None = None


class OutputAssembler:
    """The server side, one per request: applies its deltas in order and returns the cumulative outputs."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.samples: list[_Sample] = []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.metrics: RequestMetrics | None = None

    def apply(self, delta: RequestDelta) -> RequestOutput:
        request_id, sample_deltas, finished, num_cached_tokens, prompt_logprobs, metrics = delta
        completions = []
        for index, token_ids, text, logprobs, token_masks, cumulative_logprob, finish_reason, stop_reason \
                in sample_deltas:
            while len(self.samples) <= index:
                self.samples.append(_Sample())
            s = self.samples[index]
            # New lists, never appended to: an output may wait in its stream (tool-loop outputs are never
            # merged) while later deltas are applied, and must still show only what it had.
            s.token_ids = s.token_ids + token_ids
            s.text += text
            if logprobs is not None:
                s.logprobs = (s.logprobs or []) + logprobs
            fields = (index, s.text, s.token_ids, cumulative_logprob, s.logprobs, finish_reason, stop_reason)
            if token_masks is None:
                completions.append(CompletionOutput(*fields))
            else:
                s.token_masks = (s.token_masks or []) + token_masks
                completions.append(ToolCompletionOutput(*fields, token_masks=s.token_masks))
        if prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or []) + prompt_logprobs
        if metrics is not None:
            # One object for the request's life, updated in place, as the engine's own outputs share it.
            if self.metrics is None:
                self.metrics = metrics
            else:
                for f in dataclasses.fields(RequestMetrics):
                    setattr(self.metrics, f.name, getattr(metrics, f.name))
        return RequestOutput(request_id, None, self.prompt_token_ids, completions, finished,
                             prompt_logprobs=self.prompt_logprobs, num_cached_tokens=num_cached_tokens,
                             metrics=self.metrics)
