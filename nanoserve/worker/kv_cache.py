"""The paged KV pool: per layer, keys and values of shape [num_blocks, block_size, num_kv_heads, head_dim] (this
rank's kv heads under tensor parallelism; the block tables are the same on every rank), in config.kv_dtype: the
model's dtype, or fp8 for kv_cache_dtype fp8 (one byte an element: twice the blocks in the same memory)."""

import torch

from nanoserve.config import EngineConfig

# Without a GPU to size it from, the CPU pool gets a fixed budget.
_CPU_POOL_BYTES = 1 << 30


def bytes_per_block(config: EngineConfig) -> int:
    m = config.model
    elem = config.kv_dtype.itemsize
    return 2 * m.num_hidden_layers * config.args.block_size * config.num_kv_heads_per_rank * m.head_dim * elem


def num_blocks_for(config: EngineConfig, free_bytes: int | None) -> int:
    """Pool size: num_kv_blocks if set, else what fits in the memory left over."""
    if config.args.num_kv_blocks is not None:
        return config.args.num_kv_blocks
    budget = _CPU_POOL_BYTES if free_bytes is None else free_bytes
    # A draft model's pool (speculative decoding) has as many blocks as this one: it comes out of the same budget.
    num = budget // (bytes_per_block(config) + config.draft_kv_bytes_per_block)
    needed = -(-config.max_model_len // config.args.block_size)
    if num < needed and not config.args.kv_offload_gb:  # with a CPU pool, long context goes there
        raise ValueError(f"gpu_memory_utilization: the KV pool fits {num} blocks, but one sequence of "
                         f"max_model_len={config.max_model_len} needs {needed}; lower max_model_len or "
                         "raise gpu_memory_utilization")
    return num


def num_cpu_blocks(config: EngineConfig) -> int:
    """Blocks of the CPU tier (kv_offload_gb, per rank)."""
    return int(config.args.kv_offload_gb * (1 << 30)) // bytes_per_block(config)


# Loading a prefix block from the CPU tier beats recomputing it where the model spends at least this many FLOPs per
# byte of KV: an H100 prefills at ~400 TFLOP/s and the tier copies at ~41 GB/s (tests/gpu/test_kv_offload_gpu.py),
# ~10^4 FLOPs per byte. Measured (`nanoserve bench multi-turn`, H100): Qwen3-0.6B, ~7,700 FLOPs per byte, had a
# 25 % higher TTFT loading than recomputing; Llama-3.1-8B has ~107,000.
_LOAD_MIN_FLOPS_PER_BYTE = 1e4


def prefix_load_pays(config: EngineConfig) -> bool:
    """Whether the CPU tier should keep evicted prefix blocks to load back: copying a token's KV over PCIe costs less
    than recomputing it (its linear layers' FLOPs; attention adds more for long prefixes, in loading's favour). On
    the CPU a copy is a memcpy: always."""
    if config.device.type != "cuda":
        return True
    m = config.model
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    params = m.num_hidden_layers * (2 * m.hidden_size * q + 2 * m.hidden_size * kv + 3 * m.hidden_size
                                    * m.active_intermediate_size)
    kv_bytes = bytes_per_block(config) * config.args.tensor_parallel_size / config.args.block_size
    return 2 * params / kv_bytes >= _LOAD_MIN_FLOPS_PER_BYTE


def allocate_kv_cache(config: EngineConfig, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    m = config.model
    shape = (num_blocks, config.args.block_size, config.num_kv_heads_per_rank, m.head_dim)
    return [(torch.empty(shape, dtype=config.kv_dtype, device=config.device),
             torch.empty(shape, dtype=config.kv_dtype, device=config.device))
            for _ in range(m.num_hidden_layers)]
