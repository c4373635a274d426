"""MXFP4, the format OpenAI ships gpt-oss's expert weights in (quant_method "mxfp4"), and its exact dequantization.

A row of K weights is stored as K/32 blocks of 32 FP4 (E2M1) values, two to a byte (the low nibble first), in
`*_blocks` [..., K/32, 16] uint8, and one shared power-of-two scale per block, an E8M0 byte (2^(byte - 127)), in
`*_scales` [..., K/32]. gpt-oss quantizes only the experts' gate_up_proj and down_proj; attention, router, embeddings
and LM head stay bf16 (the config's `modules_to_not_convert`).

How it runs: on CUDA (runs_packed) the experts stay packed, 4.25 bits a weight (half a byte, and a scale byte per
32), in kernels/mxfp4_unpack.py's layout (the checkpoint's blocks and scales with rows regrouped, nothing recoded),
and the MoE kernels (kernels/fused_moe.py, kernels/moe_gemv.py) unpack them to the activations' dtype in registers.
Elsewhere (the CPU's PyTorch reference path) they are dequantized while loading into the model's dtype. Both compute
exactly what the checkpoint defines: every FP4 value times its scale is exact in bf16 (2 bits of mantissa, an 8-bit
exponent).
"""

from dataclasses import dataclass

import torch

# E2M1: sign, 2 exponent bits, 1 mantissa bit; code -> value.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
SCALE_BIAS = 127


@dataclass(frozen=True)
class MXFP4Scheme:
    """gpt-oss's MXFP4 experts (the only layers the format quantizes there)."""

    method: str = "mxfp4"
    serialized: bool = True

    def describe(self) -> str:
        return ("mxfp4 (gpt-oss experts): kept packed on the GPU and unpacked in the MoE kernels; dequantized to the "
                "model dtype on the CPU")


def runs_packed(device: torch.device) -> bool:
    """Whether MXFP4 experts on `device` stay packed for the MoE kernels (else they are dequantized while loading)."""
    return device.type == "cuda"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> values [..., G * 32] of dtype, exactly."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: blocks must be "
                         f"[..., G, {BLOCK // 2}] for scales [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values.flatten(-2), exponents[..., None])  # [..., G, 32]
    return values.flatten(-2).to(dtype)
