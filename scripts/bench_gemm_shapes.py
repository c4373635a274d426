"""cuBLAS (F.linear) against a plain Triton tl.dot GEMM on the linear layers of Qwen3-0.6B, in bf16 on one GPU, at
the row counts of the throughput benchmark's decode steps and the prefix benchmark's cached step, each held to its
roofline: bound = max(bytes / copy bandwidth, flops / bf16 matmul rate), both measured in this run
(nanoserve.bench.roofline).

For y = x @ W.T with W [N, K]: bytes = (M*K + N*K + M*N) * 2, flops = 2*M*N*K; "frac" is bound / time (1.0 = at the
roofline). Every GEMM is timed inside a CUDA graph of 28 captured calls, one per weight copy (one per layer, as a
decode step reads them; more bytes than the L2 holds), replayed 20 times; median per call. The Triton kernel is
swept over a fixed list of tile configs (not triton.autotune, so every config's time is in the JSON), eight of them
split-K: an fp32 workspace is zeroed, each program tl.atomic_adds its K slice into it, then a cast copy to bf16 (the
three kernels are timed together). A config is timed only after its output matches F.linear (assert_close in fp32,
atol = rtol = 2e-2, x ~ N(0, 1), W ~ N(0, 1/K)); one that fails the check or does not compile or launch (e.g. too
much shared memory) is reported as such. Per M: the per-step sums over 28 layers of the four GEMMs for cuBLAS, the
best Triton config per shape, the better of the two per shape, and the bound. The last line is one JSON object.

    python scripts/bench_gemm_shapes.py [--ms 64,100,128,192,256]
    python scripts/bench_gemm_shapes.py --interpret-check   # CPU: kernel correctness under TRITON_INTERPRET=1
"""

import os
import sys

# Triton picks interpreter or compiler when a kernel is decorated, so the variable must be set before the
# kernel below is defined (and before triton is imported, to be safe).
if "--interpret-check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
from typing import NamedTuple  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_gemv import time_graph_us  # noqa: E402  (scripts/ is on sys.path when a script runs)

from nanoserve.bench.roofline import measure_bandwidth, measure_matmul  # noqa: E402

LAYERS = 28  # Qwen3-0.6B decoder layers: one weight copy each, and the per-step multiplier
# (layer, K, N) with weight [N, K]; q/k/v and gate/up fused as nanoserve runs them.
SHAPES = [("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144), ("down", 3072, 1024)]


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    split_k: int = 1

    @property
    def name(self) -> str:
        split = f"_sk{self.split_k}" if self.split_k > 1 else ""
        return f"m{self.block_m}n{self.block_n}k{self.block_k}_s{self.stages}w{self.warps}{split}"


CONFIGS = [Config(bm, bn, bk, st, 8 if bm == bn == 128 else 4)
           for bm in (64, 128) for bn in (32, 64, 128) for bk in (64, 128) for st in (3, 4)]
# Split-K only on the narrow tiles: it is there to add CTAs when N / BLOCK_N alone leaves SMs idle.
CONFIGS += [Config(64, bn, bk, 3, 4, sk) for bn in (32, 64) for bk in (64, 128) for sk in (2, 4)]


# M varies from call to call; specializing on its divisibility would only double the compiles.
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(a_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr):
    """out [M, N] = a [M, K] @ w [N, K].T, all contiguous, fp32 accumulate. With SPLIT_K > 1, program (m, n, s)
    sums K tiles s, s + SPLIT_K, ... and atomically adds into out, then an fp32 workspace."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m[:, None] < M, offs_n[None, :] < N
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * K + offs_k[:, None]  # the [BLOCK_K, BLOCK_N] tile of w.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    step = BLOCK_K * SPLIT_K
    for i in range(0, tl.cdiv(K, step)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m, other=0.0)
            w = tl.load(w_ptrs, mask=mask_n, other=0.0)
        else:
            k_in = offs_k + i * step < K
            a = tl.load(a_ptrs, mask=mask_m & k_in[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n & k_in[:, None], other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += step
        w_ptrs += step
    out_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m & mask_n)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask_m & mask_n)


def triton_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: Config,
                  workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T into out with one config; split-K configs need an fp32 workspace shaped like out."""
    m, k = x.shape
    n = w.shape[0]
    target = out if cfg.split_k == 1 else workspace
    if cfg.split_k > 1:
        workspace.zero_()
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _gemm_kernel[grid](x, w, target, m, n, k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       SPLIT_K=cfg.split_k, EVEN_K=k % (cfg.block_k * cfg.split_k) == 0,
                       num_warps=cfg.warps, num_stages=cfg.stages)
    if cfg.split_k > 1:
        out.copy_(workspace)
    return out


def interpret_check() -> None:
    """Every config on small ragged shapes in fp32 and fp16 (the interpreter mishandles bf16) on the CPU."""
    torch.manual_seed(0)
    for m, k, n in ((37, 128, 96), (64, 256, 64)):
        for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
            x = torch.randn(m, k, dtype=dtype)
            w = (torch.randn(n, k) * k**-0.5).to(dtype)
            want = x.float() @ w.float().T
            for cfg in CONFIGS:
                got = triton_linear(x, w, torch.empty(m, n, dtype=dtype), cfg, torch.empty(m, n))
                torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol,
                                           msg=lambda s, cfg=cfg, dtype=dtype, m=m: f"{cfg.name} {dtype} M={m}: {s}")
    print(f"OK: {len(CONFIGS)} configs x 2 shapes x (fp32, fp16) match x.float() @ W.float().T under the interpreter")


def bench_shape(layer: str, k: int, n: int, ms: list[int], bandwidth: float, flop_rate: float) -> list[dict]:
    dtype = torch.bfloat16
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5 for _ in range(LAYERS)]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        workspace = torch.empty(m, n, device="cuda", dtype=torch.float32)
        want = F.linear(x, weights[0]).float()
        nbytes, flops = (m * k + n * k + m * n) * dtype.itemsize, 2 * m * n * k
        mem_us, math_us = nbytes / bandwidth * 1e6, flops / flop_rate * 1e6
        row = dict(layer=layer, k=k, n=n, m=m, bytes=nbytes, flops=flops, bound_us=max(mem_us, math_us),
                   bound_kind="memory" if mem_us >= math_us else "compute",
                   cublas_us=time_graph_us(lambda i, x=x: F.linear(x, weights[i]), LAYERS), triton_us={}, failed={})
        for cfg in CONFIGS:
            call = lambda i, x=x, out=out, workspace=workspace, cfg=cfg: triton_linear(x, weights[i], out, cfg,
                                                                                         workspace)
            try:
                torch.testing.assert_close(call(0).float(), want, atol=2e-2, rtol=2e-2)
            except AssertionError as exc:
                row["failed"][cfg.name] = "mismatch: " + "; ".join(filter(None, str(exc).strip().splitlines()))
                continue
            except Exception as exc:  # compile or launch failure (out of shared memory, unsupported config ...)
                row["failed"][cfg.name] = f"{type(exc).__name__}: " + (str(exc).strip().splitlines() or [""])[0]
                continue
            row["triton_us"][cfg.name] = time_graph_us(call, LAYERS)
        best = min(row["triton_us"], key=row["triton_us"].get, default=None)
        row["triton_best_config"] = best
        row["triton_best_us"] = row["triton_us"][best] if best else None
        row["cublas_frac"] = row["bound_us"] / row["cublas_us"]
        row["triton_frac"] = row["bound_us"] / row["triton_best_us"] if best else None
        rows.append(row)
        triton_cell = f"{row['triton_best_us']:7.1f} {row['triton_frac']:5.2f}  {best:<22}" if best else \
            f"{'-':>7} {'-':>5}  {'(all failed)':<22}"
        print(f"{layer:<8} {k:>5} {n:>5} {m:>4}  {row['cublas_us']:7.1f} {row['cublas_frac']:5.2f}  {triton_cell} "
              f"{row['bound_us']:7.1f} {row['bound_kind']:<7} {len(row['failed']):>3}", flush=True)
    return rows


def step_sums(rows: list[dict], ms: list[int]) -> list[dict]:
    """Per M, milliseconds per decode step of the four GEMMs over all layers."""
    steps = []
    for m in ms:
        at_m = [r for r in rows if r["m"] == m]
        complete = all(r["triton_best_us"] is not None for r in at_m)
        steps.append(dict(
            m=m, cublas_ms=sum(r["cublas_us"] for r in at_m) * LAYERS / 1e3,
            triton_ms=sum(r["triton_best_us"] for r in at_m) * LAYERS / 1e3 if complete else None,
            better_ms=sum(min(r["cublas_us"], r["triton_best_us"] or r["cublas_us"]) for r in at_m) * LAYERS / 1e3,
            bound_ms=sum(r["bound_us"] for r in at_m) * LAYERS / 1e3))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="64,100,128,192,256", help="comma-separated row counts")
    parser.add_argument("--interpret-check", action="store_true", help="CPU correctness check of the kernel only")
    parser.add_argument("--blas", choices=("cublas", "cublaslt"), default="cublas",
                        help="the library F.linear calls (torch.backends.cuda.preferred_blas_library)")
    args = parser.parse_args()
    if args.interpret_check:
        interpret_check()
        return
    if not torch.cuda.is_available():
        sys.exit("bench_gemm_shapes needs a CUDA GPU (or --interpret-check)")
    ms = [int(m) for m in args.ms.split(",")]
    torch.backends.cuda.preferred_blas_library(args.blas)
    torch.manual_seed(0)
    cuda = torch.device("cuda")
    bandwidth, flop_rate = measure_bandwidth(cuda), measure_matmul(cuda)
    device = torch.cuda.get_device_name()
    print(f"{device}: copy {bandwidth / 1e9:.0f} GB/s, bf16 matmul {flop_rate / 1e12:.0f} TFLOP/s, "
          f"{len(CONFIGS)} Triton configs, graphs of {LAYERS} calls over {LAYERS} weight copies; frac = bound / time")
    print(f"{'layer':<8} {'K':>5} {'N':>5} {'M':>4}  {'cuBLAS':>7} {'frac':>5}  {'triton':>7} {'frac':>5}  "
          f"{'best config':<22} {'bound':>7} {'kind':<7} {'bad':>3}   (us)")
    rows = []
    for layer, k, n in SHAPES:
        rows += bench_shape(layer, k, n, ms, bandwidth, flop_rate)
        torch.cuda.empty_cache()
    steps = step_sums(rows, ms)
    for s in steps:
        triton_ms = f"{s['triton_ms']:.3f}" if s["triton_ms"] is not None else "-"
        print(f"M={s['m']:>4}: per step ({LAYERS} layers x 4 GEMMs) cuBLAS {s['cublas_ms']:.3f} ms, best Triton "
              f"{triton_ms} ms, better of the two {s['better_ms']:.3f} ms, bound {s['bound_ms']:.3f} ms")
    print(json.dumps(dict(bench="gemm_shapes", device=device, blas=args.blas, dtype="bfloat16", model="qwen3-0.6b",
                          layers=LAYERS,
                          copy_gbs=bandwidth / 1e9, matmul_tflops=flop_rate / 1e12,
                          configs=[cfg._asdict() | dict(name=cfg.name) for cfg in CONFIGS], rows=rows, steps=steps)))


if __name__ == "__main__":
    main()
