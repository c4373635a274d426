#!/usr/bin/env bash
# The GPU tests, then the benchmarks through the CLI (the figures of BENCHMARKS.md).
# Usage, on the GPU machine from the repo root (the model configs are the repository's benchmarks/configs):
#   NANOSERVE_COMMIT=<sha> bash scripts/gpu_bench.sh [steps...]
# Steps: tests throughput latency-qwen latency-llama prefix serve-inf serve-16 multi-turn long-context structured
# moe-tune moe moe-serve fp8 fp8-kv
# (default: the first seven, ~20 minutes). structured needs QWEN3_TOKENIZER (scripts/qwen3_tokenizer.py's output).
# On 2+ GPUs, with TP=2 (or TP=4, 8): tp-tests tp-throughput tp-latency tp-latency-nccl tp-profile tp-profile-nccl
# tp-70b tp-serve-inf tp-serve-16.
# NANOSERVE_COMMIT is what the JSON lines report as `commit` (the device's copy of the tree may have no .git).
# Each step's log goes to $OUT (or ./gpu-out); the JSON lines are collected in results.jsonl.
set -u
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # the tree runs uninstalled there
cfg=benchmarks/configs
steps=${*:-tests throughput latency-qwen latency-llama prefix serve-inf serve-16}
TP=${TP:-2}
# NVLink multicast stays off on the lent machines, in every process started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The server's dependencies travel as wheels in .whl/ (../shared/tools/gpu-wheels.sh): the machine has no registry.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
serve="python -m nanoserve.cli bench serve --launch --no-progress --model $cfg/qwen3-0.6b"
serve="$serve --load-format dummy --dtype bfloat16"
serve_llama="python -m nanoserve.cli bench serve --launch --no-progress --model $cfg/llama-3.1-8b --load-format dummy"
serve_llama="$serve_llama --dtype bfloat16"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
for step in $steps; do
  echo "== $step"
  case $step in
    # The whole pytest log is kept (a summary line alone cannot say why a test failed); ~4-5 minutes on an H100.
    tests) timeout 570 python -m pytest -q -rf -p no:cacheprovider tests/gpu tests/kernels > "$out/tests-full.log" 2>&1
           tail -5 "$out/tests-full.log" ;;
    # --baseline hf adds transformers' generate on the same workload (~250 s on an H100).
    throughput) timeout 570 python -m nanoserve.cli bench throughput --model "$cfg/qwen3-0.6b" --baseline hf ;;
    latency-qwen) timeout 200 python -m nanoserve.cli bench latency --model "$cfg/qwen3-0.6b" --max-model-len 8192 ;;
    latency-llama) timeout 300 python -m nanoserve.cli bench latency --model "$cfg/llama-3.1-8b" --max-model-len 8192 ;;
    prefix) timeout 200 python -m nanoserve.cli bench prefix --model "$cfg/qwen3-0.6b" --max-model-len 4096 ;;
    multi-turn) timeout 500 python -m nanoserve.cli bench multi-turn --model "$cfg/llama-3.1-8b" ;;
    long-context) timeout 580 python -m nanoserve.cli bench long-context --model "$cfg/llama-3.1-8b" --output-len 64 ;;
    structured) timeout 500 python -m nanoserve.cli bench throughput --model "$cfg/qwen3-0.6b" \
                  --tokenizer "$QWEN3_TOKENIZER" --json-schema nanoserve/bench/schemas/records.json ;;
    # ~100 s an engine with Triton's cache cold (fp32 first): a call of its own.
    tp-tests) timeout 540 python -m pytest -q -rf -s -p no:cacheprovider tests/gpu/test_allreduce_gpu.py \
                tests/gpu/test_tensor_parallel_gpu.py ;;
    # TP=1 beside TP=$TP in the same call, so that the ratio compares runs on the same machine.
    tp-throughput) for n in 1 "$TP"; do timeout 280 python -m nanoserve.cli bench throughput \
                     --model "$cfg/llama-3.1-8b" --tensor-parallel-size "$n"; done ;;
    tp-latency) for n in 1 "$TP"; do timeout 150 python -m nanoserve.cli bench latency --model "$cfg/llama-3.1-8b" \
                  --max-model-len 8192 --tensor-parallel-size "$n"; done ;;
    # TP=$TP with NCCL for every all-reduce (no symmetric memory): beside tp-latency, what the one-shot all-reduce gives.
    tp-latency-nccl) timeout 150 python -m nanoserve.cli bench latency --model "$cfg/llama-3.1-8b" \
                       --max-model-len 8192 --tensor-parallel-size "$TP" --disable-custom-all-reduce ;;
    # Where a decode step's time goes (collective, attention, matmul, other), at batch 1 and 256, TP=1 and TP=$TP.
    tp-profile) for n in 1 "$TP"; do for b in 1 256; do timeout 140 python -m nanoserve.cli bench latency \
                  --model "$cfg/llama-3.1-8b" --max-model-len 4096 --batch-size "$b" --output-len 128 --iters 1 \
                  --profile --tensor-parallel-size "$n"; done; done ;;
    tp-profile-nccl) for b in 1 256; do timeout 140 python -m nanoserve.cli bench latency --model "$cfg/llama-3.1-8b" \
                       --max-model-len 4096 --batch-size "$b" --output-len 128 --iters 1 --profile \
                       --tensor-parallel-size "$TP" --disable-custom-all-reduce; done ;;
    # 141 GB of bf16 weights: one H100 or H200 cannot hold it, so there is no TP=1 row. At TP=2 on H100s the weights
    # leave ~10 GiB a card, hence the higher memory fraction; 128 prompts keep the step inside a call's 10 minutes.
    tp-70b) timeout 200 python -m nanoserve.cli bench throughput --model "$cfg/llama-3.1-70b" --tensor-parallel-size "$TP" \
              --gpu-memory-utilization 0.95 --num-prompts 128 --max-model-len 4096
            timeout 120 python -m nanoserve.cli bench latency --model "$cfg/llama-3.1-70b" --max-model-len 8192 \
              --tensor-parallel-size "$TP" --gpu-memory-utilization 0.95 --iters 2 ;;
    tp-serve-inf) timeout 300 $serve_llama --tensor-parallel-size "$TP" ;;
    tp-serve-16) timeout 300 $serve_llama --tensor-parallel-size "$TP" --request-rate 16 ;;
    # Mixture of experts (BENCHMARKS.md table 9): the fused kernel's tile table for this GPU (commit the JSON file),
    # then the recipes on Qwen3-30B-A3B; serve at concurrency 10 with 2,048-token prompts and 1,024 output tokens.
    moe-tune) timeout 280 python scripts/tune_fused_moe.py && cp nanoserve/kernels/fused_moe_configs/*.json "$out"/ ;;
    moe) timeout 200 python -m nanoserve.cli bench latency --model "$cfg/qwen3-30b-a3b" --max-model-len 4096
         timeout 200 python -m nanoserve.cli bench throughput --model "$cfg/qwen3-30b-a3b" --max-model-len 4096 ;;
    moe-serve) timeout 300 python -m nanoserve.cli bench serve --launch --no-progress --model "$cfg/qwen3-30b-a3b" \
                 --load-format dummy --max-model-len 4096 --num-prompts 40 --input-len 2048 --output-len 1024 \
                 --max-concurrency 10 ;;
    # FP8 weights quantized at load beside bf16, batch 1 (table 10).
    fp8) for q in "" "--quantization fp8"; do timeout 120 python -m nanoserve.cli bench latency \
           --model "$cfg/llama-3.1-8b" --max-model-len 4096 --output-len 256 $q; done ;;
    # The FP8 KV cache beside the model's (bf16) on the throughput recipe, Llama-3.1-8B (table 10): the KV tokens that
    # fit (kv_cache_tokens in the JSON line) and output tok/s.
    fp8-kv) for kv in auto fp8; do timeout 280 python -m nanoserve.cli bench throughput --model "$cfg/llama-3.1-8b" \
              --kv-cache-dtype $kv; done
            grep -h '^{' "$out/fp8-kv.log" | python3 -c 'import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r["kv_cache_dtype"], "KV tokens", r["kv_cache_tokens"], "output tok/s", r["output_tok_s"])' ;;
    serve-inf) timeout 300 $serve ;;
    serve-16) timeout 300 $serve --request-rate 16 ;;
    *) echo "unknown step: $step" ;;
  esac > "$out/$step.log" 2>&1
  tail -3 "$out/$step.log"
  grep -h '^{' "$out/$step.log" >> "$out/results.jsonl"
done
