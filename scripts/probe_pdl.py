"""Does programmatic dependent launch (PDL) work for Triton kernels captured in torch CUDA graphs, and what does it
save on a batch-1 chain of GEMVs shaped like Qwen3-0.6B's layers? (The measurement behind kernels/pdl.py.)

    python scripts/probe_pdl.py     # on a Hopper GPU

Four modes of the same chain: no PDL; PDL waiting first; PDL loading the weight tile before the wait; PDL with no
wait at all, which must give wrong results (it shows the capture kept the programmatic edges, and that the check
below would catch a missing wait).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def gemv(w_ptr, x_ptr, out_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    # MODE 0: no PDL; 1: wait first; 2: prefetch weights, then wait; 3: PDL without wait (racy on purpose)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, K)
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :]).to(tl.float32)
    if MODE == 2:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 3:
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + offs_k).to(tl.float32)
    y = tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty))


SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 4096)]  # qkv, o, gate_up, down (approx.)


def main():
    torch.manual_seed(0)
    dev = "cuda"
    layers = 28
    ws = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for n, k in SHAPES] for _ in range(layers)]
    bufs = [torch.zeros(8192, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    x0 = torch.randn(8192, device=dev, dtype=torch.bfloat16)

    def chain(mode):
        bufs[0].copy_(x0)
        src = 0
        for lw in ws:
            for (n, k), w in zip(SHAPES, lw, strict=True):
                bn = max(1, 16384 // k)
                gemv[(n // bn,)](w, bufs[src], bufs[1 - src], n, K=k, BLOCK_N=bn, MODE=mode,
                                 num_warps=4, launch_pdl=mode > 0)
                src = 1 - src
        return bufs[src]

    results = {}
    for mode in (0, 1, 2, 3):
        chain(mode)  # compiles outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            with torch.cuda.graph(g):
                out = chain(mode)
        g.replay()
        torch.cuda.synchronize()
        ref = out.clone()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(20):
            g.replay()
        start.record()
        iters = 200
        mism = 0
        for _ in range(iters):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        for _ in range(50):
            g.replay()
            torch.cuda.synchronize()
            mism += int(not torch.equal(out, ref))
        results[mode] = (start.elapsed_time(end) / iters * 1e3, ref.float())
        print(f"mode {mode}: {results[mode][0]:.1f} us per chain of {layers * 4} GEMVs; "
              f"replays differing from first: {mism}/50", flush=True)
    for mode in (1, 2, 3):
        print(f"mode {mode} equals no-PDL output: {torch.equal(results[mode][1], results[0][1])}")
    wbytes = sum(n * k * 2 for n, k in SHAPES) * layers
    print(f"weight bytes {wbytes / 1e6:.0f} MB: {wbytes / (results[2][0] * 1e-6) / 1e12:.2f} TB/s with prefetch+PDL, "
          f"{wbytes / (results[0][0] * 1e-6) / 1e12:.2f} TB/s without")


if __name__ == "__main__":
    main()
