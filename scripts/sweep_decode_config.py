"""Decode attention's launch configuration at the throughput recipe's batch: keys per tile, warps, pipeline stages
and splits, against the default, replayed from CUDA graphs (28 calls per graph over distinct caches, so the keys
are not in L2), each checked against the default's output. Reports GB/s of K/V read and the fraction of the
device copy bandwidth measured in the same run.

    python scripts/sweep_decode_config.py [--batch 256 --lo 100 --hi 2048]
Ends with one JSON line.
"""

import itertools
import json

import torch
from bench_decode_attention import BLOCK_SIZE, HEAD_DIM, MAX_MODEL_LEN, MODELS, batch_args, make_inputs, time_graph

from nanoserve.bench import roofline
from nanoserve.kernels import decode_attention as da


def timed(inp: dict, calls: int, out: torch.Tensor, splits: int | None, overrides: dict) -> float:
    plan = da.plan_split_launch

    def patched(*args, **kwargs):
        launch = plan(*args, **kwargs)
        return launch._replace(options=launch.options | overrides) if launch is not None else None

    da.plan_split_launch = patched
    try:
        def step():
            for i in range(calls):
                k, v = inp["caches"][i % len(inp["caches"])]
                da.decode_attention(inp["q"], k, v, inp["seq_lens"], inp["tables"], HEAD_DIM**-0.5, out=out[i],
                                    num_splits=splits)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        us = min(time_graph(graph, calls) for _ in range(3))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        return us
    finally:
        da.plan_split_launch = plan


def main() -> None:
    ns = batch_args(__doc__.split("\n")[0])
    bw = roofline.measure_bandwidth(torch.device("cuda"))
    hq, hkv, layers = MODELS["qwen3-0.6b"]
    inp = make_inputs(ns.batch, ns.lo, ns.hi, hq, hkv, MAX_MODEL_LEN // BLOCK_SIZE)
    calls = max(layers, len(inp["caches"]))
    ref = torch.empty(calls, *inp["q"].shape, dtype=inp["q"].dtype, device="cuda")
    base_us = timed(inp, calls, ref, None, {})
    rows = [{"config": "default", "us": round(base_us, 2)}]
    out = torch.empty_like(ref)
    for block_n, warps, stages, splits in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4)):
        cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        try:
            us = timed(inp, calls, out, splits, cfg)
        except Exception as exc:  # out of shared memory or registers: not a candidate
            rows.append({"config": f"n{block_n} w{warps} s{stages} splits{splits}", "error": type(exc).__name__})
            continue
        ok = bool(torch.isfinite(out).all()) and torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        rows.append({"config": f"n{block_n} w{warps} s{stages} splits{splits}", "us": round(us, 2), "ok": ok})
    for r in rows:
        if "us" in r:
            r["gb_s"] = round(inp["kv_bytes"] / r["us"] / 1e3, 1)
            r["of_copy_bw"] = round(r["gb_s"] * 1e9 / bw, 3)
    rows.sort(key=lambda r: r.get("us", 1e9))
    for r in rows[:15]:
        print(r)
    print(json.dumps({"bench": "sweep_decode_config", "batch": ns.batch, "lo": ns.lo, "hi": ns.hi,
                      "copy_bw": bw, "default_us": round(base_us, 2), "best": rows[0]}))


if __name__ == "__main__":
    main()
