"""Where a decode step's time goes: torch.profiler over some engine steps, the device's kernels grouped by kind.

    nanoserve bench latency --model DIR [--batch-size B] --profile [--profile-trace trace.json]

Kinds, by kernel name: collective (NCCL's all-reduce, gather, broadcast), attention, matmul (cuBLAS and the
GEMV kernels), other (norms, rotary, KV stores, sampling). On the CPU, where there are no kernels, the operators'
own time is grouped instead (attention's products then count as matmul, and the profiler's cost per operator
inflates the total). Under tensor parallelism only rank 0, the engine's process, is profiled: its
collectives' time includes waiting for the other ranks, which is what a step pays for them. Kernels replayed from
CUDA graphs are seen one by one.
"""

import re
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# First match wins: a collective before anything else, attention before matmul (a fused rope-attention kernel).
_KINDS = (
    ("collective", re.compile(r"nccl|gloo|c10d::|all_?reduce|all_?gather")),
    ("attention", re.compile(r"attention|attn|decode_split|decode_reduce|decode_rope|sdpa")),
    ("matmul", re.compile(r"gemm|gemv|linear|nvjet|cutlass|xmma|cublas|matmul|\b(add|b|baddb|_scaled_)?mm\b")),
)


def kind_of(name: str) -> str:
    name = name.lower()
    return next((kind for kind, pattern in _KINDS if pattern.search(name)), "other")


def profile_steps(step: Callable[[], object], num_steps: int, device: torch.device,
                  trace: str | None = None, top: int = 5) -> dict:
    """Run `step` num_steps times under the profiler. Returns microseconds a step by kind (and their total), the
    `top` kernels (or operators) by time a step, and writes a Chrome trace to `trace` when given."""
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize()  # the window starts with no earlier step still running
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            step()
        if on_cuda:
            torch.cuda.synchronize()  # kernels still queued at the end would be missing from the trace
    if trace:
        prof.export_chrome_trace(trace)
    per_name: dict[str, float] = {}
    for evt in prof.key_averages():
        # An annotation (c10d's "nccl:all_reduce", say) is repeated on the device's timeline beside the kernel.
        if getattr(evt, "is_user_annotation", False):
            continue
        if on_cuda:
            if evt.device_type != DeviceType.CUDA:
                continue
            us = evt.self_device_time_total
        else:
            us = evt.self_cpu_time_total
        per_name[evt.key] = per_name.get(evt.key, 0.0) + us
    by_kind = dict.fromkeys(("collective", "attention", "matmul", "other"), 0.0)
    for name, us in per_name.items():
        by_kind[kind_of(name)] += us
    by_kind["total"] = sum(by_kind.values())
    ranked = sorted(per_name.items(), key=lambda item: -item[1])[:top]
    return {"profile_steps": num_steps,
            "profile_us_per_step": {k: round(v / num_steps, 1) for k, v in by_kind.items()},
            "profile_top_us_per_step": [[name[:80], round(us / num_steps, 1)] for name, us in ranked]}
