"""Are prefill attention's key/value loads software-pipelined on this GPU? Runs the kernel once at each stage count
on the cached-prefix shape (100 new tokens over 2,100 keys, Qwen3-0.6B's heads) and prints, per compiled variant,
the cp.async instructions in its PTX (0 would mean every key tile waits for its own loads), registers, spills and
shared memory. It must go through the JIT launch: a kernel compiled offline from its source alone (no pointer
alignment known) shows no cp.async even where the launched one has them.

    python scripts/probe_prefill_pipelining.py [--stages 2 3]
Ends with one JSON line.
"""

import argparse
import json

import torch

from nanoserve.kernels import prefill_attention as pa

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NEW, TOTAL = 16, 8, 128, 16, 100, 2100


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ns = p.parse_args()
    num_blocks = TOTAL // BLOCK_SIZE + 2
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)[None, :]
    q = torch.randn(NEW, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cu_seqlens_q = torch.tensor([0, NEW], device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor([TOTAL], device="cuda", dtype=torch.int32)
    for stages in ns.stages:
        pa.prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, tables, NEW, HEAD_DIM**-0.5,
                             num_stages=stages)  # fmt: skip
    torch.cuda.synchronize()
    variants = []
    for cache in pa._prefill_attention_kernel.device_caches.values():
        for kernel in cache[0].values():
            ptx = kernel.asm["ptx"]
            variants.append({"num_stages": kernel.metadata.num_stages, "cp_async": ptx.count("cp.async"),
                             "registers": kernel.n_regs, "spills": kernel.n_spills,
                             "shared_bytes": kernel.metadata.shared})  # fmt: skip
            print(variants[-1])
    print(json.dumps({"device": torch.cuda.get_device_name(), "variants": variants}))


if __name__ == "__main__":
    main()
