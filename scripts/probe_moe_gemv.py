"""Times the small-batch paths of one MoE layer's experts on this GPU: kernels/moe_gemv.py under each of its tile
rules against fused_moe's grouped GEMMs (its measured table or default rule), in CUDA graphs of 8 calls with their
own routings, as scripts/tune_fused_moe.py times. For choosing moe_gemv's MAX_PAIRS, TILE_ELEMENTS, NUM_WARPS and
DOWN_WEIGHTS_BEFORE_WAIT (the `_late_down` column: off).
Prints per token count the microseconds a call and the bandwidth over the bytes of the experts its tokens touched
(distinct experts, each read once); one JSON line last.

    python scripts/probe_moe_gemv.py                          # Qwen3-30B-A3B: E=128, H=2048, I=768, top_k=8
    python scripts/probe_moe_gemv.py --preset gpt-oss-20b     # swigluoai and biases
    python scripts/probe_moe_gemv.py --inter 384              # the same model's experts at TP=2
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import tune_fused_moe as tuner  # noqa: E402 - a sibling script, not a package

from nanoserve.kernels import moe_gemv as mg  # noqa: E402
from nanoserve.kernels.fused_moe import fused_moe  # noqa: E402

GEMV_RULES = [(tile, warps) for tile in (2048, 4096, 8192) for warps in (4, 8)]


def touched_bytes(ids: list[torch.Tensor], shape: tuner.Shape) -> float:
    """Mean bytes of the distinct experts a call's tokens chose (bf16 weights, and biases if any)."""
    per_expert = 3 * shape.inter * shape.hidden * 2 + ((3 * shape.inter + shape.hidden) * 2 if shape.bias else 0)
    return sum(len(set(i.flatten().tolist())) for i in ids) / len(ids) * per_expert


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(tuner.PRESETS), default="qwen3-30b-a3b")
    parser.add_argument("--inter", type=int, help="each expert's intermediate size on this rank (I)")
    parser.add_argument("--tokens", default="1,2,4,8", help="comma-separated token counts")
    args = parser.parse_args()
    preset = dict(tuner.PRESETS[args.preset])
    if args.inter:
        preset["inter"] = args.inter
    shape = tuner.Shape(**preset, ep_size=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w13, w2, b13, b2 = tuner._weights(shape, shape.num_experts, device)
    gen = torch.Generator(device=device).manual_seed(1)
    mg.MAX_PAIRS = 1 << 30  # past the rule too, to see where the grouped GEMMs overtake
    kw = dict(w13_bias=b13, w2_bias=b2, activation=shape.activation)
    results = []
    for m in [int(t) for t in args.tokens.split(",")]:
        xs = [torch.randn(m, shape.hidden, generator=gen, device=device).bfloat16() for _ in range(tuner.ROUTINGS)]
        routings = [tuner._routing(m, shape, gen, device) for _ in range(tuner.ROUTINGS)]
        touched = touched_bytes([ids for ids, _ in routings], shape)
        row = {"tokens": m, "touched_mb": round(touched / 1e6, 1)}
        row["fused_moe_us"] = tuner.time_us(
            [lambda x=x, r=r: fused_moe(x, w13, w2, r[1], r[0], **kw) for x, r in zip(xs, routings, strict=True)]
        )
        for tile, warps, early in [(t, w, True) for t, w in GEMV_RULES] + [(4096, 4, False)]:
            mg.TILE_ELEMENTS, mg.NUM_WARPS, mg.DOWN_WEIGHTS_BEFORE_WAIT = tile, warps, early
            row[f"gemv_tile{tile}_warps{warps}{'' if early else '_late_down'}_us"] = tuner.time_us(
                [lambda x=x, r=r: mg.moe_gemv(x, w13, w2, r[1], r[0], **kw) for x, r in zip(xs, routings, strict=True)]
            )
        for key in [k for k in row if k.endswith("_us")]:
            row[key.replace("_us", "_tbps")] = round(touched / row[key] / 1e6, 2)  # bytes a us / 1e6: TB/s
            row[key] = round(row[key], 1)
        print(row)
        results.append(row)
    print(
        json.dumps(
            {
                "probe": "moe_gemv",
                "shape": str(shape),
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
