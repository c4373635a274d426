"""Multi-turn chat with a GPU KV pool too small for every conversation: time to first token with and without the
CPU tier under the prefix cache (--kv-offload-gb).

    nanoserve bench multi-turn --model DIR [--num-kv-blocks N] [--kv-offload-gb G]

DIR: a model directory; with only a config.json in it, the weights are random (--load-format dummy).
Conversations share a system prompt and each grows its own history: turn t sends the history so far (system prompt,
earlier questions and answers) plus a new question, one request at a time, the conversations taking turns, so
that by the time a conversation comes back the others have pushed its history out of the GPU pool. Each request
generates one token (its TTFT is its prefill, cached or not); its answer is then made of random tokens, as the
next turn's history. Without --num-kv-blocks the GPU pool holds an eighth of the final histories; without
--kv-offload-gb the tier holds all of them, up to 32 GiB (pinned memory; Qwen3-0.6B's 200 x 8 turns would take 90).
Turn 1 (nothing cached but the system prompt) is left out of the figures.

    nanoserve bench multi-turn --base-url http://127.0.0.1:8000 [--max-concurrency C]

runs the same conversations against a server, or a router, to compare routing policies (bench/multi_turn_http.py).
"""

import asyncio
import time

import numpy as np

from nanoserve.args import at_least_one
from nanoserve.bench.common import emit, engine_args, engine_facts, free_device_memory, parser
from nanoserve.bench.lengths import fit_lengths
from nanoserve.bench.multi_turn_http import run_http
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams
from nanoserve.worker.kv_cache import bytes_per_block

# On a model with a shorter context than the final histories the three are scaled down (bench/lengths.py).
RECIPE = {"system_len": 1000, "question_len": 100, "answer_len": 200}


def conversations(vocab: int, ns) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt, and each conversation's (question, answer) token ids turn by turn."""
    rng = np.random.default_rng(ns.seed)
    system = rng.integers(0, vocab, ns.system_len).tolist()
    turns = [[(rng.integers(0, vocab, ns.question_len).tolist(), rng.integers(0, vocab, ns.answer_len).tolist())
              for _ in range(ns.turns)] for _ in range(ns.num_conversations)]
    return system, turns


def run(llm: LLM, system: list[int], turns: list) -> tuple[list[float], int]:
    """TTFT of every request from turn 2 on, and the prompt tokens served from the cache in all of them."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    histories = [list(system) for _ in turns]
    times, cached = [], 0
    for t in range(len(turns[0])):
        for history, conversation in zip(histories, turns, strict=True):
            question, answer = conversation[t]
            prompt = history + question
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            if t:
                times.append(time.perf_counter() - start)
                cached += out.num_cached_tokens
            history += question + out.outputs[0].token_ids + answer
    return times, cached


def main(argv: list[str] | None = None) -> int:
    p = parser("multi-turn", __doc__)
    p.add_argument("--num-conversations", type=int, default=200, help="conversations, taking turns")
    p.add_argument("--turns", type=int, default=8, help="turns of each conversation")
    p.add_argument("--system-len", type=at_least_one, default=None,
                   help="tokens of the system prompt all conversations share; None: 1000, scaled down with "
                        "--question-len and --answer-len where the model's context is shorter than a final history")
    p.add_argument("--question-len", type=at_least_one, default=None,
                   help="tokens of each question; None: 100, as --system-len")
    p.add_argument("--answer-len", type=at_least_one, default=None,
                   help="tokens of each answer (random ids); None: 200, as --system-len")
    p.add_argument("--base-url", default=None,
                   help="run the conversations against this server (nanoserve serve, or nanoserve router) instead of "
                        "an engine of its own, to compare routing (bench/multi_turn_http.py); the engine flags are "
                        "then the server's; None: an engine in this process")
    p.add_argument("--api-key", default=None, help="with --base-url: the server's API key")
    p.add_argument("--max-concurrency", type=at_least_one, default=1,
                   help="with --base-url: conversations sending their turn at once")
    ns = p.parse_args(argv)

    def history(n: dict) -> int:  # the longest prompt: the last turn's, plus its one generated token
        return n["system_len"] + ns.turns * (n["question_len"] + 1 + n["answer_len"])

    if ns.base_url is not None:
        emit(asyncio.run(run_http(ns, RECIPE, conversations, history)))
        return 0
    context = engine_args(ns).create_config().max_model_len  # the model's, or --max-model-len

    fit_lengths(ns, RECIPE, history, context, "multi-turn")
    final = history(vars(ns))
    blocks_all = ns.num_conversations * -(-final // ns.block_size)
    if ns.num_kv_blocks is None:
        ns.num_kv_blocks = max(blocks_all // 8, 2 * -(-final // ns.block_size))
    ns.max_model_len = ns.max_model_len or final
    result = {"bench": "multi-turn", "num_conversations": ns.num_conversations, "turns": ns.turns,
              "system_len": ns.system_len, "question_len": ns.question_len, "answer_len": ns.answer_len,
              "num_kv_blocks": ns.num_kv_blocks}
    offload_gb = ns.kv_offload_gb
    for tier in (False, True):
        args = engine_args(ns)
        if tier and not offload_gb:  # room for every history, as the tier's own config decides the block size
            offload_gb = min(32.0, 1.2 * blocks_all * bytes_per_block(args.create_config()) / (1 << 30))
        args.kv_offload_gb = offload_gb if tier else 0.0
        llm = LLM(**vars(args))
        result |= engine_facts(llm.engine.config)
        system, turns = conversations(llm.engine.config.model.vocab_size, ns)
        llm.generate([list(range(1, 2 * ns.block_size))], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
        times, cached = run(llm, system, turns)
        key = "cpu_tier" if tier else "gpu_only"
        bm = llm.engine.block_manager
        result |= {f"ttft_{key}_p50_ms": round(1e3 * float(np.median(times)), 2),
                   f"ttft_{key}_mean_ms": round(1e3 * float(np.mean(times)), 2),
                   f"ttft_{key}_p99_ms": round(1e3 * float(np.percentile(times, 99)), 2),
                   f"cached_tokens_{key}": cached}
        if tier:
            result |= {"kv_offload_gb": round(offload_gb, 3), "cpu_prefix_hits": bm.cpu_prefix_hits,
                       "cpu_blocks_loaded": bm.cpu.loaded, "cpu_blocks_stored": bm.cpu.stored}
        llm.shutdown()
        del llm
        free_device_memory()
    result["ratio_p50"] = round(result["ttft_cpu_tier_p50_ms"] / result["ttft_gpu_only_p50_ms"], 3)
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
