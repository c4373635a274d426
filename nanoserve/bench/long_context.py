"""Long context beyond the GPU's KV pool: one long prompt, then decode, with the GPU pool limited so that the context
does not fit (its older blocks in the CPU pool, --kv-offload-gb), beside the same run with a pool that holds it.

    nanoserve bench long-context --model DIR [--prompt-lens 65536 130816] [--output-len 256] [--gpu-kv-tokens 8192]

DIR: a model directory; with only a config.json in it, the weights are random (--load-format dummy). Prefill tok/s
is prompt tokens over the time to the first token; decode tok/s is the other output tokens over the time after it.
"""

import time

import numpy as np

from nanoserve.args import at_least_one
from nanoserve.bench.common import emit, engine_args, engine_facts, free_device_memory, kv_facts, parser
from nanoserve.bench.lengths import fit_lengths
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams
from nanoserve.worker.kv_cache import bytes_per_block

# Llama-3.1-8B's 128k context against 8k tokens of GPU pool; on a model with a shorter context all three are scaled
# down together, so that the prompts still outgrow the pool (bench/lengths.py).
RECIPE = {"prompt_lens": [65536, 130816], "output_len": 256, "gpu_kv_tokens": 8192}


def measure(llm: LLM, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one request."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    end = time.perf_counter()
    first = out.metrics.first_token_time
    # The metrics' clock is time.monotonic: the first token's delay from the request's arrival.
    ttft = first - out.metrics.arrival_time
    decode_s = (end - start) - ttft
    return len(prompt) / ttft, (len(out.outputs[0].token_ids) - 1) / decode_s


def main(argv: list[str] | None = None) -> int:
    p = parser("long-context", __doc__)
    p.add_argument("--prompt-lens", type=at_least_one, nargs="+", default=None,
                   help="prompt lengths, one run each; None: 65536 130816, scaled down with --output-len and "
                        "--gpu-kv-tokens where the model's context is shorter")
    p.add_argument("--output-len", type=at_least_one, default=None,
                   help="tokens generated after each prompt; None: 256, as --prompt-lens")
    p.add_argument("--gpu-kv-tokens", type=at_least_one, default=None,
                   help="the GPU pool of the offload runs, in tokens; None: 8192, as --prompt-lens")
    ns = p.parse_args(argv)
    context = engine_args(ns).create_config().max_model_len  # the model's, or --max-model-len
    # Decode tok/s counts the tokens after the first; the pool must hold at least a block.
    fit_lengths(ns, RECIPE, lambda n: max(n["prompt_lens"]) + n["output_len"], context, "long-context",
                floors={"output_len": 2, "gpu_kv_tokens": ns.block_size})
    longest = max(ns.prompt_lens) + ns.output_len
    ns.max_model_len = ns.max_model_len or longest
    result = {"bench": "long-context", "prompt_lens": ns.prompt_lens, "output_len": ns.output_len,
              "gpu_kv_tokens": ns.gpu_kv_tokens}
    for offload in (True, False):
        args = engine_args(ns)
        if offload:
            args.num_kv_blocks = ns.gpu_kv_tokens // args.block_size
            # The CPU tier takes one pool for every layer: a model with sliding-window layers keeps their
            # out-of-window blocks in this run (its all-GPU run frees them).
            args.disable_hybrid_kv_cache_manager = True
            args.kv_offload_gb = 1.1 * -(-longest // args.block_size) * bytes_per_block(args.create_config()) / 2**30
        llm = LLM(**vars(args))
        result |= engine_facts(llm.engine.config)
        rng = np.random.default_rng(ns.seed)
        vocab = llm.engine.config.model.vocab_size
        # Warm-up on the path measured: in the offload run a prompt over the GPU pool takes long-context mode (its
        # kernels and copies); the 63-token warm-up before did not, and the first prompt measured likely paid for
        # that (65,536 tokens: 0.305 of all-GPU, 130,816 after it: 0.821; H100, 6bd0177).
        warm = min(2 * ns.gpu_kv_tokens, min(ns.prompt_lens))
        llm.generate([rng.integers(0, vocab, warm).tolist()], SamplingParams(max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
        key = "offload" if offload else "gpu"
        for n in ns.prompt_lens:
            prefill, decode = measure(llm, rng.integers(0, vocab, n).tolist(), ns.output_len)
            result |= {f"prefill_tok_s_{key}_{n}": round(prefill, 1), f"decode_tok_s_{key}_{n}": round(decode, 2)}
            print(f"{key} {n}: prefill {prefill:.0f} tok/s, decode {decode:.2f} tok/s", flush=True)
        if offload:
            result["kv_offload_gb"] = float(f"{args.kv_offload_gb:.4g}")
        else:  # the all-GPU run: what its pools hold (the longest context that fits, KV bytes per token)
            result |= kv_facts(llm.engine.runner)
        llm.shutdown()
        del llm
        free_device_memory()
    for n in ns.prompt_lens:
        result[f"prefill_ratio_{n}"] = round(result[f"prefill_tok_s_offload_{n}"] / result[f"prefill_tok_s_gpu_{n}"], 3)
        result[f"decode_ratio_{n}"] = round(result[f"decode_tok_s_offload_{n}"] / result[f"decode_tok_s_gpu_{n}"], 3)
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
