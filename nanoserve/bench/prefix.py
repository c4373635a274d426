"""Prefix caching: time to first token with a long shared system prompt, with and without the cache.

    nanoserve bench prefix --model DIR

DIR: a model directory; with only a config.json in it, the weights are random (--load-format dummy).
Requests arrive one at a time (so TTFT is the prefill alone, not queueing); the first one warms the cache.
"""

import time

import numpy as np

from nanoserve.args import at_least_one
from nanoserve.bench.common import emit, engine_args, engine_facts, free_device_memory, parser
from nanoserve.bench.lengths import fit_lengths
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

# On a model with a shorter context both are scaled down (bench/lengths.py).
RECIPE = {"shared_len": 2000, "suffix_len": 100}


def ttfts(llm: LLM, prompts: list[list[int]]) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = []
    for prompt in prompts:
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        out.append(time.perf_counter() - start)
    return out


def prefix_prompts(vocab_size: int, shared_len: int, suffix_len: int, n: int, seed: int) -> list[list[int]]:
    """n prompts of random token ids: one shared prefix, then a unique suffix each."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab_size, shared_len).tolist()
    return [shared + rng.integers(0, vocab_size, suffix_len).tolist() for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = parser("prefix", __doc__)
    p.add_argument("--num-requests", type=int, default=200, help="requests timed, one at a time")
    p.add_argument("--shared-len", type=at_least_one, default=None,
                   help="tokens of the prefix every prompt shares; None: 2000, scaled down with --suffix-len where "
                        "the model's context is shorter than both")
    p.add_argument("--suffix-len", type=at_least_one, default=None,
                   help="tokens of each prompt's own suffix; None: 100, as --shared-len")
    ns = p.parse_args(argv)
    result = {"bench": "prefix", "num_requests": ns.num_requests}
    for caching in (False, True):
        ns.enable_prefix_caching = caching
        llm = LLM(**vars(engine_args(ns)))
        if not caching:  # each request generates one token
            cfg = llm.engine.config
            fit_lengths(ns, RECIPE, lambda n: n["shared_len"] + n["suffix_len"] + 1, cfg.max_model_len, "prefix")
            result |= {"shared_len": ns.shared_len, "suffix_len": ns.suffix_len, **engine_facts(cfg)}
        prompts = prefix_prompts(llm.engine.config.model.vocab_size, ns.shared_len, ns.suffix_len,
                                 ns.num_requests + 1, ns.seed)
        times = ttfts(llm, prompts)[1:]  # the first request fills the cache (and warms up)
        key = "cached" if caching else "uncached"
        result |= {f"ttft_{key}_mean_ms": round(1e3 * float(np.mean(times)), 2),
                   f"ttft_{key}_p50_ms": round(1e3 * float(np.median(times)), 2),
                   f"ttft_{key}_p99_ms": round(1e3 * float(np.percentile(times, 99)), 2),
                   f"ttft_{key}_max_ms": round(1e3 * float(np.max(times)), 2)}
        del llm
        free_device_memory()
    result["ratio"] = round(result["ttft_cached_mean_ms"] / result["ttft_uncached_mean_ms"], 3)
    # Means are what the target names; medians show whether a few slow requests moved them.
    result["ratio_p50"] = round(result["ttft_cached_p50_ms"] / result["ttft_uncached_p50_ms"], 3)
    emit(result)
    return 0
