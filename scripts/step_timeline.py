"""Where the throughput recipe's wall time goes, step by step, against the roofline bound of each step.

Runs `bench throughput`'s workload, timing every engine step (the gap between consecutive step() returns,
which is the GPU time of a step once the host keeps ahead of it) and recording what the step scheduled.
Steps are grouped by kind (prefill tokens present or not) and decode batch size; each group reports its
measured time next to its bound (weights + live KV over the measured bandwidth, plus 2 FLOPs per
parameter per prompt token), so the gap to the bound shows where it is.

    python scripts/step_timeline.py --model shared/bench-configs/qwen3-0.6b
"""

import argparse
import json
import time

import numpy as np

from nanoserve.bench import roofline
from nanoserve.bench.throughput import workload
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    llm = LLM(model=ns.model, load_format="dummy", dtype="bfloat16")
    engine, cfg = llm.engine, llm.engine.config
    prompts, out_lens = workload(ns.num_prompts, 100, 1024, 100, 1024, cfg.model.vocab_size, ns.seed)
    llm.generate(prompts[:8], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)

    records = []  # (decode rows, prefill tokens, context tokens read)
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        decodes = sum(1 for e in out.scheduled if e.num_new_tokens == 1)
        prefill = sum(e.num_new_tokens for e in out.scheduled if e.num_new_tokens > 1)
        context = sum(e.start + e.num_new_tokens for e in out.scheduled)
        records.append((decodes, prefill, context))
        return out

    engine.scheduler.schedule = recording_schedule
    for i, (prompt, n) in enumerate(zip(prompts, out_lens, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))
    stamps = [time.perf_counter()]
    while engine.has_unfinished_requests():
        engine.step(final_only=True)
        stamps.append(time.perf_counter())
    wall = stamps[-1] - stamps[0]

    model = engine.runner.model
    bw, flops = roofline.measure_bandwidth(cfg.device), roofline.measure_matmul(cfg.device)
    weights, kv, params = roofline.model_bytes(model), roofline.kv_bytes_per_token(cfg), roofline.model_params(model)
    # Step k's launch is read back (and so timed) by call k+1: shift the durations onto the launches.
    durations = np.diff(stamps)[1:].tolist() + [0.0]
    groups: dict[str, list[float]] = {}
    for (decodes, prefill, context), dt in zip(records, durations, strict=False):
        bound = (weights + kv * context) / bw + 2 * params * prefill / flops
        if prefill:
            key = f"prefill>0 (decodes {min(decodes, 256) // 64 * 64}+)"
        else:
            key = f"decode {1 << max(decodes - 1, 0).bit_length():>3}"
        g = groups.setdefault(key, [0, 0.0, 0.0])
        g[0] += 1
        g[1] += dt
        g[2] += bound
    print(f"{'group':<28}{'steps':>7}{'time s':>9}{'bound s':>9}{'gap s':>8}{'ms/step':>9}")
    for key in sorted(groups):
        n, t, b = groups[key]
        print(f"{key:<28}{n:>7}{t:>9.3f}{b:>9.3f}{t - b:>8.3f}{1e3 * t / n:>9.3f}")
    total_t, total_b = sum(g[1] for g in groups.values()), sum(g[2] for g in groups.values())
    print(json.dumps({"script": "step_timeline", "wall_s": round(wall, 3), "steps": len(records),
                      "step_time_s": round(total_t, 3), "step_bound_s": round(total_b, 3),
                      "bandwidth_tb_s": round(bw / 1e12, 2)}))


if __name__ == "__main__":
    main()
