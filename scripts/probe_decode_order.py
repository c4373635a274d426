"""Does the order of a decode batch's sequences matter to decode attention? Sequences of mixed lengths (100-2,048
keys) in random order, longest first and shortest first, replayed from CUDA graphs (sweep_decode_config.timed:
28 calls per graph over distinct caches). Programs are dispatched in grid order (sequence fastest), so longest
first leaves the short programs for the end of the launch, where a long one would run on an otherwise idle GPU.
Also what computing the order costs (order_us): torch.sort against kernels/decode_order.py.

    python scripts/probe_decode_order.py [--batches 64,128,256]
Ends with one JSON line.
"""

import argparse
import json

import torch
from bench_decode_attention import BLOCK_SIZE, MAX_MODEL_LEN, MODELS, make_inputs, time_fn
from sweep_decode_config import timed

from nanoserve.kernels.decode_order import longest_first_order


def order_cost_us(seq_lens: torch.Tensor, calls: int = 20) -> dict:
    """What computing the order costs inside a CUDA graph (us a call): torch.sort, as the decode graphs did before
    2026-11-24, and longest_first_order; both must give the same permutation."""
    n = seq_lens.shape[0]
    out = {name: torch.empty(n, dtype=torch.int64, device="cuda") for name in ("torch.sort", "longest_first_order")}
    sorted_lens = torch.empty_like(seq_lens)
    fns = {"torch.sort": lambda: torch.sort(seq_lens, descending=True, stable=True,
                                            out=(sorted_lens, out["torch.sort"])),
           "longest_first_order": lambda: longest_first_order(seq_lens, out["longest_first_order"])}
    us = {name: round(time_fn(lambda fn=fn: [fn() for _ in range(calls)], calls), 2) for name, fn in fns.items()}
    assert torch.equal(out["torch.sort"], out["longest_first_order"])
    return us


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
        outs, row = {}, {"batch": batch, "order_us": order_cost_us(inp["seq_lens"])}
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
