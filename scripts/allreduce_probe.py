"""Probe (run once on 2 GPUs, deleted after its figures went to BENCHMARKS.md table 8; `python scripts/allreduce_probe.py`): NCCL all-reduce time for [rows, 4096] bf16 on 2 GPUs, eager and in a CUDA graph (64 calls replayed)."""
import json, os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp

def work(rank, world):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    res = {}
    for rows in (1, 8, 32, 128, 256, 512, 2048, 8192):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        for _ in range(20): dist.all_reduce(x)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(200): dist.all_reduce(x)
        e.record(); torch.cuda.synchronize()
        eager = s.elapsed_time(e) / 200 * 1000
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            dist.all_reduce(x); torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(64): dist.all_reduce(x)
        torch.cuda.synchronize()
        for _ in range(3): g.replay()
        torch.cuda.synchronize()
        s.record()
        for _ in range(10): g.replay()
        e.record(); torch.cuda.synchronize()
        graph = s.elapsed_time(e) / 640 * 1000
        res[rows] = (round(eager, 1), round(graph, 1))
    if rank == 0:
        print(json.dumps({"probe": "allreduce_us_eager_graph", "hidden": 4096, "dtype": "bf16", "by_rows": res}))
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(work, args=(2,), nprocs=2)
