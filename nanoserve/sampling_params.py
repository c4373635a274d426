"""SamplingParams: how to sample one request, validated on construction."""

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None: the rest of the model's context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        _check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1", self.n)
        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
               "top_k", "must be -1 (off) or an integer >= 1", self.top_k)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", "must be an integer >= 1", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0",
               self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               "must be <= max_tokens", self.min_tokens)
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]",
               self.presence_penalty)
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]",
               self.frequency_penalty)
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0", self.repetition_penalty)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= 20), name,
                   "must be an integer in [0, 20]", value)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings",
               self.stop)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name}: {rule}, got {value!r}")
