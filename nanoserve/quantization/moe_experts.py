"""Quantized routed experts (Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints in FP8 or 4-bit), dequantized while loading.

A quantized mixture-of-experts checkpoint stores each expert's gate, up and down projection as the scheme stores a
linear layer (FP8: `weight` and its scales; GPTQ, AWQ, compressed-tensors: the packed tensors of w4_formats.py). The
fused MoE kernels (kernels/fused_moe.py, moe_gemv.py) multiply 16-bit weights, so ExpertDequantizer gathers an
expert projection's tensors as the loader reads them and, once the last has come, turns them into the weight they
define (fp8_math.dequantize_weight; W = (q - z) * s for 4 bits), rounded to the model's dtype, and hands it to
FusedMoE.load_expert like an unquantized checkpoint's tensor (which takes this rank's share).

What that gives: the checkpoints load, and the experts compute with exactly the checkpoint's weights, up to the
model dtype's rounding (exact for FP8, whose values times a power-of-two scale fit bf16, and on the CPU's fp32). An
FP8 W8A8 checkpoint's expert inputs are not quantized (its static input_scale is read and dropped): more exact than
the format, not bit-equal to it. What it does not give: the format's memory (the experts take 2x their FP8 bytes,
about 3.8x their 4-bit ones) nor its speed; kernels that read FP8 or 4-bit experts are later work (issue 41). The
router stays unquantized, as the published checkpoints keep it (SparseMoeBlock marks it); the attention and a shared
expert are linear layers, quantized as in a dense model.
"""

import torch
from torch import nn

from nanoserve.quantization.fp8_math import FP8, dequantize_weight
from nanoserve.quantization.scheme import FP8Scheme
from nanoserve.quantization.w4_formats import W4Weights, checkpoint_tensors, param_dtype, to_w4
from nanoserve.quantization.w4_scheme import W4Scheme

# Read, and not used: experts run their inputs unquantized (module docstring).
_DROPPED = ("input_scale",)


class _Whole:
    """A dequantized tensor as a checkpoint slice looks to a weight_loader (get_shape, indexing)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def dequantize_w4(w: W4Weights, scheme: W4Scheme) -> torch.Tensor:
    """The fp32 weight [N, K] that a layer's W4Weights stand for."""
    k = w.q.shape[0]
    if w.g_idx is not None:
        groups = w.g_idx.long()
    elif scheme.group_size == -1:
        groups = torch.zeros(k, dtype=torch.long)
    else:
        groups = torch.arange(k) // scheme.group_size
    zeros = 8.0 if w.zeros is None else w.zeros.float()[groups]
    return ((w.q.float() - zeros) * w.scales.float()[groups]).t()


class ExpertDequantizer:
    """Installed on a FusedMoE as its parameters' weight_loader: takes an expert projection's quantized tensors
    (shards 'gate:3#qweight', or 'gate:3' for an FP8 `weight`) and loads the weight they define once all are in."""

    def __init__(self, experts: nn.Module, scheme: FP8Scheme | W4Scheme, name: str) -> None:
        self.experts, self.scheme, self.name = experts, scheme, name
        self.load_expert = experts.load_expert
        if isinstance(scheme, W4Scheme):
            self.parts = set(checkpoint_tensors(scheme))
        else:
            self.parts = {"weight", scheme.scale_name}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # shard ('gate:3') -> its tensors so far
        # Shards loaded whole. The loader counts a shard as read at any of its tensors (an input_scale included), so
        # check_complete looks for every one of this rank's here.
        self._done: set[str] = set()

    def __call__(self, param: nn.Parameter, loaded, shard: str) -> None:
        shard, _, part = shard.partition("#")
        part = part or "weight"
        proj, expert = shard.split(":")
        if part in _DROPPED or int(expert) not in self.experts.local_experts:
            return  # unused, or another rank's expert: left unread
        if part not in self.parts:
            raise ValueError(f"is not a tensor of a {self._format()} expert (expected {sorted(self.parts)})")
        tensor = loaded[...]
        if isinstance(self.scheme, FP8Scheme) and part == "weight" and tensor.dtype != FP8:
            raise ValueError(f"is {tensor.dtype}, expected float8_e4m3fn (the quantization_config's fp8 weights)")
        tensors = self._pending.setdefault(shard, {})
        tensors[part] = tensor
        if tensors.keys() == self.parts:
            del self._pending[shard]
            self._done.add(shard)
            self.load_expert(param, _Whole(self._dequantize(tensors, shard).to(param.dtype)), shard)

    def _dequantize(self, tensors: dict[str, torch.Tensor], shard: str) -> torch.Tensor:
        if isinstance(self.scheme, FP8Scheme):
            return dequantize_weight(tensors["weight"], tensors[self.scheme.scale_name], self.scheme.block)
        # to_w4 reads a fused layer's g_idx per stacked module; an expert projection is one module.
        tensors = {k: (v[None] if k.endswith("g_idx") else v).to(param_dtype(k)) for k, v in tensors.items()}
        return dequantize_w4(to_w4(tensors, self.scheme, f"{self.name}:{shard}"), self.scheme)

    def check_complete(self) -> None:
        """Raises ValueError naming an expert projection whose tensors the checkpoint did not all hold."""
        expected = [shard for shards in self.experts.expected_shards().values() for shard in shards]
        for shard in expected:
            if shard not in self._done:
                missing = sorted(self.parts - self._pending.get(shard, {}).keys())
                raise ValueError(f"model: {self.name} expert projection {shard} lacks {', '.join(missing)} in the "
                                 f"checkpoint (a {self._format()} expert needs {sorted(self.parts)})")

    def _format(self) -> str:
        return self.scheme.method if isinstance(self.scheme, W4Scheme) else f"fp8 ({self.scheme.method})"
