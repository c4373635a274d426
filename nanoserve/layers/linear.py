"""Linear layers, and the ones whose weights are fused on load: q/k/v into one qkv_proj, gate/up into
gate_up_proj; under tensor parallelism the fused ones are column-parallel (each rank holds its heads, its share
of the intermediate size) and o_proj, down_proj row-parallel (each rank holds its share of the input columns and
the partial outputs are summed by one all-reduce), as in Megatron-LM.

Each parameter carries a weight_loader(param, loaded, shard) that reads its rank's rows or columns from a
checkpoint tensor `loaded` (a safetensors slice: only what is indexed is read from the file), so the loader
never builds the unfused module nor the whole tensor.
"""

from typing import NamedTuple, Protocol

import torch
from torch import nn

from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.layers.activation import GeluTanhAndMul, SiluAndMul
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.step_plan import KernelPlan


class LinearMethod(Protocol):
    """How a quantized Linear computes its output (nanoserve/quantization/ sets one on each layer it quantizes,
    with the weight and scale parameters it needs); the layers here never import that package.

    A method may also define `skinny_weight(layer) -> (weight, weight_scale) | None`: an fp8 weight [N, K] and its
    fp32 scale per output row [N] that the skinny GEMM (kernels/gemv.py) can run, dequantizing in registers, or None
    where it cannot (skinny_operands).

    And `fp8_input(layer, x) -> Fp8Input | None` with `apply_fp8(layer, q, x_scale)`: whether the method's GEMM
    would quantize an input of x's dtype and device to fp8 per row, and how (Fp8Input); where it says so,
    forward_norm and forward_silu_mul have the kernel that makes the input quantize it (kernels/rms_norm.py's
    rms_norm_fp8, kernels/activation.py's act_and_mul_fp8) and hand q [M, K] float8_e4m3fn and x_scale [M, 1] fp32
    to apply_fp8, which returns [M, out_features] with the bias added."""

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] with the layer's bias added."""
        ...


class Fp8Input(NamedTuple):
    """A method's request for its input quantized to float8_e4m3fn per row: by `scale` (one fp32 number, static
    activations) or by each row's max|x| / 448 (None, dynamic per token)."""

    scale: torch.Tensor | None


def skinny_operands(layer: "Linear") -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The weight and per-row scale (None: the weight is unscaled) that the skinny GEMM would read for this layer:
    its own weight unquantized; a quantized layer's only where its method offers them (Fp8LinearMethod's per-tensor
    and per-channel schemes); None otherwise, and the method's own GEMM runs at every step."""
    if layer.quant_method is None:
        return layer.weight, None
    offer = getattr(layer.quant_method, "skinny_weight", None)
    return None if offer is None else offer(layer)


class Linear(nn.Linear):
    """nn.Linear that runs the kernels the step's plan picks for its weight (layers/step_plan.py): the skinny GEMM
    for steps of up to 32 rows captured in CUDA graphs, else PyTorch's. The plan is a required argument, so that no
    call inside a graph falls back to the eager path unnoticed.

    At batch 1, kernel launches rather than bytes dominate a layer (each costs 2-3 us against a few us of weight
    streaming), so the elementwise op before a projection runs inside its GEMM where the plan says so: forward_norm
    for the residual add + RMSNorm before qkv_proj and gate_up_proj, forward_silu_mul for SiLU-and-mul before
    down_proj (past the skinny GEMM's 64 MB, in kernels/silu_mul_gemv.py). Off that path they run as their own
    modules, exactly as without fusion.

    A quantized layer (quant_method set) whose method offers an fp8 weight with per-row scales (skinny_operands:
    FP8 per-tensor or per-channel weights, whatever the activations' scheme) takes the skinny GEMM and its fused
    prologues by the same rules, applied to the fp8 weight's bytes (but for the byte limit, which an fp8 weight does
    not have: layers/step_plan.py), dequantizing the weight in registers: so a W8A8 checkpoint's steps of up to 32
    rows in graphs run weight-only (16-bit activations, not quantized), where the weight's bytes and not the math
    bound the step. Elsewhere (larger or eager steps, block scales, 4-bit weights) it runs its method's GEMM, with
    the ops before it as their own modules, but where the method takes an fp8 input (LinearMethod's fp8_input: FP8
    W8A8 on CUDA), which the op before it then quantizes in its own kernel; never kernels/silu_mul_gemv.py, which
    reads unquantized weights.
    """

    quant_method: LinearMethod | None = None

    def forward(self, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        operands = skinny_operands(self)
        if operands is not None and plan.takes_skinny_gemm(operands[0]):
            from nanoserve.kernels.gemv import skinny_linear

            return skinny_linear(x, operands[0], self.bias, weight_scale=operands[1])
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        return super().forward(x)

    def starts_next_late(self, plan: KernelPlan) -> bool:
        """Whether the fused norm GEMM lets the next kernel's programs start only once its weight is loaded
        (skinny_norm_linear's late_dependents); QKVLinear does where the plan says."""
        return False

    def forward_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                     plan: KernelPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """self(norm(x + residual)) and the next residual x + residual; without a residual (the first layer),
        self(norm(x)) and x."""
        operands = skinny_operands(self)
        if operands is not None and plan.takes_fused_prologue(operands[0]):
            from nanoserve.kernels.gemv import skinny_norm_linear

            weight, weight_scale = operands
            return skinny_norm_linear(x, residual, norm.weight, norm.eps, weight, self.bias,
                                      late_dependents=self.starts_next_late(plan), weight_offset=norm.offset,
                                      weight_scale=weight_scale)
        fp8 = self.fp8_input(x, plan)
        if fp8 is not None:
            from nanoserve.kernels.rms_norm import rms_norm_fp8

            q, x_scale = rms_norm_fp8(x, norm.weight, norm.eps, residual, norm.offset, fp8.scale)
            return self.quant_method.apply_fp8(self, q, x_scale), x if residual is None else residual
        if residual is None:
            return self(norm(x), plan), x
        x, residual = norm(x, residual)
        return self(x, plan), residual

    def fp8_input(self, x: torch.Tensor, plan: KernelPlan) -> Fp8Input | None:
        """What the method asks of the kernel that makes this layer's input from x [T, *] (LinearMethod), where the
        method's own GEMM runs (not the skinny GEMM); None: an unquantized input."""
        offer = getattr(self.quant_method, "fp8_input", None)
        operands = skinny_operands(self)
        if offer is None or x.dim() != 2 or (operands is not None and plan.takes_skinny_gemm(operands[0])):
            return None
        return offer(self, x)

    def forward_silu_mul(self, x: torch.Tensor, act: SiluAndMul | GeluTanhAndMul, plan: KernelPlan) -> torch.Tensor:
        """self(act(x)) for x = [gate | up]: silu(gate) * up projected (Gemma's GELU in SiLU's place for
        GeluTanhAndMul)."""
        operands = skinny_operands(self)
        if operands is not None and plan.takes_fused_prologue(operands[0]):
            from nanoserve.kernels.gemv import skinny_silu_mul_linear

            return skinny_silu_mul_linear(x, operands[0], self.bias, activation=act.activation,
                                          weight_scale=operands[1])
        if self.quant_method is None and plan.takes_silu_mul_gemv(self.weight, self.bias):
            from nanoserve.kernels.silu_mul_gemv import silu_mul_gemv

            return silu_mul_gemv(x, self.weight, act.activation)
        fp8 = self.fp8_input(x, plan)
        if fp8 is not None:  # unreduced, as below
            from nanoserve.kernels.activation import act_and_mul_fp8

            return self.quant_method.apply_fp8(self, *act_and_mul_fp8(x, act.activation, fp8.scale))
        # Linear's forward, not self's: a row-parallel layer reduces what this returns (forward_silu_mul), once.
        return Linear.forward(self, act(x), plan)


def load_whole(param: nn.Parameter, loaded, shard: str | None = None) -> None:
    """The default weight_loader: the checkpoint tensor is the parameter, whole (norms; every weight at TP=1
    that is not fused)."""
    if tuple(loaded.get_shape()) != tuple(param.shape):
        raise ValueError(f"has shape {tuple(loaded.get_shape())}, expected {tuple(param.shape)}")
    param.data.copy_(loaded[:])


class RowParallelLinear(Linear):
    """y = x W^T + b with W's input columns split over the ranks: each rank multiplies its share of x (the
    output of its heads, or of its share of the intermediate size) and one all-reduce sums the partial outputs.
    Rank 0 alone holds the bias (the others zeros), so that the sum adds it once. With reduce_results=False the
    partial output is returned, for a caller that sums it with others before one all-reduce (an MoE block's shared
    expert)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup | None = None,
                 reduce_results: bool = True) -> None:
        tp = tp or TensorParallelGroup()
        super().__init__(in_features // tp.size, out_features, bias=bias)
        self.tp, self.reduce_results = tp, reduce_results
        self.weight.weight_loader = self.load_columns
        if bias:
            self.bias.weight_loader = self.load_bias

    def load_columns(self, param: nn.Parameter, loaded, shard: str | None = None) -> None:
        rows, cols = loaded.get_shape()
        if (rows, cols) != (param.shape[0], param.shape[1] * self.tp.size):
            raise ValueError(f"has shape {(rows, cols)}, expected {(param.shape[0], param.shape[1] * self.tp.size)}")
        start, size = self.tp.shard(cols)
        param.data.copy_(loaded[:, start:start + size])

    def load_bias(self, param: nn.Parameter, loaded, shard: str | None = None) -> None:
        if self.tp.rank == 0:
            load_whole(param, loaded)
        else:
            param.data.zero_()

    def forward(self, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        return self._reduce(super().forward(x, plan))

    def forward_silu_mul(self, x: torch.Tensor, act: SiluAndMul | GeluTanhAndMul, plan: KernelPlan) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward_silu_mul(x, act, plan)
        return self._reduce(super().forward_silu_mul(x, act, plan))

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(x) if self.reduce_results else x


class FusedLinear(Linear):
    """A column-parallel linear layer made of named shards stacked along the output dimension. Each shard is
    `size` rows of its checkpoint tensor from row `start` on (this rank's share of it)."""

    def __init__(self, in_features: int, shards: dict[str, tuple[int, int, int]], bias: bool) -> None:
        """shards: name -> (start, size, rows of the whole checkpoint tensor)."""
        super().__init__(in_features, sum(size for _, size, _ in shards.values()), bias=bias)
        self.shards = shards
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, (_, size, _) in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.weight.weight_loader = self.load_shard
        if bias:
            self.bias.weight_loader = self.load_shard

    def expected_shards(self) -> dict[str, list[str]]:
        """The checkpoint tensors each parameter is loaded from (the loader reports the ones missing)."""
        return {pname: list(self.shard_offsets) for pname, _ in self.named_parameters(recurse=False)}

    def load_shard(self, param: nn.Parameter, loaded, shard: str) -> None:
        """shard: one of self.shards, or several joined by "+" for a checkpoint tensor that stacks their whole
        tensors in that order (Phi-3's qkv_proj is "q+k+v", its gate_up_proj "gate+up"): each shard's rows of this
        rank are read from its part, so tensor parallelism splits a packed tensor as it splits separate ones."""
        parts = shard.split("+")
        rows, total = loaded.get_shape()[0], sum(self.shards[part][2] for part in parts)
        if rows != total:
            raise ValueError(f"checkpoint shard {shard!r} has {rows} rows, expected {total}")
        base = 0  # where the part's whole tensor starts in the checkpoint tensor
        for part in parts:
            offset, size = self.shard_offsets[part]
            start, _, part_rows = self.shards[part]
            param.data[offset:offset + size].copy_(loaded[base + start:base + start + size])
            base += part_rows


def _kv_head_shard(num_kv_heads: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """(first kv head, kv heads) of this rank. With fewer kv heads than ranks each is replicated on
    size / num_kv_heads ranks, as vLLM does: every rank's query heads read one kv head of their own group."""
    if num_kv_heads >= tp.size:
        return tp.shard(num_kv_heads)
    return tp.rank * num_kv_heads // tp.size, 1


class QKVLinear(FusedLinear):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 tp: TensorParallelGroup | None = None) -> None:
        tp = tp or TensorParallelGroup()
        q_start, q_heads = tp.shard(num_heads)
        kv_start, kv_heads = _kv_head_shard(num_kv_heads, tp)
        q = (q_start * head_dim, q_heads * head_dim, num_heads * head_dim)
        kv = (kv_start * head_dim, kv_heads * head_dim, num_kv_heads * head_dim)
        super().__init__(hidden_size, {"q": q, "k": kv, "v": kv}, bias)

    def starts_next_late(self, plan: KernelPlan) -> bool:
        # Before the fused rope decode of a model with q/k norms (layers/step_plan.py has the measurements).
        return plan.late_qkv_start


class GateUpLinear(FusedLinear):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallelGroup | None = None) -> None:
        start, size = (tp or TensorParallelGroup()).shard(intermediate_size)
        shard = (start, size, intermediate_size)
        super().__init__(hidden_size, {"gate": shard, "up": shard}, bias=False)
