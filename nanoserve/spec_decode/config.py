"""SpeculativeConfig: vLLM's speculative_config dict, checked at the edge.

A plain module under the engine's tiers (config.py reads it while validating EngineArgs), so it imports nothing of
nanoserve's.
"""

from dataclasses import dataclass
from typing import Any

# vLLM's keys. ngram, draft_model and eagle3 run; the other methods are named so their refusal is clear.
KNOWN_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "draft_tensor_parallel_size",
    "max_model_len",
    "disable_by_batch_size",
)
LATER_METHODS = ("eagle", "medusa", "mlp_speculator", "mtp", "suffix")
MODEL_METHODS = ("draft_model", "eagle3")  # the methods that load a model of their own
# More than this many drafted tokens per step costs far more verify work than any acceptance pays back.
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: tokens proposed (and verified) per sequence and step, at most
    prompt_lookup_max: int  # the longest n-gram matched against the sequence's earlier tokens
    prompt_lookup_min: int  # the shortest
    model: str | None = None  # draft_model, eagle3: the draft's (the head's) checkpoint directory

    @classmethod
    def from_dict(cls, raw: Any) -> "SpeculativeConfig":
        """vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
        "prompt_lookup_min": m} (without either lookup bound both are 5; with one, the other equals it, as vLLM's)
        or {"model": DIR, "num_speculative_tokens": k} ("method": "draft_model" optional) or
        {"method": "eagle3", "model": DIR, "num_speculative_tokens": k}."""
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config: must be a dict (JSON object), got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(KNOWN_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(KNOWN_KEYS)})")
        method = raw.get("method")
        if method is None and "model" in raw:
            method = "draft_model"  # vLLM's: a model without a method is a draft model
        if method in LATER_METHODS:
            raise ValueError(
                f"speculative_config.method: {method!r} is not supported yet; 'ngram', 'draft_model' and 'eagle3' run"
            )
        if method not in ("ngram", *MODEL_METHODS):
            raise ValueError(f"speculative_config.method: must be 'ngram', 'draft_model' or 'eagle3', got {method!r}")
        for key in ("max_model_len", "disable_by_batch_size"):
            if raw.get(key) is not None:
                raise ValueError(f"speculative_config.{key}: not supported yet")
        if method == "ngram" and raw.get("model") is not None:
            raise ValueError("speculative_config.model: method 'ngram' takes no model")
        if method == "ngram" and raw.get("draft_tensor_parallel_size") is not None:
            raise ValueError("speculative_config.draft_tensor_parallel_size: not supported with method 'ngram'")
        if method in MODEL_METHODS:
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                if raw.get(key) is not None:
                    raise ValueError(f"speculative_config.{key}: only for method 'ngram'")
            if raw.get("draft_tensor_parallel_size") not in (None, 1):
                raise ValueError("speculative_config.draft_tensor_parallel_size: only 1 is supported")
            model = raw.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(f"speculative_config.model: a draft model's directory is required, got {model!r}")
        k = _int(raw, "num_speculative_tokens", None)
        if k is None:
            raise ValueError("speculative_config.num_speculative_tokens: required")
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens: must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"
            )
        high, low = _int(raw, "prompt_lookup_max", None), _int(raw, "prompt_lookup_min", None)
        if high is None and low is None:
            high = low = 5
        high = low if high is None else high
        low = high if low is None else low
        if low < 1:
            raise ValueError(f"speculative_config.prompt_lookup_min: must be >= 1, got {low}")
        if high < low:
            raise ValueError(f"speculative_config.prompt_lookup_max: must be >= prompt_lookup_min ({low}), got {high}")
        if method in MODEL_METHODS:
            return cls(method, k, 0, 0, raw["model"])
        return cls("ngram", k, high, low)


def _int(raw: dict, key: str, default: int | None) -> int | None:
    value = raw.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"speculative_config.{key}: must be an integer, got {value!r}")
    return value
