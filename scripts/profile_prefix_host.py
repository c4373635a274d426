"""Where a cached prefix request's host time goes: bench prefix's cached requests (2,000 shared tokens + 100 new,
one token out, one request at a time) after a warm-up, under cProfile; time spent waiting for the GPU shows as
the synchronizing calls (item, tolist, synchronize), the rest is host work on the request's critical path.

    python scripts/profile_prefix_host.py --model shared/bench-configs/qwen3-0.6b [--num-requests 100]
"""

import argparse
import cProfile
import pstats
import time

import numpy as np

from nanoserve.bench.prefix import prefix_prompts
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--device", default="auto")
    ns = p.parse_args()
    llm = LLM(model=ns.model, load_format="dummy", dtype="bfloat16", max_model_len=4096, device=ns.device)
    prompts = prefix_prompts(llm.engine.config.model.vocab_size, 2000, 100, ns.num_requests + 10, seed=0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for prompt in prompts[:10]:
        llm.generate([prompt], params, use_tqdm=False)
    times = []
    profiler = cProfile.Profile()
    for prompt in prompts[10:]:
        start = time.perf_counter()
        profiler.enable()
        llm.generate([prompt], params, use_tqdm=False)
        profiler.disable()
        times.append(time.perf_counter() - start)
    print(f"cached TTFT under cProfile: median {1e3 * float(np.median(times)):.2f} ms")
    times = []
    for prompt in prompts[10:]:
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    print(f"cached TTFT without: median {1e3 * float(np.median(times)):.2f} ms, mean {1e3 * float(np.mean(times)):.2f}")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
