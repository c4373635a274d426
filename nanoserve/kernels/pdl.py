"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while the kernel
before it in the stream is still running, and waits (griddepcontrol.wait) only where it first needs that
kernel's results. At batch 1 a decode step is ~170 launches of a few microseconds each, and without PDL each
one's start-up (scheduling its programs, first loads in flight) is paid in series; with it a GEMM streams part
of its weight, which no kernel writes, while the kernel before it finishes. Works inside CUDA graphs (the
launch attribute becomes a programmatic edge on capture).

Rule for every kernel launched with PDL: nothing before `wait_for_prior_grids` (or `wait_for_prior_grids_only`)
may read memory an earlier kernel writes or write memory an earlier kernel reads. Waiting is transitive (the
kernel before us finished only after its own wait), so after it everything earlier in the stream is done and
visible. When the next kernel may start is separate: at once after the wait (`wait_for_prior_grids`), later where
the kernel calls `launch_dependents`, or when it exits if it calls neither; it never changes what the next kernel
sees after its own wait.
"""

import functools

import torch
import triton
import triton.language as tl

# The engine's switch (EngineArgs.pdl, applied by layers/step_plan.py's KernelPlanner when the engine starts): off,
# to measure what PDL gives or to rule it out when chasing a bug. On by default, for kernels called directly.
_enabled = True


def set_pdl(enabled: bool) -> None:
    """Let kernels launch with PDL where the device supports it (True), or never (False)."""
    global _enabled
    _enabled = enabled


@functools.lru_cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels working on t's device launch with PDL: switched on, and a CUDA device that supports it."""
    return t.is_cuda and _enabled and _device_supports_pdl(t.device.index if t.device.index is not None else
                                                           torch.cuda.current_device())


@triton.jit
def wait_for_prior_grids(USE_PDL: tl.constexpr):
    """Wait until the kernels launched before this one are done and their writes visible, then let the next
    kernel start launching (its programs occupy free SM slots and run up to their own wait)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_prior_grids_only(USE_PDL: tl.constexpr):
    """The wait of wait_for_prior_grids without letting the next kernel start: the kernel calls
    launch_dependents itself, later (its dependents' programs would otherwise sit on SM room it still needs)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel's programs start (they run up to their own wait), after wait_for_prior_grids_only."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
