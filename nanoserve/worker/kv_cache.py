"""The paged KV pool: per layer, keys and values of shape [num_blocks, block_size, num_kv_heads, head_dim] (this
rank's kv heads under tensor parallelism; the block tables are the same on every rank), in config.kv_dtype: the
model's dtype, or fp8 for kv_cache_dtype fp8 (one byte an element: twice the blocks in the same memory).

A model with sliding-window layers has a second pool (KVGroups): the global layers' blocks hold a sequence's whole
context, the window layers' only the blocks its next queries can see (engine/local_blocks.py), so they need far
fewer. How the memory is split (pool_sizes): the window pool gets enough blocks for max_num_seqs sequences to each
hold a window (ceil((W - 1) / block_size) + 2 blocks: the window's and the one the next token starts, each possibly
cut by block boundaries) plus two steps' worth of prefill chunks (2 ceil(max_num_batched_tokens / block_size): chunks
of the step being scheduled and of one not yet released), and never more than the global pool's count (a sequence
needs no more window blocks than global ones); the global pool takes the rest. So the window pool never limits
max_num_seqs running sequences below what one pool would, and the memory it leaves is the global pool's: the fewer
max_num_seqs, the more tokens fit. Where that rule gives the window pool as many blocks as the global one (many
sequences, little memory: Gemma-3-27B at the default max_num_seqs 256 on an H200), it would save nothing, and the
model runner keeps one pool (ModelRunner._size_pools).

A model whose every layer is windowed (Mistral-7B-v0.1, Phi-3-mini-4k, Qwen2 windowed from layer 0) keeps all its KV
in the window pool. Its global pool holds no layer's KV: its blocks are bookkeeping (block_table indexing, the hash
chain that prefix caching names blocks by), which costs no device memory, so it gets as many as max_num_seqs
sequences of max_model_len and two steps' chunks can name (bookkeeping_blocks) and the window pool gets the whole
budget (at most as many blocks as the global pool: a larger pool would hold cached blocks no global hit names). A
speculative draft model (or EAGLE-3 head) keeps its KV in blocks of the global pool's ids, for every block of the
context: there the global pool costs the draft's bytes a block, and the budget is split as for two pools, the
draft's KV standing in for the global layers'.
"""

import logging
from dataclasses import dataclass

import torch

from nanoserve.config import EngineConfig

logger = logging.getLogger(__name__)

# Without a GPU to size it from, the CPU pool gets a fixed budget.
_CPU_POOL_BYTES = 1 << 30


@dataclass
class KVGroups:
    """The layers whose KV is in the sliding-window pool (local[i] for attention layer i), and their window."""

    local: list[bool]
    window: int

    @property
    def num_local(self) -> int:
        return sum(self.local)

    @property
    def all_local(self) -> bool:
        """Every layer windowed: the global pool holds no KV, only block ids (module docstring)."""
        return all(self.local)


def kv_groups(config: EngineConfig, windows: list[int | None]) -> KVGroups | None:
    """Two pools where some or all layers have a window shorter than max_model_len; None: one pool (the flag
    disable_hybrid_kv_cache_manager, no windowed layer, windows that differ (every supported model with local layers
    gives them one window), or the CPU tier)."""
    if config.args.disable_hybrid_kv_cache_manager:
        return None
    local_windows = {w for w in windows if w is not None}
    if not local_windows or min(local_windows) >= config.max_model_len:
        return None
    if len(local_windows) > 1:
        logger.warning("sliding-window layers of different windows %s: one KV pool for all layers (out-of-window "
                       "blocks are kept)", sorted(local_windows))
        return None
    if config.args.kv_offload_gb:
        # The CPU tier and the long-context ring move one pool's blocks: asked for, they win over the window pool.
        logger.info("kv_offload_gb: one KV pool for all layers (the CPU tier moves one pool's blocks; "
                    "sliding-window layers keep their out-of-window blocks)")
        return None
    return KVGroups([w is not None for w in windows], local_windows.pop())


def bytes_per_block(config: EngineConfig, num_layers: int | None = None) -> int:
    """Bytes of one block of num_layers layers (None: all of the model's)."""
    m = config.model
    elem = config.kv_dtype.itemsize
    layers = m.num_hidden_layers if num_layers is None else num_layers
    return 2 * layers * config.args.block_size * config.num_kv_heads_per_rank * m.head_dim * elem


def local_pool_cap(config: EngineConfig, window: int, num_seqs: int | None = None) -> int:
    """Window-pool blocks (besides the null block) that num_seqs (None: max_num_seqs) sequences can use at once
    (module docstring)."""
    args = config.args
    bs = args.block_size
    per_seq = min(-(-config.max_model_len // bs), -(-(window - 1) // bs) + 2)
    num_seqs = args.max_num_seqs if num_seqs is None else num_seqs
    return num_seqs * per_seq + 2 * -(-args.max_num_batched_tokens // bs)


def bookkeeping_blocks(config: EngineConfig) -> int:
    """Global blocks that max_num_seqs sequences of max_model_len, and two steps' prefill chunks, can name."""
    args = config.args
    bs = args.block_size
    return args.max_num_seqs * -(-config.max_model_len // bs) + 2 * -(-args.max_num_batched_tokens // bs)


def pool_sizes(config: EngineConfig, free_bytes: int | None, groups: KVGroups) -> tuple[int, int]:
    """(global blocks, window blocks with the null block) of a two-pool model: num_kv_blocks (the global pool) if
    set, else what fits in the memory left over, split as the module docstring says."""
    g_bytes = bytes_per_block(config, len(groups.local) - groups.num_local) + config.draft_kv_bytes_per_block
    l_bytes = bytes_per_block(config, groups.num_local)
    cap = local_pool_cap(config, groups.window)
    if config.args.num_kv_blocks is not None:
        num = config.args.num_kv_blocks
        return num, min(num, cap) + 1
    budget = _CPU_POOL_BYTES if free_bytes is None else free_bytes
    if g_bytes == 0:  # every layer windowed, no draft: the global pool is bookkeeping only
        num = bookkeeping_blocks(config)
        # No more window blocks than the global ones they would stand beside (the runner drops a larger pool).
        local = min(budget // l_bytes, num)
        needed = local_pool_cap(config, groups.window, num_seqs=1) + 1
        if local < needed:
            raise ValueError(f"gpu_memory_utilization: the sliding-window KV pool fits {local} blocks, but one "
                             f"sequence's window and two prefill chunks need {needed}; lower "
                             "max_num_batched_tokens or raise gpu_memory_utilization")
        return num, local
    num = (budget - l_bytes) // (g_bytes + l_bytes)  # as many window blocks as global ones
    if num > cap:
        num = (budget - (cap + 1) * l_bytes) // g_bytes
    _check_fits(config, num)
    return num, min(num, cap) + 1


def _check_fits(config: EngineConfig, num: int) -> None:
    needed = -(-config.max_model_len // config.args.block_size)
    if num < needed and not config.args.kv_offload_gb:  # with a CPU pool, long context goes there
        raise ValueError(f"gpu_memory_utilization: the KV pool fits {num} blocks, but one sequence of "
                         f"max_model_len={config.max_model_len} needs {needed}; lower max_model_len or "
                         "raise gpu_memory_utilization")


def num_blocks_for(config: EngineConfig, free_bytes: int | None) -> int:
    """Pool size: num_kv_blocks if set, else what fits in the memory left over."""
    if config.args.num_kv_blocks is not None:
        return config.args.num_kv_blocks
    budget = _CPU_POOL_BYTES if free_bytes is None else free_bytes
    # A draft model's pool (speculative decoding) has as many blocks as this one: it comes out of the same budget.
    num = budget // (bytes_per_block(config) + config.draft_kv_bytes_per_block)
    _check_fits(config, num)
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


def allocate_kv_cache(config: EngineConfig, num_blocks: int, groups: KVGroups | None = None,
                      num_local_blocks: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values): num_blocks blocks, or num_local_blocks for a layer in groups' window pool, whose
    block 0 (engine/local_blocks.py's NULL_BLOCK) is zeroed: kernels may load it under the window's mask, and garbage
    there (NaN) would survive a zero weight."""
    m = config.model
    local = groups.local if groups is not None else [False] * m.num_hidden_layers
    caches = []
    for is_local in local:
        shape = (num_local_blocks if is_local else num_blocks, config.args.block_size, config.num_kv_heads_per_rank,
                 m.head_dim)
        k, v = (torch.empty(shape, dtype=config.kv_dtype, device=config.device) for _ in range(2))
        if is_local:
            k[0].zero_()
            v[0].zero_()
        caches.append((k, v))
    return caches
