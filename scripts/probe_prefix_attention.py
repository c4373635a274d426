"""Where the prefix benchmark's prefill attention spends its time: 100 new tokens over 2,000 cached ones (Qwen3-0.6B
shapes, bf16, 16-token pages), the kernel as PrefillGraphRunner launches it, and the same launch with its map
edited so that each part of a program's work can be timed apart, all replayed from CUDA graphs of 28+ calls over
distinct caches (scripts/bench_prefill_attention.py's harness):

- default: the map the runner builds (key splits merged in the launch by the last split to finish);
- no_merge: the same programs, but each split writes its partial result as the output (no counter, no merge);
- keys_N: every live program visits keys [0, N) only, unsplit: the fixed cost of a program plus N / block_n key
  tiles (no_keys: none at all; its output is NaN);
- sdpa_*: torch's scaled_dot_product_attention on contiguous K/V (expanded to the 16 query heads), with a
  bottom-right causal mask, on each backend that runs: what a library kernel takes for the same work.

The edited maps compute the wrong result by design; only default is checked against the reference.

    python scripts/probe_prefix_attention.py [--block-m 64] [--num-stages 2]

Ends with one JSON line. On an H100 (2026-11-23, d2ed8b8; us a call, the runner's 64-row tiles): default 23.3-23.5,
no_merge 15.2-15.3, no_keys 4.4, keys_64 6.5, keys_128 8.2, keys_256 11.3, keys_512 17.7 (~1.6 us a 64-key tile a
program, two programs an SM); sdpa flash 20.7 (16 heads, no paging), efficient 73, cudnn 67. 128-row tiles: default
32.9, no_merge 18.0 (the merge reads twice the bytes). So ~8 us of the 23 is the in-launch merge: one SM reading
its tile's eight fp32 partials from L2.
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from bench_decode_attention import time_graph  # scripts/ is on sys.path when a script in it runs
from bench_prefill_attention import HEAD_DIM, HKV, HQ, LAYERS, check, make_step, path, run_paths

from nanoserve.kernels.tile_map import prefill_block_m, prefill_programs_per_sm


def edited(kwargs: dict, edit) -> dict:
    """kwargs with a copy of the map whose live rows went through edit(live_rows) (a numpy view, in place)."""
    m = kwargs["tile_map"].cpu().numpy().copy()
    live = m[:, 0] >= 0
    rows = m[live]
    edit(rows)
    m[live] = rows
    return {**kwargs, "tile_map": torch.from_numpy(m).cuda()}


def map_paths(step: dict, block_m: int, num_stages: int) -> tuple[dict, dict]:
    pack = HQ // HKV
    base, stats = path(step, pack, block_m, prefill_programs_per_sm(block_m), num_stages=num_stages)
    paths = {"default": base}

    def no_merge(rows):
        rows[:, 6] = 1

    paths["no_merge"] = edited(base, no_merge)
    for keys in (0, 64, 128, 256, 512, 1024, 2048):

        def only(rows, keys=keys):
            rows[:, 2], rows[:, 3], rows[:, 6] = 0, keys, 1

        paths[f"keys_{keys}" if keys else "no_keys"] = edited(base, only)
    return paths, stats


def sdpa_times(step: dict) -> dict:
    """Microseconds per call of F.scaled_dot_product_attention on contiguous [1, 16, L, 128] K/V, per backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q_len, seq_len = step["cu"][-1], step["seq_lens"][0]
    q = step["q"][:q_len].transpose(0, 1).unsqueeze(0).contiguous()  # [1, HQ, q_len, D]
    kvs = []
    for _ in range(LAYERS):
        k = torch.randn(1, HKV, seq_len, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        kvs.append((k.repeat_interleave(HQ // HKV, 1), torch.randn_like(k).repeat_interleave(HQ // HKV, 1)))
    mask = causal_lower_right(q_len, seq_len)
    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):  # fmt: skip
        try:
            with sdpa_kernel(backend):

                def call_all():
                    for k, v in kvs:
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

                call_all()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    call_all()
                out[f"sdpa_{name}"] = round(statistics.median(time_graph(graph, LAYERS) for _ in range(5)), 2)
        except Exception as e:  # a backend this build or GPU lacks
            out[f"sdpa_{name}"] = f"{type(e).__name__}: {str(e)[:120]}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-m", type=int, default=None, help="tile rows (default: the runner's)")
    p.add_argument("--num-stages", type=int, default=2)
    ns = p.parse_args()
    step = make_step([(100, 2100)])
    block_m = ns.block_m or prefill_block_m(step["bucket"], HQ // HKV)
    paths, stats = map_paths(step, block_m, ns.num_stages)
    us, outs, resources = run_paths(step, paths)
    check(step, outs, {"default": paths["default"]})
    live = paths["default"]["tile_map"].cpu().numpy()
    live = live[live[:, 0] >= 0]
    result = {"probe": "prefix_attention", "device": torch.cuda.get_device_name(), "block_m": block_m,
              "num_stages": ns.num_stages, "map": stats, "resources": resources["default"],
              "live_rows": live[:, [1, 2, 3, 5, 6]].tolist(),
              "us": {name: round(t, 2) for name, t in us.items()}, **sdpa_times(step)}  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
