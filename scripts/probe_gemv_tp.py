"""Probe (delete once its figures are recorded): the batch-1 GEMV (kernels/gemv.py) at Llama-3.1-8B's projections
split four ways (TP=4) and whole, the rule's config against alternatives, in CUDA graphs. One JSON line."""

import json

import torch

from nanoserve.kernels import gemv

SHAPES = {  # name: (N, K), bf16
    "qkv/4": (1536, 4096), "o/4": (4096, 1024), "gate_up/4": (7168, 4096), "down/4": (4096, 3584),
    "lm_head/4": (32064, 4096), "gate_up/1": (28672, 4096), "down/1": (4096, 14336),
}
CONFIGS = [gemv._Config(False, 1, bn, bk, 4, 1) for bn in (2, 4, 8) for bk in (512, 1024)] + [
    gemv._Config(True, 16, bn, 256, 4, 4) for bn in (16, 32, 64)
]


def time_us(fn, calls: int = 50, replays: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def probe_shape(name: str, n: int, k: int) -> dict:
    # Several weights in turn so the L2 (50 MB) cannot hold one between calls.
    count = max(2, (200 << 20) // (n * k * 2))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    turn = [0]

    def call(cfg: gemv._Config) -> None:
        w = weights[turn[0] % len(weights)]
        turn[0] += 1
        gemv._launch(x, w, None, y, cfg)

    rule = gemv._config(1, n, k, 2)
    row = {"shape": name, "mb": round(n * k * 2 / 2**20, 1), "rule": str(tuple(rule))}
    row["rule_us"] = round(time_us(lambda: call(rule)), 2)
    for cfg in CONFIGS:
        key = f"{'tc' if cfg.use_dot else 'cc'}_n{cfg.block_n}_k{cfg.block_k}_us"
        try:
            row[key] = round(time_us(lambda c=cfg: call(c)), 2)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            row[key] = type(exc).__name__
    best = min((v, key) for key, v in row.items() if key.endswith("_us") and isinstance(v, float))
    row["best"] = best[1]
    row["rule_tbps"] = round(n * k * 2 / row["rule_us"] / 1e6, 2)
    row["best_tbps"] = round(n * k * 2 / best[0] / 1e6, 2)
    return row


def main() -> None:
    out = {"probe": "gemv_tp", "device": torch.cuda.get_device_name(0), "results": []}
    for name, (n, k) in SHAPES.items():
        row = probe_shape(name, n, k)
        print({key: row[key] for key in ("shape", "rule", "rule_us", "best", "rule_tbps", "best_tbps")}, flush=True)
        out["results"].append(row)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
