"""Where a step's time goes, on the GPU: host time vs kernel time for the three step shapes that the
benchmarks care about (uncached 2,100-token prefill, 100-token prefill over a 2,000-token cached prefix,
batch-1 decode), with the top kernels by device time and the top host functions.

    python scripts/profile_steps.py --model shared/bench-configs/qwen3-0.6b
"""

import argparse
import gc
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams


def summarize(name: str, prof, iters: int, wall_s: float) -> None:
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / iters
    launches = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / iters
    print(f"\n=== {name}: wall {1e3 * wall_s / iters:.2f} ms/iter, kernels {device_us / 1e3:.2f} ms/iter, "
          f"{launches:.0f} device events/iter")
    print(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


def run(name: str, fn, iters: int) -> None:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    summarize(name, prof, iters, wall)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    print(f"{name}: without the profiler {1e3 * (time.perf_counter() - start) / iters:.2f} ms/iter")


def profile_engine(model: str, caching: bool, rng: np.random.Generator) -> None:
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm = LLM(model=model, load_format="dummy", dtype="bfloat16", max_model_len=4096,
              enable_prefix_caching=caching)
    vocab = llm.engine.config.model.vocab_size
    shared = rng.integers(0, vocab, 2000).tolist()
    llm.generate([shared + [1] * 100], one, use_tqdm=False)

    def prefill():
        llm.generate([shared + rng.integers(0, vocab, 100).tolist()], one, use_tqdm=False)

    run(f"prefill 2100 tokens, prefix caching {caching}", prefill, 5)
    if caching:
        return
    engine = llm.engine

    def decode20():
        engine.add_request(str(rng.integers(1 << 40)), shared[:128],
                           SamplingParams(temperature=0, max_tokens=21, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()

    run("batch-1: one 128-token prefill + 20 decode steps", decode20, 3)


def profile_big_batch(model: str, rng: np.random.Generator) -> None:
    """The throughput recipe's steady state: 256 sequences of 100..1024 prompt tokens decoding."""
    llm = LLM(model=model, load_format="dummy", dtype="bfloat16")
    engine = llm.engine
    vocab = engine.config.model.vocab_size
    for i in range(256):
        engine.add_request(f"big-{i}", rng.integers(0, vocab, int(rng.integers(100, 1025))).tolist(),
                           SamplingParams(temperature=0.6, max_tokens=200, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    run("batch-256 decode, 20 steps", lambda: [engine.step() for _ in range(20)], 2)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)


def profile_prefill_phase(model: str) -> None:
    """The throughput recipe's first 30 steps: 8,192-token prefill steps, then mixed ones as decodes join."""
    from nanoserve.bench.throughput import workload

    llm = LLM(model=model, load_format="dummy", dtype="bfloat16")
    engine = llm.engine
    prompts, out_lens = workload(256, 100, 1024, 100, 1024, engine.config.model.vocab_size, 0)
    llm.generate(prompts[:8], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    for i, (prompt, n) in enumerate(zip(prompts, out_lens, strict=True)):
        engine.add_request(f"tp-{i}", prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(30):
            engine.step(final_only=True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    summarize("throughput recipe, first 30 steps (prefill and mixed)", prof, 30, wall)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--parts", default="prefill-phase,big-batch,uncached,cached",
                   help="comma-separated: prefill-phase, big-batch, uncached (2,100-token prefill and batch-1 "
                        "decode), cached (100 tokens over a cached 2,000-token prefix)")
    ns = p.parse_args()
    parts = set(ns.parts.split(","))
    rng = np.random.default_rng(0)
    if "prefill-phase" in parts:
        profile_prefill_phase(ns.model)
        gc.collect()
        torch.cuda.empty_cache()
    if "big-batch" in parts:
        profile_big_batch(ns.model, rng)
        gc.collect()
        torch.cuda.empty_cache()
    for caching in (False, True):
        if ("cached" if caching else "uncached") not in parts:
            continue
        profile_engine(ns.model, caching, rng)
        gc.collect()  # the engine's objects refer to each other: only gc gives its memory back
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
