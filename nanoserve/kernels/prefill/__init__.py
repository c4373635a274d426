"""Prefill attention: varlen causal attention of new tokens over the paged KV cache, driven by a host-built map.

- planner.py: `PrefillPlanner`, the one place that lays out a launch (eager, CUDA graph, or the kernel's own).
- tile_map.py: the map's format and builder, and the measured rules the planner composes (numpy only).
- split_scratch.py: `SplitScratch`, where split tiles leave their partial results.
- attention.py: the kernel's launch, `prefill_attention`, with its reference `prefill_attention_ref` beside it;
  tile.py and split.py are its device pieces (one map row; the splits' partials and their merge).

The host-side names import without Triton; the kernel's are loaded on first use (CPU-only installs lack Triton).
"""

from nanoserve.kernels.prefill.planner import PrefillLaunch, PrefillPlanner
from nanoserve.kernels.prefill.split_scratch import SplitScratch

_KERNEL_NAMES = ("prefill_attention", "prefill_attention_ref", "gather_kv")

__all__ = ["PrefillLaunch", "PrefillPlanner", "SplitScratch", *_KERNEL_NAMES]


def __getattr__(name: str):
    if name in _KERNEL_NAMES:
        from nanoserve.kernels.prefill import attention

        return getattr(attention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
