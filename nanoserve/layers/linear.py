"""Linear layers, and the ones whose weights are fused on load: q/k/v into one qkv_proj, gate/up into
gate_up_proj.

Each fused parameter carries a weight_loader(param, loaded, shard) that copies one checkpoint tensor
into its slice, so the loader never builds the unfused module.
"""

import torch
from torch import nn

from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.step_plan import KernelPlan


class Linear(nn.Linear):
    """nn.Linear that runs the kernels the step's plan picks for its weight (layers/step_plan.py): the skinny GEMM
    for steps of up to 32 rows captured in CUDA graphs, else PyTorch's. The plan is a required argument, so that no
    call inside a graph falls back to the eager path unnoticed.

    At batch 1, kernel launches rather than bytes dominate a layer (each costs 2-3 us against a few us of weight
    streaming), so the elementwise op before a projection runs inside its GEMM where the plan says so: forward_norm
    for the residual add + RMSNorm before qkv_proj and gate_up_proj, forward_silu_mul for SiLU-and-mul before
    down_proj (past the skinny GEMM's 64 MB, in kernels/silu_mul_gemv.py). Off that path they run as their own
    modules, exactly as without fusion.
    """

    def forward(self, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        if plan.takes_skinny_gemm(self.weight):
            from nanoserve.kernels.gemv import skinny_linear

            return skinny_linear(x, self.weight, self.bias)
        return super().forward(x)

    def starts_next_late(self, plan: KernelPlan) -> bool:
        """Whether the fused norm GEMM lets the next kernel's programs start only once its weight is loaded
        (skinny_norm_linear's late_dependents); QKVLinear does where the plan says."""
        return False

    def forward_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                     plan: KernelPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """self(norm(x + residual)) and the next residual x + residual; without a residual (the first layer),
        self(norm(x)) and x."""
        if plan.takes_fused_prologue(self.weight):
            from nanoserve.kernels.gemv import skinny_norm_linear

            return skinny_norm_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias,
                                      late_dependents=self.starts_next_late(plan))
        if residual is None:
            return self(norm(x), plan), x
        x, residual = norm(x, residual)
        return self(x, plan), residual

    def forward_silu_mul(self, x: torch.Tensor, act: SiluAndMul, plan: KernelPlan) -> torch.Tensor:
        """self(act(x)) for x = [gate | up]: silu(gate) * up projected."""
        if plan.takes_fused_prologue(self.weight):
            from nanoserve.kernels.gemv import skinny_silu_mul_linear

            return skinny_silu_mul_linear(x, self.weight, self.bias)
        if plan.takes_silu_mul_gemv(self.weight, self.bias):
            from nanoserve.kernels.silu_mul_gemv import silu_mul_gemv

            return silu_mul_gemv(x, self.weight)
        return self(act(x), plan)


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

    def starts_next_late(self, plan: KernelPlan) -> bool:
        # Before the fused rope decode of a model with q/k norms (layers/step_plan.py has the measurements).
        return plan.late_qkv_start


class GateUpLinear(FusedLinear):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias=False)
