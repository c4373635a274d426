#!/usr/bin/env bash
# The GPU session in one call: kernel and engine tests on the GPU, then the benchmarks of DESIGN.md.
# Usage (on the GPU machine, from the repo root): NANOSERVE_COMMIT=<sha> bash scripts/gpu_bench.sh [steps...]
# Each step's log goes to $OUT (or ./gpu-out); the JSON lines are collected in results.jsonl.
set -u
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
cfg=${BENCH_CONFIGS:-shared/bench-configs}
[ -d "$cfg" ] || cfg=../shared/bench-configs
steps=${*:-tests throughput latency-qwen latency-llama prefix}
# The server's dependencies travel as wheels in .whl/ (../shared/tools/gpu-wheels.sh): the machine has no registry.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
for step in $steps; do
  echo "== $step"
  case $step in
    tests) timeout 240 python -m pytest -q -x tests/gpu tests/kernels 2>&1 | tail -15 ;;
    throughput) timeout 540 python -m nanoserve.cli bench throughput --model "$cfg/qwen3-0.6b" --baseline hf ;;
    throughput-nohf) timeout 200 python -m nanoserve.cli bench throughput --model "$cfg/qwen3-0.6b" ;;
    latency-qwen) timeout 150 python -m nanoserve.cli bench latency --model "$cfg/qwen3-0.6b" --baseline hf ;;
    latency-llama) timeout 200 python -m nanoserve.cli bench latency --model "$cfg/llama-3.1-8b" --max-model-len 8192 --baseline hf ;;
    latency-qwen-nohf) timeout 150 python -m nanoserve.cli bench latency --model "$cfg/qwen3-0.6b" --max-model-len 8192 ;;
    # The same with q/k norm, rotary and the KV store inside decode attention's launch at every batch size, or at
    # none (the default fuses Qwen3's batch 1: model/llama.py).
    latency-qwen-fused) NANOSERVE_FUSED_ROPE_DECODE=1 timeout 150 python -m nanoserve.cli bench latency --model "$cfg/qwen3-0.6b" --max-model-len 8192 ;;
    latency-qwen-unfused) NANOSERVE_FUSED_ROPE_DECODE=0 timeout 150 python -m nanoserve.cli bench latency --model "$cfg/qwen3-0.6b" --max-model-len 8192 ;;
    latency-llama-nohf) timeout 200 python -m nanoserve.cli bench latency --model "$cfg/llama-3.1-8b" --max-model-len 8192 ;;
    # tests/gpu takes ~4-5 minutes on an H100 (fp32 Triton compiles and graph captures of the engine test).
    # The whole pytest log is kept: a summary line alone cannot say why a test failed.
    gpu-tests) timeout 420 python -m pytest -q -rf -p no:cacheprovider --durations=6 tests/gpu > "$out/gpu-tests-full.log" 2>&1
               grep -E "^(FAILED|ERROR)|Error" "$out/gpu-tests-full.log" | sort | uniq -c | sort -rn | head -20
               tail -9 "$out/gpu-tests-full.log" ;;
    gemm) timeout 200 python scripts/bench_gemm_shapes.py ;;
    lm-head) timeout 120 python scripts/probe_lm_head_shapes.py
             CUDA_MODULE_LOADING=EAGER timeout 180 python scripts/probe_lm_head_shapes.py ;;
    # The throughput run's GPU idle time between steps and the host's phases; then without the LM head's warm-up
    # at start, and with the step inputs copied from pageable memory (scripts/step_bubbles.py).
    bubbles) for mode in "" --no-lm-head-warm-up --pageable-copies; do
               timeout 200 python scripts/step_bubbles.py --model "$cfg/qwen3-0.6b" $mode \
                 --dump "$out/bubbles${mode:-default}.jsonl" 2>&1 | grep -v Warn | tail -8
             done ;;
    # Decode attention's launch configuration in the whole throughput run (step_bubbles --decode-options), and
    # alone at the run's batch sizes (sweep_decode_config); prefill attention's defaults and sweeps.
    decode-ab) n128='{"BLOCK_N": 128, "num_stages": 3}'
               timeout 200 python scripts/step_bubbles.py --model "$cfg/qwen3-0.6b" 2>&1 | tail -1
               timeout 200 python scripts/step_bubbles.py --model "$cfg/qwen3-0.6b" --decode-options "$n128" 2>&1 | tail -1
               timeout 200 python scripts/step_bubbles.py --model "$cfg/qwen3-0.6b" --decode-options "$n128" \
                 --decode-options-min-batch 129 2>&1 | tail -1 ;;
    # The device's read-only rate, decode attention's access pattern without its math, and a stream-K decode attention
    # (scripts/probe_read_bandwidth.py, probe_decode_stream.py).
    probe-read-bw) for b in 256 128; do timeout 300 python scripts/probe_read_bandwidth.py --batch $b; done ;;
    # Decode attention on the throughput recipe's own batch-256 step against the whole decode graph; what a
    # norm -> cuBLAS GEMM boundary costs; TunableOp over the decode GEMMs (scripts/probe_step_attention.py,
    # probe_kernel_boundaries.py, probe_tunable_gemm.py).
    probe-step-attn) timeout 300 python scripts/probe_step_attention.py --model "$cfg/qwen3-0.6b" 2>&1 | tail -1 ;;
    probe-boundaries) for r in 256 64; do timeout 120 python scripts/probe_kernel_boundaries.py --rows $r; done ;;
    probe-tunable) timeout 300 python scripts/probe_tunable_gemm.py | tail -1 ;;
    # Inductor's max-autotune Triton GEMMs (TMA-persistent templates included) against cuBLAS on the same shapes.
    probe-inductor) timeout 500 python scripts/probe_inductor_gemm.py 2>/dev/null | tail -1 ;;
    sweep-decode) for b in 256 128; do timeout 200 python scripts/sweep_decode_config.py --batch $b | tail -9; done ;;
    # A persistent kernel with grid barriers against one launch per GEMV, for the MLP half of a batch-1 layer.
    probe-mlp) timeout 200 python scripts/probe_persistent_mlp.py ;;
    # The batch-1 GEMVs of a Qwen3-0.6B layer chained as in decode, under other block sizes (gemv._config).
    sweep-gemv) timeout 200 python scripts/sweep_gemv_chain.py ;;
    # The same for Llama-3.1-8B's projections at one and two rows (cuBLAS and tensor-core variants included).
    sweep-gemv-llama) for r in 1 2; do timeout 250 python scripts/sweep_gemv_chain.py --model llama-3.1-8b --rows $r | tail -1; done ;;
    # Decode steps of two sequences (bench latency --batch-size 2), both models.
    latency-b2) for m in qwen3-0.6b llama-3.1-8b; do timeout 200 python -m nanoserve.cli bench latency --batch-size 2 --model "$cfg/$m" --max-model-len 8192; done ;;
    # The batch-1 decode of bench latency's shape through step_bubbles: is the GPU ever idle between steps?
    bubbles-b1) timeout 200 python scripts/step_bubbles.py --model "$cfg/qwen3-0.6b" --num-prompts 1 --max-len 640 2>&1 | grep -v Warn | tail -8 ;;
    prefill-attn) timeout 300 python scripts/bench_prefill_attention.py ;;
    # Whether prefill attention's K/V loads are software-pipelined (cp.async in the launched kernel's PTX).
    probe-pipelining) timeout 120 python scripts/probe_prefill_pipelining.py | tail -1 ;;
    # The prefix step's prefill attention taken apart (fixed cost, key tiles, merge) by editing its map.
    probe-prefix-attn) for a in "" "--block-m 128" "--block-m 32"; do timeout 120 python scripts/probe_prefix_attention.py $a | tail -1; done ;;
    # Host time of a graph replay and how late a graph starts on an idle GPU (prefill buckets, batch-1 decode).
    probe-graph-launch) timeout 200 python scripts/probe_graph_launch.py --model "$cfg/qwen3-0.6b" 2>&1 | tail -1 ;;
    # Batch 1: the qkv GEMM with q/k norm, rotary and the KV store in its epilogue, against the two launches.
    probe-fused-qkv) timeout 150 python scripts/probe_fused_qkv.py | tail -1 ;;
    # Llama-3.1-8B batch 1: a streaming GEMV with its prologue fused in place of cuBLAS (gate_up, down) in the chained
    # GEMVs; Hopper's bulk L2 prefetch of the next GEMM's weight on a side stream of the decode graph.
    probe-persistent-gemv) timeout 300 python scripts/probe_persistent_gemv.py --model llama-3.1-8b | tail -1 ;;
    probe-l2-prefetch) timeout 400 python scripts/probe_l2_prefetch.py --model "$cfg/llama-3.1-8b" | grep -E "^(micro|round|\{)" ;;
    # Qwen3-0.6B's qkv projection at 48-256 rows with qkv_rope_store's work in its epilogue, against cuBLAS + it.
    probe-qkv-gemm-rope) timeout 200 python scripts/probe_qkv_gemm_rope.py | grep -E "^M=" ;;
    # Qwen3-0.6B's GEMMs at 64-256 rows: a one-launch split-K Triton GEMM against cuBLAS.
    bench-splitk) timeout 300 python scripts/bench_splitk_gemm.py | grep -E "^(qkv|o |gate|down|M=)" ;;
    # Where a cached prefix request's TTFT goes: host phases, the rest of LLM.generate, and the step's GPU time.
    prefix-bubbles) timeout 200 python scripts/prefix_bubbles.py --model "$cfg/qwen3-0.6b" 2>&1 | grep -v Warn | tail -13 ;;
    # Host vs kernel time and the top kernels of an uncached prefill, a cached-prefix prefill and a batch-1 decode.
    profile-steps) timeout 200 python scripts/profile_steps.py --model "$cfg/qwen3-0.6b" --parts uncached,cached 2>&1 | grep -v Warn ;;
    prefix) timeout 200 python -m nanoserve.cli bench prefix --model "$cfg/qwen3-0.6b" --max-model-len 4096 ;;
    # The same recipe on the 8B model (DESIGN.md's prefix recipe names none): per-step fixed costs weigh less there.
    prefix-llama) timeout 300 python -m nanoserve.cli bench prefix --model "$cfg/llama-3.1-8b" --max-model-len 4096 ;;
    serve-inf) timeout 300 python -m nanoserve.cli bench serve --launch --no-progress --model "$cfg/qwen3-0.6b" --load-format dummy --dtype bfloat16 ;;
    # serve-inf and serve-16 run the default (on CUDA the engine in its own process); -thread keeps it on the server's thread.
    serve-inf-thread) timeout 300 python -m nanoserve.cli bench serve --launch --no-progress --model "$cfg/qwen3-0.6b" --load-format dummy --dtype bfloat16 --no-engine-process ;;
    serve-16-thread) timeout 300 python -m nanoserve.cli bench serve --launch --no-progress --request-rate 16 --model "$cfg/qwen3-0.6b" --load-format dummy --dtype bfloat16 --no-engine-process ;;
    timeline) timeout 200 python scripts/step_timeline.py --model "$cfg/qwen3-0.6b" 2>&1 | grep -v Warn | tail -16 ;;
    serve-16) timeout 300 python -m nanoserve.cli bench serve --launch --no-progress --request-rate 16 --model "$cfg/qwen3-0.6b" --load-format dummy --dtype bfloat16 ;;
    profile-prefix) timeout 200 python -m cProfile -s tottime -m nanoserve.cli bench prefix --model "$cfg/qwen3-0.6b" --max-model-len 4096 --num-requests 40 2>&1 | grep -A30 "Ordered by" ;;
    profile) timeout 200 python -m cProfile -s tottime -m nanoserve.cli bench throughput --model "$cfg/qwen3-0.6b" 2>&1 | grep -A40 "Ordered by" ;;
  esac > "$out/$step.log" 2>&1
  tail -"${TAIL:-3}" "$out/$step.log"
  grep -h '^{' "$out/$step.log" >> "$out/results.jsonl"
done
