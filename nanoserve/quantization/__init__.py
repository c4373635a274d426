"""Quantized weights: which scheme a checkpoint (or --quantization) asks for, and how a model's linear layers hold
and run it.

The package spans layers, so the layers below do not import it: config.py asks `detect.detect_quantization` for the
scheme (EngineConfig.quantization), the loader calls `model.prepare_model` before it fills the weights and
`model.finish_model` after, and each quantized layers.linear.Linear then carries a `quant_method` (a
layers.linear.LinearMethod) that its forward calls instead of the plain GEMM.

- scheme.py: FP8Scheme, what runs (weight and activation scale granularity), and the shapes it needs;
- detect.py: config.json's quantization_config and the engine flag -> FP8Scheme, refusing what cannot run;
- fp8_math.py: the schemes' arithmetic in PyTorch (the CPU path, the kernels' reference, the tests' writer);
- fp8_linear.py: Fp8LinearMethod, a layer's parameters, their loaders and its forward (CPU, CUDA);
- model.py: which layers are quantized (the scheme's ignore list) and the loader's two hooks.

Left for later (issue 41): 4-bit formats (GPTQ, AWQ, compressed-tensors pack-quantized), MXFP4 experts, quantized
mixture-of-experts layers and the FP8 KV cache.
"""
