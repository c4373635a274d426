"""Quantized weights: which scheme a checkpoint (or --quantization) asks for, and how a model's linear layers hold
and run it.

The package spans layers, so the layers below do not import it: config.py asks `detect.detect_quantization` for the
scheme (EngineConfig.quantization), the loader calls `model.prepare_model` before it fills the weights and
`model.finish_model` after, and each quantized layers.linear.Linear then carries a `quant_method` (a
layers.linear.LinearMethod) that its forward calls instead of the plain GEMM.

- scheme.py: FP8Scheme, what runs (weight and activation scale granularity), and the shapes it needs;
- detect.py: config.json's quantization_config and the engine flag -> FP8Scheme, W4Scheme or MXFP4Scheme, refusing
  what cannot run;
- fp8_math.py: the schemes' arithmetic in PyTorch (the CPU path, the kernels' reference, the tests' writer);
- fp8_linear.py: Fp8LinearMethod, a layer's parameters, their loaders and its forward (CPU, CUDA);
- w4_scheme.py, w4_detect.py: W4Scheme (4-bit weights, 16-bit activations) and the GPTQ / AWQ / compressed-tensors
  pack-quantized configs that give one;
- w4_formats.py, w4_packing.py: each 4-bit format's tensors, and the one layout they are all repacked into;
- w4_linear.py: W4LinearMethod, a layer's 4-bit parameters, their loaders and its forward;
- model.py: which layers are quantized (the scheme's ignore list) and the loader's two hooks;
- moe_experts.py: the routed experts of FP8 and 4-bit mixture-of-experts checkpoints: on CUDA FP8 ones kept in FP8
  and 4-bit ones packed (kernels/w4_experts.py's layout) for the MoE kernels' weight-only variants (activations not
  quantized); act-order 4-bit ones, and all on the CPU, dequantized while loading;
- mxfp4.py: MXFP4Scheme, gpt-oss's experts (kept packed on CUDA for the MXFP4 MoE kernels, dequantized on the CPU).

Left for later (issue 41): kernels for act-order 4-bit experts (moe_experts.py dequantizes them); the MXFP4, FP8 and
W4 expert kernels' tiles are not tuned (fused_moe takes its default tile rule for them).
"""
