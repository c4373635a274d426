"""The checkpoint tensors of each 4-bit format beside a quantized module (in place of its `weight`), and their
conversion to the one layout the engine runs (w4_packing.py's W4 layout).

A tensor's dimensions are named by what they run over, for a weight of N output rows and K input columns in G
groups: "n" (rows), "n/8" (rows packed eight to an int32), "k", "k/8", "g", and "2" (a pair of numbers):
- gptq: qweight ("k/8", "n"), qzeros ("g", "n/8", zero points minus zero_offset), scales ("g", "n"), g_idx ("k",:
  each input column's group);
- awq: qweight ("k", "n/8"), qzeros ("g", "n/8"), both in AWQ's order within each int32; scales ("g", "n");
- compressed-tensors: weight_packed ("n", "k/8", the signed values plus 8), weight_scale ("n", "g"),
  weight_zero_point ("n/8", "g", signed plus 8; asymmetric only), weight_g_idx ("k",; actorder "group" only),
  weight_shape ("2",: [N, K]).
"""

import torch

from nanoserve.quantization.w4_packing import unpack, unpack_awq
from nanoserve.quantization.w4_scheme import W4Scheme

_TENSORS = {
    "gptq": {"qweight": ("k/8", "n"), "qzeros": ("g", "n/8"), "scales": ("g", "n"), "g_idx": ("k",)},
    "awq": {"qweight": ("k", "n/8"), "qzeros": ("g", "n/8"), "scales": ("g", "n")},
    "compressed-tensors": {"weight_packed": ("n", "k/8"), "weight_scale": ("n", "g"),
                           "weight_zero_point": ("n/8", "g"), "weight_g_idx": ("k",), "weight_shape": ("2",)},
}
SCALES = ("scales", "weight_scale")
G_IDX = ("g_idx", "weight_g_idx")


def checkpoint_tensors(scheme: W4Scheme) -> dict[str, tuple[str, ...]]:
    """Name -> dimensions of the tensors a quantized module of the scheme's checkpoint holds."""
    tensors = dict(_TENSORS[scheme.method])
    if scheme.method == "compressed-tensors":
        if scheme.symmetric:
            del tensors["weight_zero_point"]
        if not scheme.act_order:
            del tensors["weight_g_idx"]
    return tensors


def param_dtype(name: str) -> torch.dtype:
    """Scales load into fp32 (exact for the fp16 / bf16 / fp32 of any checkpoint), weight_shape int64, the rest
    int32."""
    return torch.float32 if name in SCALES else torch.int64 if name == "weight_shape" else torch.int32


class W4Weights:
    """One layer's weight in the W4 layout, before act-order and packing (w4_linear.py does those): q uint8 [K, N],
    zeros uint8 [G, N] or None (8), scales fp32 [G, N], g_idx [K] or None."""

    def __init__(self, q: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor,
                 g_idx: torch.Tensor | None) -> None:
        self.q, self.zeros, self.scales, self.g_idx = q, zeros, scales, g_idx


def _same_for_every_shard(t: torch.Tensor, name: str) -> torch.Tensor:
    """A per-shard tensor (g_idx) that the stacked shards of a fused layer must share: their input is one."""
    if not bool((t == t[0]).all()):
        raise ValueError(f"{name} differs between the stacked modules (q/k/v or gate/up); nanoserve runs them as "
                         "one layer, which needs one")
    return t[0]


def _zeros(zeros: torch.Tensor, scheme: W4Scheme, name: str) -> torch.Tensor | None:
    """Zero points (uint8) with the format's offset added, or None for a symmetric scheme (whose stored zeros, where
    the format stores them, must all be 8)."""
    zeros = zeros.to(torch.int16) + scheme.zero_offset
    if scheme.symmetric:
        if not bool((zeros == 8).all()):
            raise ValueError(f"{name} holds zero points other than 8, but the quantization_config says symmetric")
        return None
    return zeros.to(torch.uint8)


def to_w4(tensors: dict[str, torch.Tensor], scheme: W4Scheme, module: str) -> W4Weights:
    """A layer's loaded checkpoint tensors (its rank's share) as W4Weights; module names it in errors."""
    if scheme.method == "gptq":
        zeros = _zeros(unpack(tensors["qzeros"], 1), scheme, f"{module}.qzeros")
        g_idx = _same_for_every_shard(tensors["g_idx"], f"{module}.g_idx")
        return W4Weights(unpack(tensors["qweight"], 0), zeros, tensors["scales"], g_idx)
    if scheme.method == "awq":
        zeros = _zeros(unpack_awq(tensors["qzeros"]), scheme, f"{module}.qzeros")
        return W4Weights(unpack_awq(tensors["qweight"]), zeros, tensors["scales"], None)
    zeros = None
    if not scheme.symmetric:
        zeros = _zeros(unpack(tensors["weight_zero_point"], 0).t(), scheme, f"{module}.weight_zero_point")
    g_idx = None
    if scheme.act_order:
        g_idx = _same_for_every_shard(tensors["weight_g_idx"], f"{module}.weight_g_idx")
    return W4Weights(unpack(tensors["weight_packed"], 1).t(), zeros, tensors["weight_scale"].t(), g_idx)
