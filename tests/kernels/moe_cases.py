"""What the MoE kernel tests share (test_fused_moe.py, test_moe_gemv.py and the FP8, MXFP4 and W4 variants'): the
routing of a random batch, and the check of a kernel's output against fused_moe_ref."""

import torch

from nanoserve.kernels.moe_reference import fused_moe_ref

MOE_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def routing(num_tokens, top_k, num_experts, gen, device, dtype=torch.int64):
    """Distinct experts per token, as a router's top-k picks them, and positive weights."""
    ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return ids.to(device, dtype), weights.to(device)


def check_against_reference(out, x, values, weights, ids, x_ref=None, **reference_args):
    """out against fused_moe_ref in fp32 on the weights' values (dequantized where the kernel read them quantized)
    and the same (rounded) activations, relative to the largest output (quantization scales spread the outputs over
    magnitudes). x_ref: the reference's input where the kernel normalizes x itself; reference_args (expert_start,
    activation, biases) go to fused_moe_ref, tensors upcast."""
    upcast = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in reference_args.items()}
    ref = fused_moe_ref((x if x_ref is None else x_ref).float(), *values, weights, ids, **upcast)
    assert out.dtype == x.dtype and out.shape == x.shape
    top = ref.abs().max()
    torch.testing.assert_close(out.float() / top, ref / top, **MOE_TOL[x.dtype])
