"""The loader's two hooks (model/loader.py): which of a model's linear layers a scheme quantizes, their quantized
parameters (fp8, or a 4-bit format's packed tensors) before the weights are filled, and their runtime form after.

Every layers.linear.Linear is quantized (q/k/v, o, gate/up and down projections) unless the scheme's ignore list
names its checkpoint modules; the embeddings, the LM head and the norms are other classes and stay as they are.
A fused layer stacks several checkpoint modules (qkv_proj: q_proj, k_proj, v_proj): all of them are ignored, or
none.

A serialized checkpoint, and dummy weights of any scheme, fill the fp8 parameters directly. A scheme quantized at
load (`--quantization fp8` on an unquantized checkpoint) loads the weights as they are and quantizes each layer
after: the whole unquantized model is in memory once, as it would be unquantized.
"""

import logging
from collections.abc import Iterator

import torch
from torch import nn

from nanoserve.layers.linear import Linear
from nanoserve.layers.moe import FusedMoE
from nanoserve.quantization import moe_experts, mxfp4
from nanoserve.quantization.fp8_linear import Fp8LinearMethod
from nanoserve.quantization.fp8_math import FP8
from nanoserve.quantization.moe_experts import ExpertDequantizer
from nanoserve.quantization.mxfp4 import MXFP4Scheme
from nanoserve.quantization.scheme import FP8Scheme
from nanoserve.quantization.w4_linear import W4LinearMethod
from nanoserve.quantization.w4_scheme import W4Scheme

logger = logging.getLogger(__name__)


def checkpoint_modules(model: nn.Module, name: str) -> list[str]:
    """The checkpoint modules that the model's module `name` holds: the ones stacked in a fused layer (the
    model's packed_modules), else itself."""
    base, _, last = name.rpartition(".")
    parts = [part for part, (fused, _) in getattr(model, "packed_modules", {}).items() if fused == last]
    return [f"{base}.{part}" for part in parts] or [name]


def quantized_layers(model: nn.Module, scheme: FP8Scheme | W4Scheme) -> Iterator[tuple[str, Linear]]:
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or getattr(module, "never_quantized", False):
            continue
        ignored = [scheme.ignores(part) for part in checkpoint_modules(model, name)]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(f"quantization_config: the ignore list {list(scheme.ignore)} names some of "
                             f"{checkpoint_modules(model, name)}, which nanoserve runs as one layer; ignore all "
                             "of them or none")
        yield name, module


def quantized_experts(model: nn.Module, scheme: FP8Scheme | W4Scheme) -> Iterator[tuple[str, FusedMoE]]:
    """The routed experts that the scheme quantizes (quantization/moe_experts.py keeps them in FP8 or dequantizes
    them while loading)."""
    projections = getattr(model, "expert_projections", {})
    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        # The checkpoint's module names (Mixtral's block_sparse_moe is our mlp).
        ckpt = name
        for theirs, ours in getattr(model, "renamed_modules", {}).items():
            ckpt = ckpt.replace(f".{ours}.", f".{theirs}.")
        ignored = {scheme.ignores(f"{ckpt}.{e}.{p}") for e in range(module.num_experts) for p in projections}
        if ignored == {False}:
            yield name, module
        elif ignored == {True, False}:
            raise ValueError(f"quantization_config: the ignore list {list(scheme.ignore)} names some of the experts "
                             f"of {ckpt}, which nanoserve runs as one layer; ignore all of them or none")


def replaces_weights(scheme: FP8Scheme | W4Scheme | MXFP4Scheme, device: torch.device, moe: bool = False) -> bool:
    """Whether the quantized layers hold other tensors than their unquantized weight on `device` (so the loader may
    build the model on the meta device, prepare_model putting these on the real one): 4-bit weights, MXFP4 experts
    where they stay packed, and (moe: the model has routed experts) an FP8 checkpoint's experts where they stay
    FP8, whose 16-bit form may not fit (Qwen3-235B-A22B-FP8 on 4 GPUs)."""
    if isinstance(scheme, FP8Scheme):
        return moe and scheme.serialized and moe_experts.runs_fp8(device)
    return isinstance(scheme, W4Scheme) or (isinstance(scheme, MXFP4Scheme) and mxfp4.runs_packed(device))


def prepare_model(model: nn.Module, scheme: FP8Scheme | W4Scheme | MXFP4Scheme, dummy: bool,
                  device: torch.device) -> None:
    """Before the weights are filled: the quantized parameters and their loaders, on `device`, where the checkpoint
    (or the dummy initialization) provides them; MXFP4 experts told to expect blocks and scales, and to keep them
    packed where runs_packed (random weights too: random blocks; elsewhere these stay in the dtype the experts run
    in); an FP8 checkpoint's experts kept in FP8 where moe_experts.runs_fp8 and this rank's share is whole blocks of
    scales (random weights too: random fp8 values), a 4-bit one's kept packed where moe_experts.runs_w4 and fits_w4
    (random weights too: random packed values), else dequantized while loading."""
    if isinstance(scheme, MXFP4Scheme):
        packed = mxfp4.runs_packed(device)
        if packed or not dummy:
            experts = [module for module in model.modules() if hasattr(module, "expect_mxfp4")]
            for module in experts:
                module.expect_mxfp4(packed, device)
            if packed and not all(module.packed for module in experts):
                logger.warning("MXFP4 experts dequantized while loading (4x their bytes): this rank's share of "
                               "intermediate_size is not whole blocks of 32 values (enable_expert_parallel keeps "
                               "them packed)")
        return
    if not (scheme.serialized or dummy):
        return
    fp8 = isinstance(scheme, FP8Scheme) and scheme.serialized and moe_experts.runs_fp8(device)
    w4 = isinstance(scheme, W4Scheme) and moe_experts.runs_w4(device)
    cut = []
    for name, experts in quantized_experts(model, scheme):
        if fp8 and moe_experts.fits_fp8(experts, scheme):
            moe_experts.keep_fp8(experts, scheme, name, device, dummy)
            continue
        if w4 and moe_experts.fits_w4(experts, scheme):
            moe_experts.keep_w4(experts, scheme, name, device, dummy)
            continue
        cut += [name] if fp8 or w4 else []
        if not dummy:  # (random experts are drawn in the model dtype they run in)
            experts.w13.weight_loader = experts.w2.weight_loader = ExpertDequantizer(experts, scheme, name)
    if cut and fp8:
        logger.warning("FP8 experts dequantized while loading (2x their bytes): this rank's share of the experts' "
                       "intermediate size is not whole %sx%s blocks of scales, or a block is not whole tiles of 16 "
                       "columns (kernels/fp8_experts.py)", *scheme.block)
    if cut and w4:
        logger.warning("4-bit experts dequantized while loading (about 3.8x their bytes): %s (kernels/w4_experts.py)",
                       _w4_cut_reason(scheme))
    if isinstance(scheme, W4Scheme):
        method = W4LinearMethod(scheme)
        for _, layer in quantized_layers(model, scheme):
            method.create_weights(layer, device)
        return
    method = Fp8LinearMethod(scheme)
    for _, layer in quantized_layers(model, scheme):
        method.create_weights(layer)


def _w4_cut_reason(scheme: W4Scheme) -> str:
    """Why moe_experts.fits_w4 refused a W4Scheme's experts."""
    if scheme.act_order:
        return "act-order (desc_act / actorder 'group') experts have no 4-bit MoE kernel"
    if scheme.group_size != -1 and scheme.group_size % 16:
        return f"groups of {scheme.group_size} columns are not whole tiles of 16"
    return (f"this rank's share of the experts' intermediate size is not whole groups of {scheme.group_size} (and "
            "int32s of 8) columns (enable_expert_parallel keeps them packed)")


def finish_model(model: nn.Module, scheme: FP8Scheme | W4Scheme | MXFP4Scheme) -> None:
    """After the weights are filled: unquantized ones quantized (an FP8 scheme quantized at load), every layer's
    parameters in their runtime form and its quant_method set."""
    if isinstance(scheme, MXFP4Scheme):
        return
    for _, experts in quantized_experts(model, scheme):
        if isinstance(loader := experts.w13.weight_loader, ExpertDequantizer):
            loader.check_complete()
            experts.w13.weight_loader = experts.w2.weight_loader = experts.load_expert
    if isinstance(scheme, W4Scheme):
        w4 = W4LinearMethod(scheme)
        for name, layer in quantized_layers(model, scheme):
            w4.process_weights(layer, name)
        return
    method = Fp8LinearMethod(scheme)
    for _, layer in quantized_layers(model, scheme):
        if layer.weight.dtype != FP8:
            method.quantize_loaded(layer)
        method.process_weights(layer)
