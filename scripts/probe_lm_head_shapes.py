"""Host time of the eager LM head (F.linear, bf16, Qwen3-0.6B's [151936, 1024] weight) when each call has a row
count cuBLAS has not seen before, against calls repeating a seen one: a step that samples a new number of
sequences pays the first kind.

    python scripts/probe_lm_head_shapes.py
    CUDA_MODULE_LOADING=EAGER python scripts/probe_lm_head_shapes.py
Two causes would look alike: cuBLAS choosing a kernel per new shape, and CUDA's lazy loading (the default since
CUDA 12) loading each kernel the first time it runs, which can stall the host for milliseconds. Under
CUDA_MODULE_LOADING=EAGER every kernel is loaded when the context starts, so a first-call cost that remains there
is cuBLAS's own. Ends with one JSON line.
"""

import json
import os
import time

import torch
import torch.nn.functional as F


def host_ms(x: torch.Tensor, w: torch.Tensor) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    F.linear(x, w)
    elapsed = time.perf_counter() - start  # the launch only: the CPU's cost of the call
    torch.cuda.synchronize()
    return elapsed * 1e3


def main() -> None:
    w = torch.randn(151936, 1024, device="cuda", dtype=torch.bfloat16) * 0.03
    rows = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    first = [host_ms(rows[:m], w) for m in range(1, 301)]
    again = [host_ms(rows[:m], w) for m in range(1, 301)]
    firsts = sorted(first)
    agains = sorted(again)
    result = dict(bench="lm_head_shapes", device=torch.cuda.get_device_name(), torch=torch.__version__,
                  module_loading=os.environ.get("CUDA_MODULE_LOADING", "default (lazy)"),
                  first_median_ms=firsts[150], first_max_ms=firsts[-1], first_total_ms=sum(first),
                  repeat_median_ms=agains[150], repeat_max_ms=agains[-1], repeat_total_ms=sum(again))
    print(f"new row counts 1..300: median {firsts[150]:.3f} ms, total {sum(first):.0f} ms of host time; "
          f"the same again: median {agains[150]:.3f} ms, total {sum(again):.0f} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
