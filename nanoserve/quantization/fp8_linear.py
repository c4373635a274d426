"""Fp8LinearMethod: one FP8 scheme's parameters on a layers.linear.Linear, their loaders, and its forward.

Parameters, as the checkpoint names them beside each `weight` (which becomes float8_e4m3fn, keeping its loader):
- the weight scales (scheme.scale_name): per tensor, one number per checkpoint tensor, so a fused layer (q/k/v,
  gate/up) holds one per shard; per channel [rows, 1]; per block [row blocks, column blocks], a rank reading its
  blocks of rows (stacked shards) or of columns (row-parallel layers);
- input_scale (static activations): one number per checkpoint tensor.
After loading, `process_weights` puts them in the form the forward runs: per-tensor and per-channel weight scales
as one fp32 scale per output row, `weight_scale` [out] (a fused layer's shards keep their own scales exactly, and
the rowwise-scaled GEMM takes them as they are); block scales as `weight_scale` [row blocks, column blocks]; a fused
layer's input scales as their largest (q/k/v see the same input, so a calibration gives them the same scale).

Under tensor parallelism a row-parallel layer's input is quantized per token over its rank's columns, as vLLM does
(sharing each row's amax would cost an all-reduce a layer): the token scheme then differs slightly between TP
sizes, while block groups lie within a rank's columns (config.py's _check_quantization) and quantize alike at every
size.

The forward, by where it runs:
- steps the plan gives the skinny GEMM (layers/step_plan.py: in CUDA graphs, up to 32 rows; an fp8 weight of any
  size), with per-tensor or per-channel weights: Linear.forward, forward_norm and forward_silu_mul
  run kernels/gemv.py on the fp8 weight and `weight_scale` (skinny_weight), the residual add + RMSNorm or
  SiLU-and-mul fused in where the plan says. That GEMV dequantizes the weight in registers and keeps the activations
  in bf16, whatever the activation scheme: a W8A8 checkpoint (static or dynamic per-token) runs weight-only there.
  At a few rows the step is bound by the weight's bytes, which this halves against bf16 (Llama-3.1-8B batch 1:
  _scaled_mm with per-token quantization took 5.27 ms a token against bf16's 4.34), and the result is closer to the
  unquantized model's than with the activations quantized, but not the reference's (fp8_linear_reference quantizes
  them);
- block weights (weight_block_size, e.g. [128, 128]) keep kernels/fp8_block_gemm.py at every size, which quantizes
  the activations' groups itself (no per-row scale for the GEMV to apply);
- otherwise, on CUDA in bfloat16: per-token or static activations quantized to fp8 per row, then torch._scaled_mm
  with rowwise scales (apply_fp8). Before qkv_proj and gate_up_proj (Linear.forward_norm) the residual add + RMSNorm
  kernel quantizes its own output (kernels/rms_norm.py's rms_norm_fp8), before down_proj (forward_silu_mul) the
  SiLU- or GELU-and-mul kernel (kernels/activation.py's act_and_mul_fp8), as fp8_input asks: the bytes and scales of
  that kernel's bf16 output through kernels/fp8_quant.py's quantize_rows, which quantizes the input of every other
  layer (o_proj, and any layer called as Linear.forward) in apply. Weight-only, and shapes or dtypes that _scaled_mm
  does not take (it needs dimensions that divide by 16 and bf16 output with rowwise scales), dequantize and run
  PyTorch's GEMM (weight-only) or the reference;
- on the CPU, fp8_math.fp8_linear_reference (fp32).

ONE_ROW_FP8_DOT (on): W8A8 layers (per-token or static activations) offer no weight to the skinny GEMM, so every
step takes the path above, the inputs quantized by the kernel before, and up to kernels/fp8_gemv.py's MAX_M rows
apply_fp8 runs that fp8 x fp8 tensor-core GEMV instead of torch._scaled_mm: batch 1 as the format defines it, with no
per-element conversions. Llama-3.1-8B, batch 1, one H200, 7563300, one call: 4.453 ms a token with it against 5.027
through the weight-only skinny GEMM (bf16: 4.330).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.linear import Fp8Input, Linear, load_whole
from nanoserve.quantization import fp8_math
from nanoserve.quantization.fp8_math import FP8
from nanoserve.quantization.scheme import FP8Scheme

ONE_ROW_FP8_DOT = True  # the module docstring: faster than the weight-only skinny GEMM at batch 1

# --load-format dummy: every scale is 1, so the random fp8 weights are the weights (uniform in +-0.02, as an
# unquantized dummy model's).
DUMMY_SCALE = 1.0


def _param(data: torch.Tensor, loader=None) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    if loader is not None:
        param.weight_loader = loader
    param.dummy_value = DUMMY_SCALE
    return param


def _read_scalar(loaded) -> torch.Tensor:
    value = loaded[...]
    if value.numel() != 1:
        raise ValueError(f"has shape {tuple(value.shape)}, expected one number")
    return value.reshape(())


class Fp8LinearMethod:
    """The layers.linear.LinearMethod of an FP8Scheme."""

    def __init__(self, scheme: FP8Scheme) -> None:
        self.scheme = scheme

    # -- before loading -------------------------------------------------------------------------------------------
    def create_weights(self, layer: Linear) -> None:
        """The fp8 weight and the scale parameters a checkpoint of the scheme holds (or dummy weights fill)."""
        s = self.scheme
        loader = getattr(layer.weight, "weight_loader", load_whole)
        layer.weight = nn.Parameter(torch.empty_like(layer.weight, dtype=FP8), requires_grad=False)
        layer.weight.weight_loader = _fp8_only(loader)
        fused = getattr(layer, "shard_offsets", None)
        out_rows, in_cols = layer.weight.shape
        device = layer.weight.device
        if s.weights == "tensor":
            scale = _param(torch.empty(len(fused) if fused else 1, device=device),
                           self._scalar_per_shard(layer) if fused else _load_one)
        elif s.weights == "channel":
            scale = _param(torch.empty(out_rows, 1, device=device), layer.load_shard if fused else load_whole)
        else:
            rows, cols = s.block
            scale = _param(torch.empty(-(-out_rows // rows), -(-in_cols // cols), device=device),
                           self._block_rows(layer) if fused else self._block_columns(layer))
        layer.register_parameter(s.scale_name, scale)
        if s.activations == "tensor":
            layer.input_scale = _param(torch.empty(len(fused) if fused else 1, device=device),
                                       self._scalar_per_shard(layer) if fused else _load_one)

    def _scalar_per_shard(self, layer: Linear):
        index = {shard: i for i, shard in enumerate(layer.shard_offsets)}

        def load(param: nn.Parameter, loaded, shard: str) -> None:
            param.data[index[shard]] = _read_scalar(loaded)
        return load

    def _block_rows(self, layer: Linear):
        """A stacked shard's blocks of rows (config.py's _check_quantization made every shard whole blocks)."""
        rows = self.scheme.block[0]

        def load(param: nn.Parameter, loaded, shard: str) -> None:
            offset, size = layer.shard_offsets[shard]
            start, _, total = layer.shards[shard]
            shape = tuple(loaded.get_shape())
            if shape != (-(-total // rows), param.shape[1]):
                raise ValueError(f"has shape {shape}, expected {(-(-total // rows), param.shape[1])}")
            param.data[offset // rows:(offset + size) // rows].copy_(loaded[start // rows:(start + size) // rows])
        return load

    def _block_columns(self, layer: Linear):
        """A row-parallel layer's blocks of columns (its rank's input columns, whole blocks under TP)."""
        cols = self.scheme.block[1]
        tp = getattr(layer, "tp", None)

        def load(param: nn.Parameter, loaded, shard: str | None = None) -> None:
            size = 1 if tp is None else tp.size
            start = 0 if tp is None else tp.shard(layer.in_features * size)[0]
            shape = tuple(loaded.get_shape())
            want = (param.shape[0], -(-layer.in_features * size // cols))
            if shape != want:
                raise ValueError(f"has shape {shape}, expected {want}")
            param.data.copy_(loaded[:, start // cols:start // cols + param.shape[1]])
        return load

    # -- after loading --------------------------------------------------------------------------------------------
    def quantize_loaded(self, layer: Linear) -> None:
        """An unquantized weight quantized per output channel (scheme "quantized at load"). A row-parallel layer's
        rows are split over the ranks by columns: their largest magnitude is taken over all ranks, so that every
        tensor-parallel size quantizes alike."""
        w = layer.weight.data
        amax = w.abs().amax(dim=1, keepdim=True).float()
        tp = getattr(layer, "tp", None)
        if tp is not None and tp.size > 1 and hasattr(layer, "load_columns"):
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp.group)
        scale = fp8_math.dynamic_scale(amax)
        layer.weight = nn.Parameter(fp8_math.quantize(w, scale), requires_grad=False)
        layer.register_parameter(self.scheme.scale_name, _param(scale))

    def process_weights(self, layer: Linear) -> None:
        """The loaded parameters in the form the forward runs (module docstring), and the layer's quant_method."""
        s = self.scheme
        scale = getattr(layer, s.scale_name).data.float()
        del layer._parameters[s.scale_name]
        if s.weights != "block":
            if scale.numel() == 1:
                scale = scale.expand(layer.weight.shape[0])
            elif s.weights == "tensor":  # one per stacked shard
                sizes = torch.tensor([size for _, size in layer.shard_offsets.values()], device=scale.device)
                scale = scale.repeat_interleave(sizes)
            scale = scale.reshape(-1)
        layer.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)
        if s.activations == "tensor":
            layer.input_scale = nn.Parameter(layer.input_scale.data.float().amax().reshape(1), requires_grad=False)
        # The split-K kernels' arrival counters (fp8_gemv at one row, fp8_block_linear at decode sizes), allocated
        # once before any CUDA graph is captured; a buffer, not a parameter: the loader and state_dict ignore it.
        if layer.weight.is_cuda and (s.activations == "group" or (ONE_ROW_FP8_DOT and s.activations in ("token",
                                                                                                        "tensor"))):
            from nanoserve.kernels.fp8_gemv import split_counters

            layer.register_buffer("split_counters", split_counters(layer.weight.shape[0], layer.weight.device),
                                  persistent=False)
        layer.quant_method = self

    # -- forward --------------------------------------------------------------------------------------------------
    def skinny_weight(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fp8 weight [N, K] and its fp32 scale per output row [N] for the skinny GEMM (layers.linear's
        skinny_operands): per-tensor and per-channel weights, whatever the activations' scheme. None for block
        scales, and on GPUs before compute capability 8.9, which have no e4m3 conversions for Triton to load with."""
        if self.scheme.weights == "block" or (ONE_ROW_FP8_DOT and self.scheme.activations is not None):
            return None
        if layer.weight.is_cuda and torch.cuda.get_device_capability(layer.weight.device) < (8, 9):
            return None
        return layer.weight, layer.weight_scale

    def fp8_input(self, layer: Linear, x: torch.Tensor) -> Fp8Input | None:
        """Where _apply_cuda would quantize an input of x's dtype and device with quantize_rows: that quantization,
        for the kernel making the input to do (layers.linear's LinearMethod)."""
        if not self._quantizes_input(layer, x):
            return None
        return Fp8Input(layer.input_scale if self.scheme.activations == "tensor" else None)

    def _quantizes_input(self, layer: Linear, x: torch.Tensor) -> bool:
        """Whether _apply_cuda runs quantize_rows and torch._scaled_mm on x: per-token or static activations,
        bf16, and dimensions that divide by 16 (_scaled_mm's)."""
        n, k = layer.weight.shape
        return (x.is_cuda and self.scheme.activations in ("token", "tensor") and x.dtype == torch.bfloat16
                and not n % 16 and not k % 16)

    def apply_fp8(self, layer: Linear, q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """The output [M, N] for the input quantized as fp8_input asked: q [M, K] float8_e4m3fn, x_scale [M, 1]."""
        if ONE_ROW_FP8_DOT:
            from nanoserve.kernels.fp8_gemv import MAX_M, fp8_gemv

            if q.shape[0] <= MAX_M:
                return fp8_gemv(q, x_scale, layer.weight, layer.weight_scale, layer.bias,
                                counters=getattr(layer, "split_counters", None))
        y = torch._scaled_mm(q, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale.view(1, -1),
                             out_dtype=torch.bfloat16)
        return y if layer.bias is None else y + layer.bias

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        input_scale = layer.input_scale if s.activations == "tensor" else None
        if x.is_cuda:
            y = self._apply_cuda(layer, x.reshape(-1, x.shape[-1]), input_scale)
            if y is not None:
                return y.view(*x.shape[:-1], -1)
        return fp8_math.fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias, s.activations,
                                             input_scale, s.block)

    def _apply_cuda(self, layer: Linear, x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor | None:
        """The CUDA kernels' result, or None where they do not apply (the reference runs)."""
        s = self.scheme
        if s.activations == "group":
            from nanoserve.kernels.fp8_block_gemm import fp8_block_linear

            return fp8_block_linear(x, layer.weight, layer.weight_scale, s.block, layer.bias,
                                    counters=getattr(layer, "split_counters", None))
        if s.activations is None:
            w = fp8_math.dequantize_weight(layer.weight, layer.weight_scale, s.block).to(x.dtype)
            return F.linear(x, w, layer.bias)
        if not self._quantizes_input(layer, x):
            return None
        from nanoserve.kernels.fp8_quant import quantize_rows

        return self.apply_fp8(layer, *quantize_rows(x, input_scale))


def _load_one(param: nn.Parameter, loaded, shard: str | None = None) -> None:
    param.data[0] = _read_scalar(loaded)


def _fp8_only(loader):
    """The weight's own loader, refusing a checkpoint weight that is not fp8 (its config says it is)."""

    def load(param: nn.Parameter, loaded, shard: str | None = None) -> None:
        if hasattr(loaded, "get_dtype") and loaded.get_dtype() != "F8_E4M3":
            raise ValueError(f"is {loaded.get_dtype()}, expected F8_E4M3 (the quantization_config's fp8 weights)")
        loader(param, loaded, shard)
    return load
