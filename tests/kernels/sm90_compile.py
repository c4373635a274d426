"""Compile every Triton kernel variant of tests/kernels/sm90_variants.py for sm_90 on a machine without a GPU.

Run as a script with TRITON_INTERPRET unset (tests/kernels/test_compile_sm90.py does): the interpreter accepts code
that compiled Triton rejects, and CI has no GPU. The kernels' own wrappers run with small CPU tensors; every
`kernel[grid](...)` goes through Triton's real launcher (JITFunction.run) with warmup=True, which derives the
signature, specializations and options from the arguments exactly as a launch does and compiles without launching.
A stub driver names an sm_90 target, and the few device queries the wrappers make answer as an H100 does, so they
pick the variants they launch on one (PDL, FP8 dots, fast log, SM counts). Prints one JSON object: per variant, the
kernels compiled, and the failures with Triton's message.
"""

import json
import multiprocessing
import os
import sys
import time
import traceback
import types

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
H100 = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", multi_processor_count=132, major=9, minor=0)
# The most shared memory a block may opt into on sm_90; the launcher refuses a kernel that needs more.
MAX_SHARED = 232448


class _Sm90Driver:
    """What the launcher asks the driver for before it compiles (it asks nothing more with warmup=True)."""

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


def _pose_as_h100() -> None:
    """Make the wrappers take their CUDA branches with CPU tensors (they test `t.is_cuda` and query the device)."""
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.get_device_capability = lambda device=None: (H100.major, H100.minor)
    torch.cuda.get_device_properties = lambda device=None: H100
    torch.cuda.get_device_name = lambda device=None: H100.name
    torch.cuda.current_device = lambda: 0
    driver.set_active(_Sm90Driver())


class _Record:
    """The kernels that the variant being checked compiled, and its failures."""

    compiled: list[str] = []
    failures: list[str] = []


def _compile_instead_of_launch() -> None:
    """Route every launch into Triton's own launcher with warmup=True (compile, don't run), recording each kernel
    compiled and each failure in _Record. The wrapper carries on past a failure, so its later launches are checked
    too."""
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        name = self.fn.__name__
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - any compiler error is a finding, reported with its message
            _Record.failures.append(f"{name}: {type(e).__name__}: {e}")
            return None
        if kernel.metadata.shared > MAX_SHARED:
            _Record.failures.append(f"{name}: needs {kernel.metadata.shared} bytes of shared memory, "
                                    f"sm_90 has {MAX_SHARED}")
        _Record.compiled.append(name)
        return None

    JITFunction.run = compile_only


def _check_variant(index: int) -> dict:
    import sm90_variants

    name, call = sm90_variants.VARIANTS[index]
    _Record.compiled, _Record.failures = [], []
    result = {"variant": name, "compiled": _Record.compiled, "failures": _Record.failures}
    start = time.perf_counter()
    try:
        call()
    except sm90_variants.Skip as e:
        result["skipped"] = str(e)
    except Exception:  # noqa: BLE001 - the wrapper itself failed before or between its launches
        _Record.failures.append("wrapper: " + traceback.format_exc(limit=-3).strip())
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def main() -> None:
    assert "TRITON_INTERPRET" not in os.environ, "the interpreter would be checked, not the compiler"
    _pose_as_h100()
    _compile_instead_of_launch()
    sys.path.insert(0, os.path.dirname(__file__))
    import sm90_variants  # imports the kernel modules, before the workers fork

    # Forked workers (one a core) compile variants in parallel; each has its own Triton caches, so a kernel two
    # variants share may compile twice. Costliest first, so that no long compile starts last.
    workers = min(len(os.sched_getaffinity(0)), 4)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        results = pool.map(_check_variant, range(len(sm90_variants.VARIANTS)), chunksize=1)
    json.dump({"triton": triton.__version__, "results": results}, sys.stdout)


if __name__ == "__main__":
    main()
