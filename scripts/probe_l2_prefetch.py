"""Does warming L2 with a GEMM's weight, beside the short kernels before it, shorten batch-1 decode?

First, alone: one layer's o_proj and qkv_proj weights read (a cuBLAS GEMV, and a plain sum) after L2 was flushed,
cold or after the whole weight was prefetched and a sleep of 20,000 or 200,000 cycles let the prefetch land.
Then each variant recaptures the batch-1 decode graph with prefetches (the kernel below, Hopper's bulk L2
prefetch) forked onto a side stream at points of the decoder layer, then times bench latency's loop (prompt 128,
512 tokens, median of 3).
Points, by what the side kernel runs beside (it starts when the kernel before the point completes):
  A: the input norm and qkv_proj   B: attention   C: o_proj   D: the post-attention norm and gate_up
  E: SiLU-and-mul and down_proj
A spec is POINT:WEIGHT:MB[,...], WEIGHT one of qkv, o, gate_up, down, next_qkv (the next layer's).

    python scripts/probe_l2_prefetch.py --model shared/bench-configs/llama-3.1-8b [--variants NAME=SPEC ...]
Ends with one JSON line.
"""

import argparse
import json
import time

import numpy as np
import torch
import triton
import triton.language as tl

from nanoserve.bench import roofline
from nanoserve.bench.common import free_device_memory
from nanoserve.llm import LLM
from nanoserve.model.llama import LlamaDecoderLayer
from nanoserve.sampling_params import SamplingParams
from nanoserve.worker.cuda_graphs import CUDAGraphRunner

# The prefetch kernel.
CHUNK_BYTES = 32 << 10

# One chunk a thread ($1 its address, $2 its size, none past the end); the output $0 is a dummy.
_ASM = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")
# The same with the lines marked to be evicted after unmarked ones, so the GEMMs streaming past meanwhile do not
# push them out.
_EVICT_LAST_ASM = tl.constexpr("""{
.reg .pred p;
.reg .b64 pol;
setp.gt.s32 p, $2, 0;
createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
mov.u32 $0, 0;
}""")


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, EVICT_LAST: tl.constexpr):
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.maximum(tl.minimum(nbytes - offs, CHUNK), 0).to(tl.int32)
    if EVICT_LAST:
        tl.inline_asm_elementwise(_EVICT_LAST_ASM, "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False,
                                  pack=1)
    else:
        tl.inline_asm_elementwise(_ASM, "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, nbytes: int, evict_last: bool = False, chunk: int = CHUNK_BYTES) -> None:
    """Ask L2 for the first nbytes (rounded down to 16) of contiguous t, without waiting for them: 32 chunks a
    program, one a thread."""
    nbytes = min(nbytes, t.numel() * t.element_size()) // 16 * 16
    if nbytes <= 0:
        return
    flat = t.view(-1).view(torch.uint8)
    grid = (triton.cdiv(nbytes, chunk * 32),)
    _l2_prefetch_kernel[grid](flat, nbytes, CHUNK=chunk, LANES=32, EVICT_LAST=evict_last, num_warps=1)


DEFAULT_VARIANTS = {
    "none": "",
    "o@B": "B:o:64",
    "o@A": "A:o:64",
    "mlp": "D:gate_up:24,E:down:12",
    "all": "A:qkv:24,B:o:64,D:gate_up:24,E:down:12",
    "all_big": "A:qkv:32,B:o:64,D:gate_up:40,E:down:24",
    "all_early": "A:qkv:24,A:o:64,C:gate_up:24,D:down:12",
}


def parse_spec(spec: str) -> list[tuple[str, str, float]]:
    out = []
    for part in filter(None, spec.split(",")):
        point, weight, mb = part.split(":")
        out.append((point, weight, float(mb)))
    return out


def weight_of(layer, nxt, name: str) -> torch.Tensor | None:
    if name == "next_qkv":
        return nxt.self_attn.qkv_proj.weight if nxt is not None else None
    mods = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj}
    return mods[name].weight


def capture(llm: LLM, spec, evict_last: bool, chunk: int, side: torch.cuda.Stream) -> None:
    runner, cfg = llm.engine.runner, llm.engine.config
    layers = list(runner.model.model.layers)
    following = {id(a): b for a, b in zip(layers, layers[1:] + [None], strict=True)}
    original_layer, original_graph = LlamaDecoderLayer.forward, CUDAGraphRunner._forward
    forked = []

    def layer_forward(self, positions, x, residual, meta):
        def at(point):
            for p, name, mb in spec:
                w = weight_of(self, following[id(self)], name) if p == point else None
                if w is not None:
                    forked.append(point)
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        l2_prefetch(w, int(mb * 2**20), evict_last, chunk)

        at("A")
        qkv, residual = self.project_qkv(x, residual, meta)
        at("B")
        attn = self.self_attn(positions, qkv, meta)
        at("C")
        x = self.self_attn.o_proj(attn.flatten(1))
        at("D")
        gate_up, residual = self.mlp.gate_up_proj.forward_norm(x, residual, self.post_attention_layernorm)
        at("E")
        return self.mlp(gate_up), residual

    def graph_forward(self, *args):
        out = original_graph(self, *args)
        if forked:  # join the side stream before the capture ends (waiting on it unforked breaks the capture)
            torch.cuda.current_stream().wait_stream(side)
            forked.clear()
        return out

    LlamaDecoderLayer.forward, CUDAGraphRunner._forward = layer_forward, graph_forward
    try:
        runner.graphs = None
        free_device_memory()
        graphs = CUDAGraphRunner(runner.model, 1, -(-cfg.max_model_len // cfg.args.block_size), cfg.device)
        graphs.capture()
        runner.graphs = graphs
    finally:
        LlamaDecoderLayer.forward, CUDAGraphRunner._forward = original_layer, original_graph


def time_decode(llm: LLM, prompt: list[int], output_len: int, iters: int) -> tuple[float, list[int]]:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    per_token = []
    for it in range(iters):
        engine.add_request(f"p-{time.monotonic_ns()}-{it}", prompt, params)
        stamps = []
        while engine.has_unfinished_requests():
            if engine.step():
                stamps.append(time.perf_counter())
        per_token.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    tokens = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    return float(np.median(per_token)), list(tokens)


def micro(w: torch.Tensor, evict_last: bool, chunk: int) -> dict:
    """us a read of w, cold (L2 flushed) and prefetched (L2 flushed, then all of w prefetched), after a sleep."""
    x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=w.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reads = {"gemv": lambda: torch.matmul(x, w.T), "sum": lambda: w.sum(dtype=torch.float32)}
    result = {}
    for sleep in (20_000, 200_000):
        for read_name, read in reads.items():
            for mode in ("cold", "prefetched"):
                times = []
                for _ in range(20):
                    flush.zero_()
                    if mode == "prefetched":
                        l2_prefetch(w, w.numel() * w.element_size(), evict_last, chunk)
                    torch.cuda._sleep(sleep)
                    start.record()
                    read()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3)
                result[f"{read_name} {mode} sleep {sleep}"] = round(float(np.median(times)), 1)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--variants", nargs="*", help="NAME=SPEC; default: a built-in set")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--evict-last", action="store_true")
    p.add_argument("--chunk-kb", type=int, default=CHUNK_BYTES >> 10)
    ns = p.parse_args()
    variants = dict(v.split("=", 1) for v in ns.variants) if ns.variants else DEFAULT_VARIANTS
    llm = LLM(model=ns.model, load_format="dummy", dtype="bfloat16", max_model_len=8192, max_num_seqs=1,
              max_num_batched_tokens=512)
    cfg = llm.engine.config
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.model.vocab_size, 128).tolist()
    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    bw = roofline.measure_bandwidth(cfg.device)
    step_bytes = roofline.model_bytes(llm.engine.runner.model) + (128 + ns.output_len / 2) * (
        roofline.kv_bytes_per_token(cfg))
    layer = llm.engine.runner.model.model.layers[0]
    for name in ("o", "qkv"):
        print(f"micro {name}:", micro(weight_of(layer, None, name), ns.evict_last, ns.chunk_kb << 10), flush=True)
    side = torch.cuda.Stream()
    results: dict[str, list[float]] = {name: [] for name in variants}
    reference = None
    for r in range(ns.rounds):
        for name, spec in variants.items():
            capture(llm, parse_spec(spec), ns.evict_last, ns.chunk_kb << 10, side)
            ms, tokens = time_decode(llm, prompt, ns.output_len, ns.iters)
            reference = reference or tokens
            results[name].append(round(ms * 1e3, 4))
            print(f"round {r} {name:>10} {spec:<45} {ms * 1e3:.4f} ms/token  MBU {step_bytes / ms / bw:.4f}  "
                  f"same tokens: {tokens == reference}", flush=True)
    summary = {name: {"ms_per_token": v, "mbu": [round(step_bytes / (m / 1e3) / bw, 4) for m in v]}
               for name, v in results.items()}
    print(json.dumps({"probe": "l2_prefetch", "model": ns.model, "evict_last": ns.evict_last,
                      "chunk_kb": ns.chunk_kb, "bandwidth_tb_s": round(bw / 1e12, 3), "variants": summary,
                      "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
