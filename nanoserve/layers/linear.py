"""Linear layers whose weights are fused on load: q/k/v into one qkv_proj, gate/up into gate_up_proj.

Each fused parameter carries a weight_loader(param, loaded, shard) that copies one checkpoint tensor
into its slice, so the loader never builds the unfused module.
"""

import torch
from torch import nn


class FusedLinear(nn.Linear):
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
