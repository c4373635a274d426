"""Does the order of a decode batch's sequences matter to decode attention? Sequences of mixed lengths (100-2,048
keys) in random order, longest first and shortest first, replayed from CUDA graphs (sweep_decode_config.timed:
28 calls per graph over distinct caches). Programs are dispatched in grid order (sequence fastest), so longest
first leaves the short programs for the end of the launch, where a long one would run on an otherwise idle GPU.

    python scripts/probe_decode_order.py [--batches 64,128,256]
Ends with one JSON line.
"""

import argparse
import json

import torch
from bench_decode_attention import BLOCK_SIZE, MAX_MODEL_LEN, MODELS, make_inputs
from sweep_decode_config import timed


def permuted(inp: dict, order: torch.Tensor) -> dict:
    return inp | {"seq_lens": inp["seq_lens"][order].contiguous(), "tables": inp["tables"][order].contiguous(),
                  "q": inp["q"][order].contiguous()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="64,128,256")
    p.add_argument("--lo", type=int, default=100)
    p.add_argument("--hi", type=int, default=2048)
    ns = p.parse_args()
    hq, hkv, layers = MODELS["qwen3-0.6b"]
    rows = []
    for batch in map(int, ns.batches.split(",")):
        inp = make_inputs(batch, ns.lo, ns.hi, hq, hkv, MAX_MODEL_LEN // BLOCK_SIZE)
        calls = max(layers, len(inp["caches"]))
        orders = {"random": torch.arange(batch, device="cuda"),
                  "longest_first": torch.argsort(inp["seq_lens"], descending=True),
                  "shortest_first": torch.argsort(inp["seq_lens"])}
        outs, row = {}, {"batch": batch}
        for _ in range(2):  # twice in turn, so that a drifting clock shows
            for name, order in orders.items():
                out = torch.empty(calls, *inp["q"].shape, dtype=inp["q"].dtype, device="cuda")
                us = timed(permuted(inp, order), calls, out, None, {})
                row[name] = min(row.get(name, 1e9), round(us, 2))
                outs[name] = torch.empty_like(out).index_copy_(1, order, out)  # back to the random order
        for name in orders:
            assert torch.equal(outs[name], outs["random"]), name
        print(row, flush=True)
        rows.append(row)
    print(json.dumps({"bench": "probe_decode_order", "lo": ns.lo, "hi": ns.hi, "us_per_call": rows}))


if __name__ == "__main__":
    main()
