"""Would a persistent kernel with grid barriers beat one launch per GEMV at batch 1? (GPU only.)

Batch-1 decode of Qwen3-0.6B is ~33 us a layer against ~10 us of weights streamed: the layer is six short kernels,
and each boundary drains the memory pipe even under PDL. This probe runs the layer's MLP half (o_proj; add +
RMSNorm + gate_up_proj; SiLU-and-mul + down_proj) for 28 layers of distinct weights, two ways, in CUDA graphs:
- kernels: the engine's three skinny GEMV kernels per layer (kernels/gemv.py), PDL between them;
- persistent: one program per SM slot walks every layer's three phases, separated by grid barriers (an atomic
  count and a spin on it). With PREFETCH, a program loads its slab of the next phase's weight before it waits at
  the barrier, so the weight stream does not stop at a phase boundary. One launch for all layers, or one a layer.
Every variant's output is checked against the kernels'. Prints microseconds a layer and the bytes' bound.

    python scripts/probe_persistent_mlp.py
"""

import json

import torch
import triton
import triton.language as tl

from nanoserve.bench import roofline
from nanoserve.kernels.gemv import skinny_linear, skinny_norm_linear, skinny_silu_mul_linear

HID, ATT, INTER, LAYERS, EPS = 1024, 2048, 3072, 28, 1e-6


@triton.jit
def _grid_barrier(sync_ptr, target):
    """Wait until every program has arrived here (the count reaches target); the CUTLASS semaphore pattern: a
    CTA barrier orders this program's stores before its release, the acquire after the spin orders later loads."""
    tl.debug_barrier()
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    seen = tl.load(sync_ptr, volatile=True)
    while seen < target:
        seen = tl.load(sync_ptr, volatile=True)
    tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _slab(w_ptr, item, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, KP: tl.constexpr):
    """The weight rows of one item, [BLOCK_N, KP] (K padded to a power of two, masked)."""
    rows = tl.minimum(item * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    offs_k = tl.arange(0, KP)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    if KP == K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(offs_k < K)[None, :], other=0.0)


@triton.jit
def _phase(w_ptr, x, out_ptr, first, pid, G, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
           KP: tl.constexpr):
    """out = W x for this program's items (pid, pid + G, ...); `first` is the slab of item pid, loaded already."""
    w = first
    for item in range(pid, N // BLOCK_N, G):
        if item != pid:
            w = _slab(w_ptr, item, N, K, BLOCK_N, KP)
        y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        offs_n = item * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["first_layer", "num_layers"])
def _mlp_chain_kernel(a_ptr, o_w_ptr, gu_w_ptr, d_w_ptr, norm_w_ptr, h_ptr, res_ptr, gu_ptr, m_ptr, sync_ptr,
                      first_layer, num_layers, eps, HID: tl.constexpr, ATT: tl.constexpr, INTER: tl.constexpr,
                      BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr, INTER_P: tl.constexpr,
                      PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    dtype = a_ptr.dtype.element_ty
    offs_h = tl.arange(0, HID)
    offs_a = tl.arange(0, ATT)
    offs_i = tl.arange(0, INTER_P)
    i_ok = offs_i < INTER
    n_bar = 0
    o_w = o_w_ptr + first_layer.to(tl.int64) * HID * ATT
    w = _slab(o_w, pid, HID, ATT, BN_O, ATT)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for j in range(num_layers):
        layer = (first_layer + j).to(tl.int64)
        gu_w = gu_w_ptr + layer * 2 * INTER * HID
        d_w = d_w_ptr + layer * HID * INTER
        # o_proj: h = W_o a
        a = tl.load(a_ptr + offs_a, cache_modifier=".cg").to(tl.float32)
        if PREFETCH:
            w_next = _slab(gu_w, pid, 2 * INTER, HID, BN_GU, HID)
        _phase(o_w, a, h_ptr, w, pid, G, HID, ATT, BN_O, ATT)
        n_bar += 1
        _grid_barrier(sync_ptr, n_bar * G)
        # gate_up_proj of RMSNorm(h + residual); program 0 writes the sum as the next layer's residual
        if not PREFETCH:
            w_next = _slab(gu_w, pid, 2 * INTER, HID, BN_GU, HID)
        res_in = res_ptr + (layer % 2) * HID
        s = (tl.load(h_ptr + offs_h, cache_modifier=".cg").to(tl.float32)
             + tl.load(res_in + offs_h, cache_modifier=".cg").to(tl.float32)).to(dtype)
        if pid == 0:
            tl.store(res_ptr + ((layer + 1) % 2) * HID + offs_h, s)
        s = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(s * s, 0) / HID + eps)
        nw = tl.load(norm_w_ptr + layer * HID + offs_h).to(tl.float32)
        x = ((s * rstd).to(dtype).to(tl.float32) * nw).to(dtype).to(tl.float32)
        if PREFETCH:
            w = _slab(d_w, pid, HID, INTER, BN_D, INTER_P)
        _phase(gu_w, x, gu_ptr, w_next, pid, G, 2 * INTER, HID, BN_GU, HID)
        n_bar += 1
        _grid_barrier(sync_ptr, n_bar * G)
        # down_proj of SiLU(gate) * up
        if not PREFETCH:
            w = _slab(d_w, pid, HID, INTER, BN_D, INTER_P)
        gate = tl.load(gu_ptr + offs_i, mask=i_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        up = tl.load(gu_ptr + INTER + offs_i, mask=i_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        x = (gate * tl.sigmoid(gate) * up).to(dtype).to(tl.float32)
        o_w = o_w_ptr + (layer + 1) * HID * ATT
        if PREFETCH:
            w_next = _slab(o_w, pid, HID, ATT, BN_O, ATT)
        _phase(d_w, x, m_ptr, w, pid, G, HID, INTER, BN_D, INTER_P)
        n_bar += 1
        _grid_barrier(sync_ptr, n_bar * G)
        if PREFETCH:
            w = w_next
        else:
            w = _slab(o_w, pid, HID, ATT, BN_O, ATT)
    # The last program out resets the count for the next launch (every program is past its last barrier).
    tl.debug_barrier()
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == G - 1:
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 1, 0)


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bf = torch.bfloat16
    o_w = torch.randn(LAYERS + 1, HID, ATT, device=dev, dtype=bf) / ATT ** 0.5  # (+1: the last prefetch's target)
    gu_w = torch.randn(LAYERS, 2 * INTER, HID, device=dev, dtype=bf) / HID ** 0.5
    d_w = torch.randn(LAYERS, HID, INTER, device=dev, dtype=bf) / INTER ** 0.5
    norm_w = 1 + 0.1 * torch.randn(LAYERS, HID, device=dev, dtype=bf)
    a = torch.randn(ATT, device=dev, dtype=bf)
    res0 = torch.randn(HID, device=dev, dtype=bf)
    h = torch.empty(1, HID, device=dev, dtype=bf)
    gu = torch.empty(1, 2 * INTER, device=dev, dtype=bf)
    m = torch.empty(1, HID, device=dev, dtype=bf)
    res = torch.empty(2, HID, device=dev, dtype=bf)
    sync = torch.zeros(2, device=dev, dtype=torch.int32)

    def kernels():
        r = res0.view(1, HID).clone()
        for layer in range(LAYERS):
            skinny_linear(a.view(1, ATT), o_w[layer], out=h)
            _, r = skinny_norm_linear(h, r, norm_w[layer], EPS, gu_w[layer], out=gu)
            skinny_silu_mul_linear(gu, d_w[layer], out=m)
        res[LAYERS % 2].copy_(r[0])
        return m

    def max_per_sm(prefetch, bn_gu) -> int:
        """Programs of the kernel one SM holds at once: a grid barrier needs every program resident."""
        k = _mlp_chain_kernel.warmup(a, o_w, gu_w, d_w, norm_w, h, res, gu, m, sync, 0, LAYERS, EPS, HID=HID,
                                     ATT=ATT, INTER=INTER, BN_O=2, BN_GU=bn_gu, BN_D=2,
                                     INTER_P=triton.next_power_of_2(INTER), PREFETCH=prefetch, USE_PDL=True,
                                     num_warps=4, launch_pdl=True, grid=(1,))
        k._init_handles()
        regs = max(k.n_regs, 1) * 128
        return min(65536 // regs, 16, (227 * 1024) // max(k.metadata.shared, 1)), k.n_regs, k.n_spills

    def persistent(grid, per_layer, prefetch, bn_gu):
        res[0].copy_(res0)
        chunks = [(i, 1) for i in range(LAYERS)] if per_layer else [(0, LAYERS)]
        for first, n in chunks:
            _mlp_chain_kernel[(grid,)](a, o_w, gu_w, d_w, norm_w, h, res, gu, m, sync, first, n, EPS, HID=HID,
                                       ATT=ATT, INTER=INTER, BN_O=2, BN_GU=bn_gu, BN_D=2,
                                       INTER_P=triton.next_power_of_2(INTER), PREFETCH=prefetch, USE_PDL=True,
                                       num_warps=4, launch_pdl=True)
        return m

    def timed(fn) -> tuple[float, torch.Tensor, torch.Tensor]:
        out = fn()  # compiles outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters = 100
        start.record()
        for _ in range(iters):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters * 1e3 / LAYERS, out.clone(), res[LAYERS % 2].clone()

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bw = roofline.measure_bandwidth(dev)
    layer_bytes = 2 * (HID * ATT + 2 * INTER * HID + HID * INTER)
    results = {"device": torch.cuda.get_device_name(), "bandwidth_tb_s": round(bw / 1e12, 2),
               "bound_us_per_layer": round(layer_bytes / bw * 1e6, 2)}
    base_us, base_m, base_res = timed(kernels)
    results["kernels_us"] = round(base_us, 2)
    print(f"kernels: {base_us:.2f} us a layer (bound {results['bound_us_per_layer']})", flush=True)
    for per_layer in (False, True):
        for prefetch in (False, True):
            for per_sm, bn_gu in ((4, 8), (4, 16), (2, 16), (8, 8)):
                fits, regs, spills = max_per_sm(prefetch, bn_gu)
                if per_sm > fits:
                    print(f"skip {per_sm} a SM: {fits} fit ({regs} registers)", flush=True)
                    continue
                name = f"{'per_layer' if per_layer else 'one_launch'}_{'prefetch' if prefetch else 'plain'}" \
                       f"_{per_sm}x_bn{bn_gu}"
                us, out, r = timed(lambda: persistent(per_sm * sms, per_layer, prefetch, bn_gu))  # noqa: B023
                ok = torch.allclose(out.float(), base_m.float(), atol=2e-2, rtol=2e-2) and \
                    torch.allclose(r.float(), base_res.float(), atol=2e-2, rtol=2e-2)
                results[name] = {"us": round(us, 2), "matches": ok, "regs": regs, "spills": spills,
                                 "max_diff": round((out.float() - base_m.float()).abs().max().item(), 4)}
                print(f"{name}: {us:.2f} us a layer, matches the kernels: {ok}", flush=True)
    print(json.dumps({"probe": "persistent_mlp", **results}))


if __name__ == "__main__":
    main()
