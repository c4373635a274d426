"""Probe (run once on 2 GPUs, deleted after its figures went to BENCHMARKS.md table 8; `python scripts/symm_allreduce_probe.py`): torch symmetric-memory one-shot / two-shot all-reduce vs NCCL, [rows, 4096] bf16 on 2 GPUs, in a CUDA graph."""
import json, torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.distributed._symmetric_memory as symm_mem

def timed_graph(fn, n=64, reps=10):
    g = torch.cuda.CUDAGraph(); st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        fn(); torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=st):
            for _ in range(n): fn()
    torch.cuda.synchronize()
    for _ in range(3): g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): g.replay()
    e.record(); torch.cuda.synchronize()
    return round(s.elapsed_time(e) / (n * reps) * 1000, 1)

def work(rank, world):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29534", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    name = dist.group.WORLD.group_name
    buf = symm_mem.empty(8192 * 4096, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(buf, dist.group.WORLD)
    res = {}
    for rows in (1, 8, 32, 128, 256, 512, 2048, 8192):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        ref = x.clone(); dist.all_reduce(ref)
        v = buf[: rows * 4096].view(rows, 4096)
        out = torch.empty_like(x)
        def one():
            v.copy_(x); torch.ops.symm_mem.one_shot_all_reduce_out(v, "sum", name, out)
        def two():
            v.copy_(x); torch.ops.symm_mem.two_shot_all_reduce_(v, "sum", name)
        def nccl():
            out.copy_(x); dist.all_reduce(out)
        row = {}
        for label, fn in (("nccl", nccl), ("one_shot", one), ("two_shot", two)):
            try:
                fn(); torch.cuda.synchronize()
                got = out if label == "one_shot" else (v if label == "two_shot" else out)
                err = (got.float() - ref.float()).abs().max().item()
                row[label] = (timed_graph(fn), round(err, 3))
            except Exception as exc:  # noqa
                row[label] = repr(exc)[:120]
        res[rows] = row
    if rank == 0:
        print(json.dumps({"probe": "symm_mem_allreduce_us_graph_err", "by_rows": res}))
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(work, args=(2,), nprocs=2)
