"""SamplingParams: how to sample one request, validated on construction.

Every value is checked here, integers against a range, so that nothing a caller can send reaches the
engine's tensors out of range: a top_k or seed past int64, or a seed whose derived seed + i (sample i of
n) overflows, once raised inside a step and took every other request down with it.
"""

import math
from dataclasses import dataclass, field

from nanoserve.structured.params import StructuredOutputs

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's limit on each logit_bias value
TOKEN_ID_MAX = 2**31 - 1  # token ids travel as int32 in places; the engine checks them against the vocabulary


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
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # Output constrained to a JSON schema, regex, choice or grammar (a dict is taken as StructuredOutputs' fields).
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - StructuredOutputs.field_names()
            _check(not unknown, "structured_outputs", "unknown fields", sorted(unknown))
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
               "structured_outputs", "must be a StructuredOutputs or a dict of its fields", self.structured_outputs)
        _int("n", self.n, 1, 2**16)
        _float("temperature", self.temperature, 0, math.inf, "must be a finite number >= 0")
        _check(self.top_k == -1 or _is_int(self.top_k) and 1 <= self.top_k <= INT64_MAX,
               "top_k", "must be -1 (off) or an integer >= 1", self.top_k)
        _float("top_p", self.top_p, 0, 1, "must be in (0, 1]")
        _check(self.top_p > 0, "top_p", "must be in (0, 1]", self.top_p)
        _float("min_p", self.min_p, 0, 1, "must be in [0, 1]")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1, INT64_MAX)
        _int("min_tokens", self.min_tokens, 0, INT64_MAX)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               "must be <= max_tokens", self.min_tokens)
        _float("presence_penalty", self.presence_penalty, -2, 2, "must be in [-2, 2]")
        _float("frequency_penalty", self.frequency_penalty, -2, 2, "must be in [-2, 2]")
        _float("repetition_penalty", self.repetition_penalty, 0, math.inf, "must be a finite number > 0")
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0", self.repetition_penalty)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 0, 20)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings", self.stop)
        _check(all(_is_int(t) and 0 <= t <= TOKEN_ID_MAX for t in self.stop_token_ids), "stop_token_ids",
               "must be token ids (integers >= 0)", self.stop_token_ids)
        if self.seed is not None:
            _int("seed", self.seed, INT64_MIN, INT64_MAX)
            # Sample i draws from seed + i (LLMEngine._new_sequence): the last one must fit too.
            _check(self.seed + self.n - 1 <= INT64_MAX, "seed", f"must be <= {INT64_MAX} - (n - 1) with n={self.n}",
                   self.seed)
        bad_keys = [t for t in self.logit_bias or {} if not (_is_int(t) and 0 <= t <= TOKEN_ID_MAX)]
        _check(not bad_keys, "logit_bias", "keys must be token ids", bad_keys)  # every one, fixed in one go
        for bias in (self.logit_bias or {}).values():
            _float("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS,
                   f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(name: str, value: object, lo: int, hi: int) -> None:
    _check(_is_int(value) and lo <= value <= hi, name, f"must be an integer in [{lo}, {hi}]", value)


def _float(name: str, value: object, lo: float, hi: float, rule: str) -> None:
    """A finite real number in [lo, hi] (NaN and infinities would poison every logit of the row)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    _check(ok and lo <= value <= hi, name, rule, value)


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name}: {rule}, got {value!r}")
