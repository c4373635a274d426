"""How fast can the throughput recipe's decode attention read its K/V? Against the copy rate that the roofline bound
uses, this measures in one run (CUDA graphs of 28 calls, us a call, GB/s of K/V or buffer read):
- a contiguous read of a 2 GiB buffer (a Triton sum, and torch.sum): the device's read-only rate;
- decode attention's access pattern without its math (summing the tiles): one program per (sequence, kv head)
  walking the paged cache through its block table, longest sequences first, in the engine's layout [blocks,
  block_size, kv_heads, head_dim] and a head-outermost one [kv_heads, blocks, block_size, head_dim], with each
  sequence's blocks shuffled over the pool (as bench_decode_attention does) or in order; also every sequence of
  the mean length;
- the same pattern stream-K: the tiles of all sequences in one list, each program an equal slice of it;
- decode attention itself over the same caches (batch order, and longest first as the engine's large decode graphs
  run it), and the stream-K attention kernel of scripts/probe_decode_stream.py in six launch configurations.

    python scripts/probe_read_bandwidth.py [--batch 256 --lo 100 --hi 2048]
Ends with one JSON line.
"""

import json

import probe_decode_stream as ds
import torch
import triton
import triton.language as tl
from bench_decode_attention import BLOCK_SIZE, HEAD_DIM, MAX_MODEL_LEN, MODELS, batch_args, make_inputs, time_graph

from nanoserve.bench import roofline
from nanoserve.kernels import decode_attention as da


@triton.jit
def _sum_kernel(x_ptr, out_ptr, n_per_prog, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.range(0, n_per_prog, BLOCK, num_stages=STAGES):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def _tile_sum(k_ptr, v_ptr, tables_ptr, seq, head, start, end, stride_tb, stride_cb, stride_ct, stride_ch,
              HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """K + V of keys [start, start + BLOCK_N) below end of one (sequence, kv head), gathered as decode attention
    gathers them, fp32 [BLOCK_N, HEAD_DIM]."""
    offs_n = start + tl.arange(0, BLOCK_N)
    valid = offs_n < end
    blocks = tl.load(tables_ptr + seq * stride_tb + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offs = blocks * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + head * stride_ch
    ptrs = offs[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    k = tl.load(k_ptr + ptrs, mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + ptrs, mask=valid[:, None], other=0.0)
    return k.to(tl.float32) + v.to(tl.float32)


@triton.jit
def _paged_sum_kernel(k_ptr, v_ptr, tables_ptr, items_ptr, out_ptr, stride_tb, stride_cb, stride_ct, stride_ch,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """One work item (sequence, first key, end key) x kv head: sum its K and V rows."""
    item, head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(items_ptr + 3 * item)
    begin = tl.load(items_ptr + 3 * item + 1)
    end = tl.load(items_ptr + 3 * item + 2)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start in tl.range(begin, end, BLOCK_N, num_stages=STAGES):
        acc += _tile_sum(k_ptr, v_ptr, tables_ptr, seq, head, start, end, stride_tb, stride_cb, stride_ct, stride_ch,
                         HEAD_DIM, BLOCK_SIZE, BLOCK_N)
    tl.store(out_ptr + (item * tl.num_programs(1) + head) * HEAD_DIM + offs_d, tl.sum(acc, 0))


@triton.jit
def _stream_sum_kernel(k_ptr, v_ptr, tables_ptr, tiles_ptr, out_ptr, num_tiles, stride_tb, stride_cb, stride_ct,
                       stride_ch, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                       STAGES: tl.constexpr):
    """Stream-K: program p walks tiles [p * T / P, (p + 1) * T / P) of one flat list of (sequence, kv head, first
    key, end key) tiles, so every program reads the same number of tiles whatever the sequences' lengths."""
    pid, progs = tl.program_id(0), tl.num_programs(0)
    first = (pid * num_tiles) // progs
    last = ((pid + 1) * num_tiles) // progs
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for t in tl.range(first, last, num_stages=STAGES):
        seq = tl.load(tiles_ptr + 4 * t)
        head = tl.load(tiles_ptr + 4 * t + 1)
        start = tl.load(tiles_ptr + 4 * t + 2)
        end = tl.load(tiles_ptr + 4 * t + 3)
        acc += _tile_sum(k_ptr, v_ptr, tables_ptr, seq, head, start, end, stride_tb, stride_cb, stride_ct, stride_ch,
                         HEAD_DIM, BLOCK_SIZE, BLOCK_N)
    tl.store(out_ptr + pid * HEAD_DIM + offs_d, tl.sum(acc, 0))


def stream_tiles(lens: list[int], num_kv_heads: int, block_n: int) -> torch.Tensor:
    rows = [(b, h, s, n) for b, n in enumerate(lens) for h in range(num_kv_heads) for s in range(0, n, block_n)]
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


def work_items(lens: list[int]) -> torch.Tensor:
    """(sequence, first key, end key) rows, one per sequence, longest first."""
    rows = [(b, 0, lens[b]) for b in sorted(range(len(lens)), key=lambda b: -lens[b])]
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


def graph_us(fn, calls: int) -> float:
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return min(time_graph(graph, calls) for _ in range(3))


def contiguous_reads(dev: torch.device, report) -> None:
    buf = torch.randn(1 << 30, device=dev).to(torch.bfloat16)  # 2 GiB
    for block, warps, stages, progs in [(2048, 4, 3, 1056), (4096, 8, 3, 1056), (8192, 8, 2, 528), (4096, 4, 4, 2112)]:
        n_per = buf.numel() // progs // block * block
        out = torch.empty(progs, device=dev)

        def call(i, progs=progs, n_per=n_per, out=out, block=block, stages=stages, warps=warps):
            _sum_kernel[(progs,)](buf, out, n_per, BLOCK=block, STAGES=stages, num_warps=warps)
        report(f"contiguous read, {progs} programs x {block} w{warps} s{stages}", graph_us(call, 4), progs * n_per * 2)
    report("torch.sum", graph_us(lambda i: buf.sum(dtype=torch.float32), 4), buf.numel() * 2)


def main() -> None:
    ns = batch_args(__doc__.split("\n")[0])
    dev = torch.device("cuda")
    copy_bw = roofline.measure_bandwidth(dev)
    rows = []

    def report(name: str, us: float, nbytes: int) -> None:
        gb_s = nbytes / us / 1e3
        rows.append({"case": name, "us": round(us, 2), "gb_s": round(gb_s, 1),
                     "of_copy": round(gb_s * 1e9 / copy_bw, 3)})
        print(rows[-1], flush=True)

    contiguous_reads(dev, report)

    hq, hkv, layers = MODELS["qwen3-0.6b"]
    inp = make_inputs(ns.batch, ns.lo, ns.hi, hq, hkv, MAX_MODEL_LEN // BLOCK_SIZE)
    k0, v0 = inp["caches"][0]
    lens = inp["seq_lens"]
    mean = int(lens.float().mean())
    uniform = make_inputs(ns.batch, mean, mean, hq, hkv, MAX_MODEL_LEN // BLOCK_SIZE)
    in_order = inp["tables"].clone()
    at = 0
    for b, nb in enumerate(((lens + BLOCK_SIZE - 1) // BLOCK_SIZE).tolist()):
        in_order[b, :nb] = torch.arange(at, at + nb, dtype=torch.int32)
        at += nb
    # Head-outermost: each kv head's blocks in a pool of their own, [kv_heads, blocks, block_size, head_dim],
    # viewed with the engine's index order; with the tables in order a (sequence, head) is one contiguous run.
    outer = [x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for x in (k0, v0)]
    layouts = [("engine layout", (k0, v0)), ("head-outermost", outer)]
    cases = [(f"{lay}, {tn}, longest first", kv, tables, inp) for lay, kv in layouts
             for tn, tables in (("shuffled", inp["tables"]), ("in order", in_order))]
    cases.append((f"engine layout, uniform lengths ({mean}), shuffled", uniform["caches"][0], uniform["tables"],
                  uniform))
    for name, (k, v), tables, data in cases:
        items = work_items(data["seq_lens"].tolist())
        out = torch.empty(items.shape[0], hkv, HEAD_DIM, device=dev)
        for block_n, stages, warps in [(64, 3, 4), (128, 3, 8)]:
            def call(i, k=k, v=v, tables=tables, items=items, out=out, block_n=block_n, stages=stages, warps=warps):
                _paged_sum_kernel[(items.shape[0], hkv)](
                    k, v, tables, items, out, tables.stride(0), k.stride(0), k.stride(1), k.stride(2),
                    HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=block_n, STAGES=stages, num_warps=warps)
            report(f"paged read, {name}, {block_n} keys s{stages} w{warps}", graph_us(call, layers), data["kv_bytes"])
    for lay, (k, v) in layouts:
        for tn, tables in (("shuffled", inp["tables"]), ("in order", in_order)):
            for block_n, stages, warps, progs in [(64, 3, 4, 264), (128, 3, 8, 132)]:
                tiles = stream_tiles(lens.tolist(), hkv, block_n)
                out = torch.empty(progs, HEAD_DIM, device=dev)

                def call(i, k=k, v=v, tables=tables, tiles=tiles, out=out, progs=progs, block_n=block_n,
                         stages=stages, warps=warps):
                    _stream_sum_kernel[(progs,)](
                        k, v, tables, tiles, out, tiles.shape[0], tables.stride(0), k.stride(0), k.stride(1),
                        k.stride(2), HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=block_n, STAGES=stages,
                        num_warps=warps)
                report(f"stream-K paged read, {lay}, {tn}, {progs} programs, {block_n} keys s{stages} w{warps}",
                       graph_us(call, layers), inp["kv_bytes"])
    q = inp["q"]
    o = torch.empty_like(q)
    order = torch.sort(lens, descending=True, stable=True).indices
    for name, ordr in [("batch order", None), ("longest first", order)]:
        report(f"decode attention, {name}",
               graph_us(lambda i, ordr=ordr: da.decode_attention(q, k0, v0, lens, inp["tables"], HEAD_DIM**-0.5,
                                                                 out=o, order=ordr), layers), inp["kv_bytes"])
    want = da.decode_attention(q, k0, v0, lens, inp["tables"], HEAD_DIM**-0.5, order=order)
    for per_sm, stages, warps, block_n in [(2, 3, 4, 64), (2, 2, 4, 64), (3, 2, 4, 64), (1, 3, 4, 128),
                                           (1, 3, 8, 128), (2, 3, 8, 64)]:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        plan = ds.make_stream_plan(ns.batch, MAX_MODEL_LEN, hkv, hq // hkv, HEAD_DIM, dev, programs=per_sm * sms // hkv,
                                   block_n=block_n)
        ds.plan_stream_tiles(lens, plan)
        try:
            us = graph_us(lambda i, plan=plan, stages=stages, warps=warps: ds.decode_attention_stream(
                q, k0, v0, lens, inp["tables"], HEAD_DIM**-0.5, plan, out=o, stages=stages, warps=warps), layers)
        except Exception as exc:  # out of shared memory: not a candidate
            print(f"stream-K {per_sm}/SM s{stages} w{warps}: {type(exc).__name__}")
            continue
        ok = bool(torch.isfinite(o).all()) and torch.allclose(o.float(), want.float(), atol=2e-2, rtol=2e-2)
        report(f"stream-K decode attention, {per_sm} programs an SM, {block_n} keys s{stages} w{warps}, ok={ok}", us,
               inp["kv_bytes"])
    print(json.dumps({"bench": "probe_read_bandwidth", "batch": ns.batch, "copy_bw": copy_bw,
                      "rows": {r["case"]: r["gb_s"] for r in rows}}))


if __name__ == "__main__":
    main()
