"""Linear layers, and the ones whose weights are fused on load: q/k/v into one qkv_proj, gate/up into
gate_up_proj.

Each fused parameter carries a weight_loader(param, loaded, shard) that copies one checkpoint tensor
into its slice, so the loader never builds the unfused module.
"""

import torch
from torch import nn

# Measured on an H200 inside CUDA graphs (scripts/bench_gemv.py): at one or two rows the Triton skinny GEMM
# streams Qwen3-0.6B's weights up to 3.5x faster than cuBLAS, and Llama-8B's qkv and o_proj (50 and 32 MB)
# 3-9% faster, but its gate_up and down (235 and 117 MB) 4-5% slower. From 4 rows on, or launched eagerly
# (tens of microseconds of Triton launch cost), cuBLAS is as fast or faster.
SKINNY_MAX_ROWS = 2
SKINNY_MAX_WEIGHT_BYTES = 64 << 20


class Linear(nn.Linear):
    """nn.Linear that takes the skinny GEMM kernel for batch-1/2 decode steps captured in CUDA graphs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.is_cuda and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and torch.cuda.is_current_stream_capturing()
                and self.weight.numel() * self.weight.element_size() <= SKINNY_MAX_WEIGHT_BYTES):
            from nanoserve.kernels.gemv import skinny_linear

            return skinny_linear(x, self.weight, self.bias)
        return super().forward(x)


class FusedLinear(Linear):
    """A linear layer made of named shards stacked along the output dimension."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.weight.weight_loader = self.load_shard
        if bias:
            self.bias.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        offset, size = self.shard_offsets[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"checkpoint shard {shard!r} has {loaded.shape[0]} rows, expected {size}")
        param.data[offset:offset + size].copy_(loaded)


class QKVLinear(FusedLinear):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool):
        sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        super().__init__(hidden_size, sizes, bias)


class GateUpLinear(FusedLinear):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias=False)
