"""Linear layers, and the ones whose weights are fused on load: q/k/v into one qkv_proj, gate/up into
gate_up_proj.

Each fused parameter carries a weight_loader(param, loaded, shard) that copies one checkpoint tensor
into its slice, so the loader never builds the unfused module.
"""

import torch
from torch import nn

from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.norm import RMSNorm

# Measured on an H200 inside CUDA graphs (probe at 275aa23): at one or two rows the Triton skinny GEMM
# streams Qwen3-0.6B's weights up to 3.5x faster than cuBLAS, and Llama-8B's qkv and o_proj (50 and 32 MB)
# 3-9% faster, but its gate_up and down (235 and 117 MB) 4-5% slower. Launched eagerly (tens of microseconds of
# Triton launch cost) cuBLAS is faster. Timed one GEMM at a time, cuBLAS was as fast from 4 rows on; but in whole
# decode steps on an H100 (where the skinny GEMM starts under PDL beside the Triton kernels around it; probe at
# 275aa23), the skinny GEMM made Qwen3-0.6B's steps 1.0-8.6 % faster at 3-32 rows and Llama-3.1-8B's (qkv and
# o_proj) 1.3-2.2 % at 4-32, and cuBLAS won from 48 rows.
SKINNY_MAX_ROWS = 32
SKINNY_MAX_WEIGHT_BYTES = 64 << 20


def skinny_gemm_fits(rows: int, weight_bytes: int) -> bool:
    """The shapes for which the skinny GEMM beats cuBLAS inside a CUDA graph (see the figures above)."""
    return rows <= SKINNY_MAX_ROWS and weight_bytes <= SKINNY_MAX_WEIGHT_BYTES


def capturing_cuda_graph(x: torch.Tensor) -> bool:
    """Whether x's forward pass is being captured into a CUDA graph (Triton launches are then free at replay)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def takes_fused_prologue(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the skinny GEMM also runs the op before it (forward_norm, forward_silu_mul). Only at one row:
    measured on an H200 in graphs (probe at 275aa23), fusing saves 0.2-0.9 us per GEMM at
    one row but costs 0.2-3.4 us at two, where every program redoes the prologue for both rows. Nor on the tensor
    cores, which a large weight takes at one row (kernels/gemv.py)."""
    if not (x.dim() == 2 and x.shape[0] == 1 and takes_skinny_gemm(x, weight)):
        return False
    from nanoserve.kernels.gemv import tensor_cores_at

    return not tensor_cores_at(1, weight)


def takes_silu_mul_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether one row of SiLU-and-mul and this projection run as one kernel (kernels/silu_mul_gemv.py): a weight
    past the skinny GEMM's limit, where cuBLAS would run after SiLU-and-mul, at one row inside a CUDA graph."""
    return (bias is None and x.dim() == 2 and x.shape[0] == 1 and capturing_cuda_graph(x)
            and weight.numel() * weight.element_size() > SKINNY_MAX_WEIGHT_BYTES)


def takes_skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [rows, K] @ weight.T goes to the Triton skinny GEMM (and so may take its fused prologues)."""
    return (x.dim() == 2 and skinny_gemm_fits(x.shape[0], weight.numel() * weight.element_size())
            and capturing_cuda_graph(x))


class Linear(nn.Linear):
    """nn.Linear that takes the skinny GEMM kernel for decode steps of up to 32 sequences captured in CUDA graphs.

    At batch 1, kernel launches rather than bytes dominate a layer (each costs 2-3 us against a few us of weight
    streaming), so the elementwise op before a projection runs inside its GEMM: forward_norm for the residual
    add + RMSNorm before qkv_proj and gate_up_proj, forward_silu_mul for SiLU-and-mul before down_proj (past the
    skinny GEMM's 64 MB, in kernels/silu_mul_gemv.py). Off that path they run as their own modules, exactly as
    without fusion.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes_skinny_gemm(x, self.weight):
            from nanoserve.kernels.gemv import skinny_linear

            return skinny_linear(x, self.weight, self.bias)
        return super().forward(x)

    def forward_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                     late_dependents: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """self(norm(x + residual)) and the next residual x + residual; without a residual (the first layer),
        self(norm(x)) and x. late_dependents: as skinny_norm_linear takes it, where the fused kernel runs."""
        if takes_fused_prologue(x, self.weight):
            from nanoserve.kernels.gemv import skinny_norm_linear

            return skinny_norm_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias,
                                      late_dependents=late_dependents)
        if residual is None:
            return self(norm(x)), x
        x, residual = norm(x, residual)
        return self(x), residual

    def forward_silu_mul(self, x: torch.Tensor, act: SiluAndMul) -> torch.Tensor:
        """self(act(x)) for x = [gate | up]: silu(gate) * up projected."""
        if takes_fused_prologue(x, self.weight):
            from nanoserve.kernels.gemv import skinny_silu_mul_linear

            return skinny_silu_mul_linear(x, self.weight, self.bias)
        if takes_silu_mul_gemv(x, self.weight, self.bias):
            from nanoserve.kernels.silu_mul_gemv import silu_mul_gemv

            return silu_mul_gemv(x, self.weight)
        return self(act(x))


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
