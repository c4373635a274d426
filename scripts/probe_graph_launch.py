"""How long a captured step takes to start on an idle GPU: for prefill graphs of a few token buckets and the batch-1
decode graph of a real engine (Qwen3-0.6B shape, dummy weights), the host time of `graph.replay()` and the device
time from an event recorded just before it to one just after, against the same graph replayed back to back (where
launching overlaps the previous replay). start latency = from idle - back to back: what a step that finds the GPU
idle (a TTFT) pays before its first kernel runs.

    python scripts/probe_graph_launch.py --model shared/bench-configs/qwen3-0.6b

Also the host time of `graph.replay()` with work still queued on the stream, and of every replay during bench
prefix's cached requests. Ends with one JSON line. On an H100 (2026-11-23, d2ed8b8): replay's host call 14-29 us
(bucket 2,048: 83-100), start latency 13-30 us (2,048: 70-113), 17.5 us a replay in the cached requests. So a
graph launch is not where a cached prefix request's time goes (torch.profiler's trace shows ~0.6 ms there: its
own overhead).
"""

import argparse
import json
import statistics
import time

import torch

from nanoserve.bench.prefix import prefix_prompts
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams


def measure(graph: torch.cuda.CUDAGraph, repeats: int = 20) -> dict:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    back_to_back = start.elapsed_time(end) * 1e3 / repeats
    host, idle = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        time.sleep(0.002)
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        torch.cuda.synchronize()
        idle.append(start.elapsed_time(end) * 1e3)
    from_idle = statistics.median(idle)
    # The host call again with work still queued ahead of it: a ~0.5 ms spin kernel, then nine small copies (as
    # PrefillGraphRunner.prepare queues), so the launch meets a busy stream.
    busy = []
    a, b = torch.zeros(4096, device="cuda"), torch.zeros(4096, device="cuda")
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000)
        for _ in range(9):
            a.copy_(b)
        t0 = time.perf_counter()
        graph.replay()
        busy.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return {
        "replay_host_us": round(statistics.median(host), 1),
        "replay_host_busy_stream_us": round(statistics.median(busy), 1),
        "from_idle_us": round(from_idle, 1),
        "back_to_back_us": round(back_to_back, 1),
        "start_latency_us": round(from_idle - back_to_back, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--buckets", default="16,128,512,2048")
    ns = p.parse_args()
    llm = LLM(model=ns.model, load_format="dummy", dtype="bfloat16", max_model_len=4096, enable_prefix_caching=True)
    runner = llm.engine.runner
    result = {"probe": "graph_launch", "device": torch.cuda.get_device_name()}
    for t in map(int, ns.buckets.split(",")):
        result[f"prefill_{t}"] = measure(runner.prefill_graphs.graphs[t][0])
        print(t, result[f"prefill_{t}"], flush=True)
    result["decode_1"] = measure(runner.graphs.graphs[1][0])
    # In the real flow: the host time of every replay during bench prefix's cached requests.
    prompts = prefix_prompts(llm.engine.config.model.vocab_size, 2000, 100, 40, seed=0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    replay, times = torch.cuda.CUDAGraph.replay, []

    def timed_replay(graph):
        t0 = time.perf_counter()
        replay(graph)
        times.append((time.perf_counter() - t0) * 1e6)

    torch.cuda.CUDAGraph.replay = timed_replay
    for i, prompt in enumerate(prompts):
        if i == 10:
            times.clear()
        llm.generate([prompt], params, use_tqdm=False)
    torch.cuda.CUDAGraph.replay = replay
    result["prefix_requests_replay_host_us"] = round(statistics.median(times), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
