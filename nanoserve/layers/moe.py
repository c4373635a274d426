"""Mixture-of-experts layers: the router, the routed experts as stacked weights, and the sparse MLP block that
replaces a dense MLP (Qwen2-MoE, Qwen3-MoE, Mixtral).

Under tensor parallelism a block costs one all-reduce, as a dense MLP does. By default every rank holds a 1/N slice
of every expert's intermediate size (w13's rows, w2's columns), so each rank's output is a partial sum; with expert
parallelism (`enable_expert_parallel`) every rank holds num_experts / N whole experts and computes only the
(token, expert) pairs routed to them, so each rank's output is again a partial sum. The router is replicated: every
rank routes every token identically.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.kernels.fp8_experts import FP8, dequantize_fp8_experts
from nanoserve.kernels.moe_reference import fused_moe_ref, topk_softmax_ref
from nanoserve.kernels.w4_experts import dequantize_w4_experts
from nanoserve.layers.linear import Linear
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.step_plan import KernelPlan


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing (Qwen, Mixtral): the top_k experts of each token by probability, and their weights (fp32),
    rescaled to sum to one if `renormalize`. Returns (topk_weights [T, k] fp32, topk_ids [T, k])."""
    if logits.is_cuda:
        from nanoserve.kernels.moe_routing import topk_softmax

        return topk_softmax(logits, top_k, renormalize)
    return topk_softmax_ref(logits, top_k, renormalize)


class FusedMoE(nn.Module):
    """The routed experts of one layer: w13 [E, 2I, H] (each expert's gate rows, then its up rows) and w2 [E, H, I],
    this rank's experts and share of I. x [T, H] -> this rank's partial sum over the top-k experts [T, H]; the
    caller all-reduces it.

    Checkpoints hold one tensor per expert and projection; the loader names them by shard 'gate:<e>', 'up:<e>',
    'down:<e>' (e: the expert's index in the model), and tensors of experts another rank holds are skipped unread.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallelGroup,
                 expert_parallel: bool, top_k: int, activation: str = "silu") -> None:
        """activation: "silu" (SiLU(gate) * up) or "swigluoai" (gpt-oss's clamped form). w13_bias and w2_bias are
        None here; a subclass that loads per-expert biases (model/gpt_oss.py) sets them. So are w13_scale and
        w2_scale: a subclass that keeps its experts in MXFP4 (model/gpt_oss.py) makes w13 and w2 their packed bytes
        and these their block scales (kernels/mxfp4_unpack.py's layout); quantization/moe_experts.py, keeping an FP8
        checkpoint's experts in FP8, makes w13 and w2 float8_e4m3fn and these their fp32 scales, per row or per
        weight_block (kernels/fp8_experts.py's layout); keeping a 4-bit checkpoint's experts packed, it makes w13 and
        w2 int32, these their fp32 group scales, w13_zeros and w2_zeros their zero points (asymmetric) and
        group_size the checkpoint's (kernels/w4_experts.py's layout)."""
        super().__init__()
        self.tp, self.num_experts, self.hidden_size, self.top_k = tp, num_experts, hidden_size, top_k
        self.activation = activation
        self.intermediate_size = intermediate_size  # the model's, whole
        if expert_parallel:
            self.expert_start, local_experts = tp.shard(num_experts)
            self.inter_start, local_inter = 0, intermediate_size
        else:
            self.expert_start, local_experts = 0, num_experts
            self.inter_start, local_inter = tp.shard(intermediate_size)
        self.local_inter = local_inter
        self.w13 = nn.Parameter(torch.empty(local_experts, 2 * local_inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local_experts, hidden_size, local_inter), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.load_expert
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        self.weight_block: tuple[int, int] | None = None  # FP8 weights' block of scales (None: per row)
        self.w13_zeros: nn.Parameter | None = None  # W4 weights' zero points (None: symmetric, 8)
        self.w2_zeros: nn.Parameter | None = None
        self.group_size = -1  # W4 weights' (-1: one group a row)
        # False: the PyTorch reference on CUDA too (an eager reference engine in the GPU tests; it syncs the host).
        self.use_kernel = True

    @property
    def local_experts(self) -> range:
        return range(self.expert_start, self.expert_start + self.w13.shape[0])

    def expected_shards(self) -> dict[str, list[str]]:
        """The checkpoint tensors each parameter is loaded from (the loader reports the ones missing). FP8 scales come
        with w13's and w2's shards ('gate:3#weight_scale'), their loader checking that each came."""
        shards = {"w13": [f"{p}:{e}" for e in self.local_experts for p in ("gate", "up")],
                  "w2": [f"down:{e}" for e in self.local_experts]}
        scales = ("w13_scale", "w2_scale", "w13_zeros", "w2_zeros")
        return shards | {name: [] for name in scales if getattr(self, name) is not None}

    def checkpoint_shapes(self, param: nn.Parameter) -> list[tuple[str, tuple[int, ...]]]:
        """(shard, shape of the whole checkpoint tensor) of each tensor `param` takes a share of (random weights)."""
        h, i = self.hidden_size, self.intermediate_size
        if param is self.w13:
            return [(f"{p}:{e}", (i, h)) for e in self.local_experts for p in ("gate", "up")]
        return [(f"down:{e}", (h, i)) for e in self.local_experts]

    def load_expert(self, param: nn.Parameter, loaded, shard: str) -> None:
        if "#" in shard:  # quantization/moe_experts.py loads those, when the quantization_config says so
            raise ValueError("is a quantized expert tensor, but config.json's quantization_config (or its absence) "
                             "quantizes no experts")
        proj, expert = shard.split(":")
        e = int(expert) - self.expert_start
        if not 0 <= e < param.shape[0]:
            return  # another rank's expert
        h, i, local_i = self.hidden_size, self.intermediate_size, self.local_inter
        expected = (h, i) if proj == "down" else (i, h)
        if tuple(loaded.get_shape()) != expected:
            raise ValueError(f"has shape {tuple(loaded.get_shape())}, expected {expected}")
        start = self.inter_start
        if proj == "down":
            param.data[e].copy_(loaded[:, start:start + local_i])
        else:
            rows = slice(0, local_i) if proj == "gate" else slice(local_i, 2 * local_i)
            param.data[e, rows].copy_(loaded[start:start + local_i])

    def reference_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 and w2 as the PyTorch reference takes them, in dtype's form (FP8 and W4 ones dequantized; a packed
        subclass dequantizes its own)."""
        if self.w13.dtype == torch.int32:
            return (dequantize_w4_experts(self.w13, self.w13_scale, self.w13_zeros, self.group_size, dtype),
                    dequantize_w4_experts(self.w2, self.w2_scale, self.w2_zeros, self.group_size, dtype))
        if self.w13.dtype == FP8:
            return (dequantize_fp8_experts(self.w13, self.w13_scale, self.weight_block, dtype, stacked=True),
                    dequantize_fp8_experts(self.w2, self.w2_scale, self.weight_block, dtype))
        return self.w13, self.w2

    def num_weights(self) -> int:
        """This rank's expert parameters, counting weights not bytes: a packed MXFP4 byte holds two, a W4 int32 eight,
        an FP8 byte one, and their scales and zero points are none."""
        scales = [p for p in (self.w13_scale, self.w2_scale, self.w13_zeros, self.w2_zeros) if p is not None]
        per_element = {torch.uint8: 2, torch.int32: 8}.get(self.w13.dtype, 1)
        return sum(p.numel() * (per_element if p is self.w13 or p is self.w2 else 1) for p in self.parameters()
                   if not any(p is s for s in scales))

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether forward runs x through the decode GEMVs (kernels/moe_gemv.py): a CUDA step of a token or two. The
        step's size is fixed when a graph is captured, so the path is too."""
        if not (x.is_cuda and self.use_kernel):
            return False
        from nanoserve.kernels.moe_gemv import takes_gemv

        return takes_gemv(x.shape[0], self.top_k)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                norm: RMSNorm | None = None) -> torch.Tensor:
        """norm: the experts of norm(x), normalized inside the gate/up GEMV where takes_gemv (else by norm)."""
        kw = dict(expert_start=self.expert_start, w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                  activation=self.activation)
        scales = dict(w13_scale=self.w13_scale, w2_scale=self.w2_scale)
        if self.weight_block is not None:
            scales["weight_block"] = self.weight_block
        if self.w13_zeros is not None:
            scales |= dict(w13_zeros=self.w13_zeros, w2_zeros=self.w2_zeros)
        if self.takes_gemv(x):
            from nanoserve.kernels.moe_gemv import moe_gemv

            return moe_gemv(x, self.w13, self.w2, topk_weights, topk_ids,
                            norm=(norm.weight, norm.eps) if norm is not None else None, **kw, **scales)
        if norm is not None:
            x = norm(x)
        if x.is_cuda and self.use_kernel:
            from nanoserve.kernels.fused_moe import fused_moe

            return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, **kw, **scales)
        return fused_moe_ref(x, *self.reference_weights(x.dtype), topk_weights, topk_ids, **kw)


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) a shared expert scaled by a sigmoid gate: the MLP of an MoE layer.
    `shared_expert` is a dense MLP module built without its own all-reduce, so the block reduces once."""

    def __init__(self, experts: FusedMoE, renormalize: bool, shared_expert: nn.Module | None = None,
                 router_bias: bool = False) -> None:
        super().__init__()
        hidden_size, self.top_k, self.renormalize, self.tp = experts.hidden_size, experts.top_k, renormalize, experts.tp
        # The router, replicated on every rank.
        self.gate = Linear(hidden_size, experts.num_experts, bias=router_bias)
        self.gate.never_quantized = True  # published quantized checkpoints keep their routers in 16 bits
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert is not None else None
        # kernels/moe_routing.py's router_topk: zero between launches (each launch leaves it so).
        self.register_buffer("router_counter", torch.zeros(1, dtype=torch.int32), persistent=False)

    def reset_buffers(self, device: torch.device) -> None:
        """The buffers of a block built on the meta device (a 4-bit checkpoint, or MXFP4 experts kept packed:
        model/loader.py), on `device`."""
        self.router_counter = torch.zeros(1, dtype=torch.int32, device=device)

    def forward(self, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        topk_weights, topk_ids = route(self.gate(x, plan), self.top_k, self.renormalize)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            # The gate is per token and the same on every rank, so it scales each rank's partial sum alike.
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x, plan)
        return self.tp.all_reduce(out)

    def forward_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                     plan: KernelPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """self(norm(x + residual)) and the next residual: the decoder layer's fused path. Where the plan fuses the
        router's prologue (a one-row graph) and the experts take the GEMVs, no launch of its own normalizes x: one
        launch adds the residual, normalizes, runs the router's GEMV and the top-k (kernels/moe_routing.py's
        router_topk), and the experts' gate/up GEMV normalizes the sum it returns again. A shared expert would need
        the normalized row itself."""
        if (self.shared_expert is None and self.gate.quant_method is None and x.shape[0] == 1
                and plan.takes_fused_prologue(self.gate.weight) and self.experts.takes_gemv(x)):
            from nanoserve.kernels.moe_routing import router_topk

            topk_weights, topk_ids, residual = router_topk(x, residual, norm.weight, norm.eps, self.gate.weight,
                                                           self.gate.bias, self.top_k, self.renormalize,
                                                           self.router_counter)
            return self.tp.all_reduce(self.experts(residual, topk_weights, topk_ids, norm)), residual
        x, residual = norm(x, residual)
        return self(x, plan), residual
