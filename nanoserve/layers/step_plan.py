"""A step's kernel choices, decided in one place.

`KernelPlanner` is built once per engine from what does not change between steps (EngineArgs' fused_rope_decode
and pdl, whether the model has q/k norms, the device, and prefill attention's planner for the model's heads);
`KernelPlanner.plan` turns a batch shape into a `KernelPlan` once per eager step or once per captured CUDA graph
(its bucket's shape), and the plan rides in AttentionMetadata.plan. Layers read it; none of them branches on graph
capture or the environment. The rules and the measurements that chose them:

Skinny GEMM (kernels/gemv.py) instead of cuBLAS: in CUDA graphs, for steps of up to SKINNY_MAX_ROWS rows, weights of
up to SKINNY_MAX_WEIGHT_BYTES. Measured on an H200 inside CUDA graphs (probe at 275aa23): at one or two rows the
Triton skinny GEMM streams Qwen3-0.6B's weights up to 3.5x faster than cuBLAS, and Llama-8B's qkv and o_proj (50 and
32 MB) 3-9% faster, but its gate_up and down (235 and 117 MB) 4-5% slower. Launched eagerly (tens of microseconds of
Triton launch cost) cuBLAS is faster. Timed one GEMM at a time, cuBLAS was as fast from 4 rows on; but in whole
decode steps on an H100 (where the skinny GEMM starts under PDL beside the Triton kernels around it; probe at
275aa23), the skinny GEMM made Qwen3-0.6B's steps 1.0-8.6 % faster at 3-32 rows and Llama-3.1-8B's (qkv and o_proj)
1.3-2.2 % at 4-32, and cuBLAS won from 48 rows.
An fp8 weight (a quantized layer's, layers/linear.py's skinny_operands) takes the skinny GEMM at any size: what runs
otherwise is a per-token quantization launch and torch._scaled_mm, and whole Llama-3.1-8B batch-1 steps (H200,
c14782a, one call) took 5.665 ms with fp8 weights past 64 MB left to _scaled_mm (gate_up_proj), 5.032 with every fp8
weight in the skinny GEMM on the CUDA cores (kernels/gemv.py), 6.12 and 6.82 with its tensor-core path from 32 and
8 MB on.

Fused prologues (the residual add + RMSNorm before qkv_proj and gate_up_proj, SiLU-and-mul before down_proj, run
inside the skinny GEMM): only at one row, and not on the tensor cores, which a large weight takes at one row
(kernels/gemv.py, tensor_cores_at). Measured on an H200 in graphs (probe at 275aa23), fusing saves 0.2-0.9 us per
GEMM at one row but costs 0.2-3.4 us at two, where every program redoes the prologue for both rows. At batch 1 a
launch costs 2-3 us while a whole Qwen3-0.6B layer streams its weights in about 7 us.

SiLU-and-mul GEMV (kernels/silu_mul_gemv.py, which has the measurements): one row in a graph, a weight past the
skinny GEMM's limit and no bias (Llama-3.1-8B's down projection), where cuBLAS would run after SiLU-and-mul.

Fused rope decode: whether steps that are all decodes do q/k norm, rotary and the KV store inside decode attention's
launch (kernels/decode_rope_attention.py) instead of a launch of their own (qkv_rope_store); only with the Triton
attention kernels (a reference run may put the PyTorch backend on a GPU). fused_rope_decode "on": every such step,
"off": none, "auto": for models without q/k norms at up to FUSED_ROPE_DECODE_MAX_BATCH sequences, and for models with
them at one. Measured on an H100 (bench latency, A/B): Llama-3.1-8B batch-1 decode 6.11 -> 6.01 ms/token and
Qwen2.5-0.5B 0.88 -> 0.83 (f763de1); the throughput run (Qwen3-0.6B, batch 256) fell from 76 to 73 % of bound
(e01b115; on an H200 77.4 -> 72.8 % at 72f5345, with the plain kernel's longest-first order). Qwen3-0.6B at batch 1
went 1.04 -> 1.17 until its qkv GEMV started attention's programs late (the late qkv start below): against the
unfused pair, H200 0.922 -> 0.901, H100 1.024 -> 0.989 (medians of interleaved runs on one machine each). The
batch limit is the fused merge's: there the fused launch is one kernel, not two; at batch 4 it measured 29.0 ->
27.8 us a Llama-3.1-8B layer (128 keys).

Late qkv start: before the fused rope decode of a model with q/k norms, whose programs would otherwise wait beside the
GEMV's from its start, the qkv GEMV with the norm fused in lets them start once its weight is loaded (only where
that fused kernel runs: the CUDA-core GEMV of a batch-1 graph, under PDL; kernels/gemv.py, skinny_norm_linear).

Fused decode merge: decode graphs of up to FUSED_DECODE_MERGE_MAX_BATCH sequences merge attention's splits in the
split kernel itself (with counters; kernels/decode_attention.py). Measured on an H200 (probe at 275aa23): one launch
saves ~1 us a layer at batch 1 (16 splits), is even at batch 8 and ~2-5 us slower at batch 256, where the merging
programs' extra registers cost more than a launch. Eager steps merge in a second launch.

Decode order: from DECODE_ORDER_MIN_BATCH, decode graphs sort their sequences longest first (on the device, in the
graph) and decode attention dispatches their programs in that order, so that no long sequence starts as the launch
drains. Measured on an H100 (contexts of 100-2,048 keys, us a call; probe at 275aa23): batch 256 375.4 -> 370.5,
128 198.1 -> 196.8, 64 110.4 -> 109.7; the order costs one launch a step, once for all layers
(kernels/decode_order.py).

PDL (kernels/pdl.py): on devices of compute capability 9.0 and up unless EngineArgs.pdl is off. It is not a
per-step choice: the planner sets the kernels' one switch when it is built, and every kernel launch reads it.

Prefill attention's layout (query rows per tile, map rows, key splits, scratch): `KernelPlanner.prefill`
(kernels/prefill/planner.py, whose rules cite their measurements), one planner for eager steps
(worker/cuda_graphs.py, eager_tile_map) and the prefill graphs (PrefillGraphRunner) alike.

Launch shapes that follow from tensor shapes alone stay with their kernels: the skinny GEMM's blocks
(kernels/gemv.py, _config), decode attention's splits (kernels/decode_attention.py, default_num_splits).
"""

from dataclasses import dataclass

import torch

from nanoserve.kernels.prefill.planner import PrefillPlanner

SKINNY_MAX_ROWS = 32
SKINNY_MAX_WEIGHT_BYTES = 64 << 20
FUSED_DECODE_MERGE_MAX_BATCH = 4
FUSED_ROPE_DECODE_MAX_BATCH = FUSED_DECODE_MERGE_MAX_BATCH
DECODE_ORDER_MIN_BATCH = 128
FUSED_ROPE_DECODE_MODES = ("auto", "on", "off")


def _weight_bytes(weight: torch.Tensor) -> int:
    return weight.numel() * weight.element_size()


@dataclass(frozen=True)
class KernelPlan:
    """One step's kernel choices (the module docstring gives each rule). The default, every field off, is the
    plain path: PyTorch's GEMMs and the unfused kernels."""

    skinny_gemm: bool = False  # projections whose weight fits take the skinny GEMM
    fused_prologues: bool = False  # a one-row step in a graph: norms and SiLU-and-mul inside the GEMM after them
    fused_rope_decode: bool = False  # q/k norm, rotary and KV store inside decode attention
    late_qkv_start: bool = False  # the qkv GEMV starts the kernel after it (fused rope decode) late
    fused_decode_merge: bool = False  # decode attention merges its splits in the same launch (needs counters)
    decode_order: bool = False  # decodes dispatched longest first (needs an order buffer)

    def takes_skinny_gemm(self, weight: torch.Tensor) -> bool:
        """Whether a projection with this weight runs the skinny GEMM."""
        fp8 = weight.dtype == torch.float8_e4m3fn  # any size (module docstring)
        return self.skinny_gemm and (fp8 or _weight_bytes(weight) <= SKINNY_MAX_WEIGHT_BYTES)

    def takes_fused_prologue(self, weight: torch.Tensor) -> bool:
        """Whether the skinny GEMM of this weight also runs the op before it (Linear.forward_norm,
        forward_silu_mul): one row, on the CUDA cores."""
        if not (self.fused_prologues and self.takes_skinny_gemm(weight)):
            return False
        from nanoserve.kernels.gemv import tensor_cores_at

        return not tensor_cores_at(1, weight)

    def takes_silu_mul_gemv(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether SiLU-and-mul and this projection run as one GEMV (kernels/silu_mul_gemv.py)."""
        return self.fused_prologues and bias is None and _weight_bytes(weight) > SKINNY_MAX_WEIGHT_BYTES


EAGER = KernelPlan()


class KernelPlanner:
    """Decides each step's KernelPlan for one engine: fused_rope_decode ("auto", "on" or "off") and pdl as
    EngineArgs give them, qk_norm whether the model norms q and k per head (Qwen3), device the engine's, prefill the
    launch planner of prefill attention for the model's heads on that device (None where no Triton kernel runs)."""

    def __init__(self, fused_rope_decode: str = "auto", pdl: bool = True, qk_norm: bool = False,
                 device: torch.device | str = "cpu", prefill: PrefillPlanner | None = None) -> None:
        if fused_rope_decode not in FUSED_ROPE_DECODE_MODES:
            raise ValueError(f"fused_rope_decode: must be auto, on or off, got {fused_rope_decode!r}")
        self.fused_rope_decode, self.qk_norm = fused_rope_decode, qk_norm
        self.device = torch.device(device)
        self.prefill = prefill
        if self.device.type == "cuda":
            from nanoserve.kernels.pdl import set_pdl

            set_pdl(pdl)

    def _fuses_rope(self, num_decodes: int, num_tokens: int, triton: bool) -> bool:
        if not (triton and num_decodes == num_tokens):
            return False
        if self.fused_rope_decode == "auto":
            return num_tokens <= (1 if self.qk_norm else FUSED_ROPE_DECODE_MAX_BATCH)
        return self.fused_rope_decode == "on"

    def plan(self, num_seqs: int, num_decodes: int, num_tokens: int, graph: bool = False,
             triton: bool | None = None, long_context: bool = False) -> KernelPlan:
        """The plan of a step of num_tokens tokens in num_seqs sequences, the first num_decodes of which are decodes
        (one token each). graph: the step is captured in a CUDA graph (for a bucket: its padded shape). triton:
        whether attention runs the Triton kernels (default: on CUDA). long_context: the step has long-context
        rows, whose attention Attention.attend redoes (worker/kv_ring.py): the fused rope decode, which bypasses it,
        is off."""
        # The PyTorch backend (the CPU's, or a reference run's on a GPU) has no fused rope decode.
        triton = self.device.type == "cuda" if triton is None else triton
        fused_rope = self._fuses_rope(num_decodes, num_tokens, triton) and not long_context
        # The merge and the order need buffers that only the decode graphs own (the counters, the order).
        all_decodes = graph and num_decodes == num_seqs
        return KernelPlan(
            # Only in graphs, which replay launches for free: launched eagerly, Triton's tens of microseconds of
            # launch cost made cuBLAS faster.
            skinny_gemm=graph and num_tokens <= SKINNY_MAX_ROWS,
            fused_prologues=graph and num_tokens == 1,
            fused_rope_decode=fused_rope,
            late_qkv_start=fused_rope and self.qk_norm,
            fused_decode_merge=all_decodes and num_seqs <= FUSED_DECODE_MERGE_MAX_BATCH,
            decode_order=all_decodes and num_seqs >= DECODE_ORDER_MIN_BATCH,
        )
