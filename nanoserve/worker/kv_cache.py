"""The paged KV pool: per layer, keys and values of shape [num_blocks, block_size, num_kv_heads, head_dim] (this
rank's kv heads under tensor parallelism; the block tables are the same on every rank)."""

import torch

from nanoserve.config import EngineConfig

# Without a GPU to size it from, the CPU pool gets a fixed budget.
_CPU_POOL_BYTES = 1 << 30


def bytes_per_block(config: EngineConfig) -> int:
    m = config.model
    elem = torch.empty((), dtype=config.dtype).element_size()
    return 2 * m.num_hidden_layers * config.args.block_size * config.num_kv_heads_per_rank * m.head_dim * elem


def num_blocks_for(config: EngineConfig, free_bytes: int | None) -> int:
    """Pool size: num_kv_blocks if set, else what fits in the memory left over."""
    if config.args.num_kv_blocks is not None:
        return config.args.num_kv_blocks
    budget = _CPU_POOL_BYTES if free_bytes is None else free_bytes
    num = budget // bytes_per_block(config)
    needed = -(-config.max_model_len // config.args.block_size)
    if num < needed:
        raise ValueError(f"gpu_memory_utilization: the KV pool fits {num} blocks, but one sequence of "
                         f"max_model_len={config.max_model_len} needs {needed}; lower max_model_len or "
                         "raise gpu_memory_utilization")
    return num


def num_cpu_blocks(config: EngineConfig) -> int:
    """Blocks of the CPU tier (kv_offload_gb, per rank)."""
    return int(config.args.kv_offload_gb * (1 << 30)) // bytes_per_block(config)


def allocate_kv_cache(config: EngineConfig, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    m = config.model
    shape = (num_blocks, config.args.block_size, config.num_kv_heads_per_rank, m.head_dim)
    return [(torch.empty(shape, dtype=config.dtype, device=config.device),
             torch.empty(shape, dtype=config.dtype, device=config.device))
            for _ in range(m.num_hidden_layers)]
