"""What the engine hands back: RequestOutput holds one CompletionOutput per sample."""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


# One entry per generated token: token id -> Logprob, holding the sampled token and the top-N.
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (RequestOutput.error says why)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ToolCompletionOutput(CompletionOutput):
    """A CompletionOutput of a request under the calculator tool loop (chat_engine.ToolLoop), with one mask
    per token id."""

    token_masks: list[int] = field(default_factory=list)  # 1: sampled, 0: forced by the tool


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    error: str | None = None  # set when the engine failed this request alone (its samples end with "error")
