"""Probe (delete once its figures are recorded): microseconds per bf16 all-reduce inside a CUDA graph, NCCL against
symmetric memory one-shot and two-shot, 256 KB to 32 MB, on every GPU of the machine. One JSON line."""

import json
import multiprocessing as mp
import os
import socket

import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
SIZES_KB = [64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
OPS, REPLAYS = 16, 20


def rank_main(rank: int, world: int, init: str, results) -> None:
    import torch.distributed as dist

    from nanoserve.distributed import symm_all_reduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init, world_size=world, rank=rank)
    cpu = dist.new_group(backend="gloo")
    symm = symm_all_reduce.connect(dist.group.WORLD, cpu, device, world, 1, max_bytes=32 << 20)
    out = {}
    for kb in SIZES_KB:
        x = torch.randn(kb * 512, device=device, dtype=torch.bfloat16)
        ways = {"nccl": lambda t: dist.all_reduce(t)}
        if symm is not None:
            def one(t):
                symm.one_shot_max_bytes = 1 << 40
                symm.all_reduce(t)

            def two(t):
                symm.one_shot_max_bytes = 0
                symm.all_reduce(t)

            ways |= {"one_shot": one, "two_shot": two}
        for name, fn in ways.items():
            for _ in range(3):
                fn(x)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(OPS):
                    fn(x)
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier(group=cpu)
            start.record()
            for _ in range(REPLAYS):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            out[f"{name}_{kb}kb_us"] = round(start.elapsed_time(end) * 1e3 / (OPS * REPLAYS), 2)
            del graph
            # The sums themselves, eagerly, against NCCL's (bf16 additions in another order: a few roundings).
            fresh = torch.randn(kb * 512, device=device, dtype=torch.bfloat16)
            want, got = fresh.clone(), fresh.clone()
            dist.all_reduce(want)
            fn(got)
            if not torch.allclose(got.float(), want.float(), rtol=2**-6, atol=2**-6):
                out[f"{name}_{kb}kb_WRONG"] = (got.float() - want.float()).abs().max().item()
    if rank == 0:
        results.put(out)
    dist.barrier(group=cpu)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, init, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = results.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    print(json.dumps({"probe": "allreduce", "world": world, "device": torch.cuda.get_device_name(0), **got}))
