"""Are prefill attention's key/value loads software-pipelined on this GPU? Runs the kernel once at each stage count
on bench_prefill_attention.py's cached-prefix case (100 new tokens over 2,100 keys, Qwen3-0.6B's heads) and
prints, per compiled variant, the cp.async instructions in its PTX (0 would mean every key tile waits for its own
loads), registers, spills, shared memory and programs per SM. It must go through the JIT launch: a kernel compiled
offline from its source alone (no pointer alignment known) shows no cp.async even where the launched one has them.

    python scripts/probe_prefill_pipelining.py [--stages 2 3]
Ends with one JSON line.
"""

import argparse
import json

from bench_prefill_attention import _compiled_kernels, _resources, cases, make_step

from nanoserve.kernels import prefill_attention as pa


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ns = p.parse_args()
    step = make_step(cases()["a_cached_100_over_2000"])
    k_cache, v_cache = step["caches"][0]
    head_dim = step["q"].shape[-1]
    for stages in ns.stages:
        pa.prefill_attention(step["q"], k_cache, v_cache, step["cu_dev"], step["seq_lens_dev"], step["tables"],
                             step["bucket"], head_dim**-0.5, num_stages=stages)  # fmt: skip
    variants = []
    for kernel in _compiled_kernels().values():
        variants.append({"num_stages": kernel.metadata.num_stages, "cp_async": kernel.asm["ptx"].count("cp.async"),
                         **_resources(kernel)})  # fmt: skip
        print(variants[-1])
    print(json.dumps({"variants": variants}))


if __name__ == "__main__":
    main()
