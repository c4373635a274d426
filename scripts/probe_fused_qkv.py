"""Batch-1 decode: the qkv projection with qkv_rope_store's work in its epilogue, one program per head, against the
two launches the engine makes now (skinny_norm_linear, then qkv_rope_store), for Qwen3-0.6B's shapes (16 q and 8
kv heads of 128, hidden 1,024, bf16), 28 layers of distinct weights chained in one CUDA graph under PDL.

Where the earlier in-launch fusion handed each head over through an atomic counter and L2 (no gain), here the
program that computes a head's 128 outputs also norms, rotates and stores them from its registers: the rope
phase disappears, at the price of 32 programs (one per q, k or v head) streaming the 8 MB weight instead of 512+.
The weight tiles are pipelined through shared memory (tl.dot on the tensor cores, x padded to 16 rows) so that
each program keeps enough bytes in flight.

The kernel can also give each head SPLIT = 2 or 4 programs: program j owns the rotary pairs (d, d + 64) for d in
its slice, so rotary stays local, and only the q/k norm's sum of squares crosses programs, through scratch, an
atomic counter and a spin-wait (safe here: the whole grid is resident, and the next kernel launches only once every
program is past its wait).

    python scripts/probe_fused_qkv.py

Ends with one JSON line: us a layer for each variant, and the largest difference from the two-launch path.
On H100s (2026-11-23), four calls: two launches 8.38, 8.55, 8.09, 8.02 us a layer; one program a head (256-wide K
tiles in 3 stages) 7.85, 8.02, 8.06, 7.99; 128-wide tiles 11.8-12.1, 2 stages 9.9-10.1; an L2 prefetch of the slab
before the PDL wait changed nothing (7.96; that variant is in 8cadcf0's version of this script); 2 programs a head
8.47-8.73, 4: 8.30-8.41 (the spin costs what the parallelism gains). Not in the engine: 0.03-0.5 us a layer, at
most ~1.5 % of a token.
"""

import json
import statistics

import torch
import triton
import triton.language as tl
from bench_decode_attention import time_graph  # scripts/ is on sys.path when a script in it runs

from nanoserve.kernels.gemv import skinny_norm_linear
from nanoserve.kernels.pdl import use_pdl
from nanoserve.kernels.qkv_rope_store import qkv_rope_store

HQ, HKV, D, HIDDEN, LAYERS, EPS = 16, 8, 128, 1024, 28, 1e-6


@triton.jit
def _fused_qkv_kernel(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
                      pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, part_ptr, count_ptr, stride_c, eps, K,
                      num_q_heads, num_kv_heads, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, SPLIT: tl.constexpr,
                      R: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """SPLIT programs a head (q heads, then k, then v: rows h * HEAD_DIM .. of the qkv weight). Program j owns the
    rotary pairs (d, d + HALF) for d in j * R .. j * R + R - 1 (R = HALF / SPLIT), so rotary stays in its registers;
    with SPLIT > 1 only the q/k norm's sum of squares crosses programs: each publishes its part, waits (spinning)
    until the head's SPLIT parts are in, and sums them in a fixed order. Every program of the grid is resident at
    once (a few per SM at most), and the next kernel launches only once every program is past the wait, so the spin
    cannot starve a peer."""
    h = tl.program_id(0) // SPLIT
    j = tl.program_id(0) % SPLIT
    offs_i = tl.arange(0, R)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, 16)  # x padded to the 16 rows a tensor-core product needs; row 0 is real
    d = j * R + offs_i  # this program's first-half dims of the head
    wa_ptrs = w_ptr + (h * HEAD_DIM + d).to(tl.int64)[:, None] * K + offs_k[None, :]
    wb_ptrs = wa_ptrs + HALF * K
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    # Prologue as skinny_norm_linear: RMSNorm(x + residual), rounded where the standalone kernel rounds.
    dtype = x_ptr.dtype.element_ty
    sum_sq = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        hk = (tl.load(x_ptr + k0 + offs_k).to(tl.float32) + tl.load(res_ptr + k0 + offs_k).to(tl.float32)).to(dtype)
        if tl.program_id(0) == 0:
            tl.store(res_out_ptr + k0 + offs_k, hk)
        hk = hk.to(tl.float32)
        sum_sq += hk * hk
    rstd = tl.rsqrt(tl.sum(sum_sq, 0) / K + eps)
    acca = tl.zeros([R, 16], tl.float32)
    accb = tl.zeros([R, 16], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        hk = (tl.load(x_ptr + k0 + offs_k).to(tl.float32) + tl.load(res_ptr + k0 + offs_k).to(tl.float32)).to(dtype)
        nw = tl.load(norm_w_ptr + k0 + offs_k).to(tl.float32)
        xn = ((hk.to(tl.float32) * rstd).to(dtype).to(tl.float32) * nw).to(dtype)
        xb = tl.where(offs_m[:, None] == 0, xn[None, :], 0.0).to(dtype)  # [16, BLOCK_K]
        acca = tl.dot(tl.load(wa_ptrs + k0), tl.trans(xb), acca)
        accb = tl.dot(tl.load(wb_ptrs + k0), tl.trans(xb), accb)
    # Column 0 is the real row; rounded as the GEMM's output is.
    y1 = tl.sum(tl.where(offs_m[None, :] == 0, acca, 0.0), 1).to(dtype).to(tl.float32)
    y2 = tl.sum(tl.where(offs_m[None, :] == 0, accb, 0.0), 1).to(dtype).to(tl.float32)
    out = qkv_ptr + h * HEAD_DIM + d
    slot = tl.load(slot_ptr).to(tl.int64)
    if h >= num_q_heads + num_kv_heads:  # a v head: into the cache as it is
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(out, y1.to(dtype))
        tl.store(out + HALF, y2.to(dtype))
        dst = v_cache_ptr + (slot * num_kv_heads + h - num_q_heads - num_kv_heads) * HEAD_DIM + d
        if slot >= 0:
            tl.store(dst, y1.to(dtype))
            tl.store(dst + HALF, y2.to(dtype))
    else:
        total = tl.sum(y1 * y1, 0) + tl.sum(y2 * y2, 0)
        if SPLIT > 1:
            tl.store(part_ptr + h * SPLIT + j, total)
            tl.debug_barrier()
            c = tl.atomic_add(count_ptr + 2 * h, 1, sem="acq_rel", scope="gpu") + 1
            while c < SPLIT:
                c = tl.atomic_add(count_ptr + 2 * h, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
            total = tl.sum(tl.load(part_ptr + h * SPLIT + tl.arange(0, SPLIT), cache_modifier=".cg"), 0)
            # The last to read resets the head's counters for the next launch.
            if tl.atomic_add(count_ptr + 2 * h + 1, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                tl.store(count_ptr + 2 * h, 0)
                tl.store(count_ptr + 2 * h + 1, 0)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # As qkv_rope_store: the head's RMSNorm (q's or k's weight), then rotary.
        is_q = h < num_q_heads
        rs = tl.rsqrt(total / HEAD_DIM + eps)
        nw_ptr = tl.where(is_q, q_w_ptr, k_w_ptr)
        y1 = ((y1 * rs).to(dtype).to(tl.float32) * tl.load(nw_ptr + d).to(tl.float32)).to(dtype).to(tl.float32)
        y2 = ((y2 * rs).to(dtype).to(tl.float32) * tl.load(nw_ptr + HALF + d).to(tl.float32)).to(dtype).to(tl.float32)
        pos = tl.load(pos_ptr).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_c + d)
        sin = tl.load(sin_ptr + pos * stride_c + d)
        r1 = (y1 * cos - y2 * sin).to(dtype)
        r2 = (y2 * cos + y1 * sin).to(dtype)
        tl.store(out, r1)
        tl.store(out + HALF, r2)
        if not is_q:
            dst = k_cache_ptr + (slot * num_kv_heads + h - num_q_heads) * HEAD_DIM + d
            if slot >= 0:
                tl.store(dst, r1)
                tl.store(dst + HALF, r2)


def fused_qkv(x, residual, norm_w, res_out, w, qkv, q_w, k_w, cos, sin, pos, slot, k_cache, v_cache, block_k,
              stages, warps, split=1, scratch=None):  # fmt: skip
    """scratch: (fp32 parts, int32 counters, zeroed) for split > 1."""
    pdl = use_pdl(x)
    part, count = scratch if scratch is not None else (cos, pos)  # (not read with split == 1)
    _fused_qkv_kernel[((HQ + 2 * HKV) * split,)](
        x, residual, norm_w, res_out, w, qkv, q_w, k_w, cos, sin, pos, slot, k_cache, v_cache, part, count,
        cos.stride(0), EPS, HIDDEN, HQ, HKV, HEAD_DIM=D, HALF=D // 2, SPLIT=split, R=D // 2 // split,
        BLOCK_K=block_k, STAGES=stages, USE_PDL=pdl, num_warps=warps,
        launch_pdl=pdl)  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    n = (HQ + 2 * HKV) * D
    layers = [dict(w=torch.randn(n, HIDDEN, dtype=bf, device=dev) / HIDDEN**0.5,
                   norm_w=1 + 0.1 * torch.randn(HIDDEN, dtype=bf, device=dev),
                   q_w=1 + 0.1 * torch.randn(D, dtype=bf, device=dev),
                   k_w=1 + 0.1 * torch.randn(D, dtype=bf, device=dev)) for _ in range(LAYERS)]  # fmt: skip
    x = torch.randn(1, HIDDEN, dtype=bf, device=dev)
    residual = torch.randn(1, HIDDEN, dtype=bf, device=dev)
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
    freqs = torch.arange(4096, device=dev).float()[:, None] * inv[None, :]
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    pos = torch.tensor([1234], device=dev)
    slot = torch.tensor([77], device=dev)
    caches = {name: (torch.zeros(16, 16, HKV, D, dtype=bf, device=dev), torch.zeros(16, 16, HKV, D, dtype=bf,
                                                                                     device=dev))
              for name in ("two", "fused")}  # fmt: skip
    qkv = {name: torch.empty(1, n, dtype=bf, device=dev) for name in ("two", "fused")}
    res_out = {name: torch.empty(1, HIDDEN, dtype=bf, device=dev) for name in ("two", "fused")}

    def two():
        k_cache, v_cache = caches["two"]
        for p in layers:
            skinny_norm_linear(x, residual, p["norm_w"], EPS, p["w"], out=qkv["two"])
            qkv_rope_store(qkv["two"], HQ, HKV, pos, cos, sin, p["q_w"], p["k_w"], EPS, k_cache, v_cache, slot)

    scratch = (
        torch.zeros((HQ + 2 * HKV) * 4, dtype=torch.float32, device=dev),
        torch.zeros((HQ + 2 * HKV) * 2, dtype=torch.int32, device=dev),
    )

    def fused(block_k, stages, warps, split=1):
        k_cache, v_cache = caches["fused"]
        for p in layers:
            fused_qkv(x, residual, p["norm_w"], res_out["fused"], p["w"], qkv["fused"], p["q_w"], p["k_w"], cos,
                      sin, pos, slot, k_cache, v_cache, block_k, stages, warps, split, scratch)  # fmt: skip

    variants = {"two": two}
    # (block_k, stages, warps, programs a head)
    for block_k, stages, warps, split in ((256, 3, 4, 1), (128, 3, 4, 1), (256, 2, 4, 1), (256, 3, 4, 2),
                                          (256, 4, 4, 2), (256, 3, 4, 4), (512, 3, 4, 4)):
        name = f"fused_k{block_k}_s{stages}_w{warps}_split{split}"
        variants[name] = lambda a=(block_k, stages, warps, split): fused(*a)
    graphs, result = {}, {"probe": "fused_qkv", "device": torch.cuda.get_device_name()}
    for name, fn in variants.items():
        try:
            fn()
            torch.cuda.synchronize()
            if name != "two":
                torch.testing.assert_close(qkv[name[:5]], qkv["two"], atol=2e-2, rtol=2e-2)
                for a, b in zip(caches["fused"], caches["two"], strict=True):
                    torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
                result[f"{name}_max_diff"] = (qkv["fused"].float() - qkv["two"].float()).abs().max().item()
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                fn()
        except Exception as e:  # a config that does not compile or fit
            result[name] = f"{type(e).__name__}: {str(e)[:200]}"
    times = {name: [] for name in graphs}
    for _ in range(5):
        for name, g in graphs.items():
            times[name].append(time_graph(g, LAYERS))
    result |= {f"{name}_us": round(statistics.median(t), 2) for name, t in times.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
