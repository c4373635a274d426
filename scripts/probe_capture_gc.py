"""Does Python's garbage collector running in the middle of a CUDA graph capture break the capture?

    python scripts/probe_capture_gc.py

Each case runs in its own process (a failed capture leaves PyTorch's generator state unusable). A case makes
a dead reference cycle holding a CUDA object, then captures a small graph with gc.collect() called inside the
capture, where an automatic collection could run. Prints one line per case and a JSON summary line.
"""

import json
import subprocess
import sys

CASES = {
    "nothing": "",
    "pinned tensor, used by a copy": "held = torch.empty(1 << 16, pin_memory=True); "
                                     "torch.empty(1 << 16, device='cuda').copy_(held, non_blocking=True)",
    "pinned tensor, never used": "held = torch.empty(1 << 16, pin_memory=True)",
    "cuda event, recorded": "held = torch.cuda.Event(); held.record()",
    "device tensor": "held = torch.empty(1 << 20, device='cuda')",
}

CASE = """
import gc, torch
class Cycle:
    pass
{make}
c = Cycle(); c.me = c; c.held = locals().get('held')
del c
held = None
torch.cuda.synchronize()
x = torch.zeros(1024, device='cuda')
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y = x + 1
    gc.collect()
    y = y * 2
g.replay(); torch.cuda.synchronize()
assert y[0].item() == 2.0
"""


def main() -> int:
    results = {}
    for name, make in CASES.items():
        proc = subprocess.run([sys.executable, "-c", CASE.format(make=make)], capture_output=True, text=True)
        error = proc.stderr.strip().splitlines()[-1] if proc.returncode else ""
        results[name] = "ok" if proc.returncode == 0 else f"failed: {error[:160]}"
        print(f"{name}: {results[name]}", flush=True)
    print(json.dumps({"probe": "capture_gc", **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
