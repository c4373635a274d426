"""The fp8 KV cache's two conversions in PyTorch (the references, and the CPU's path): a value goes in as
clamp(x / scale, -448, 448) rounded to float8_e4m3fn, and comes out as that times scale, with one scale per layer
for keys and one for values (EngineArgs.kv_cache_dtype; docs/architecture.md, under quantization/, says where the
scales come from). A cache of any other dtype stores values as they are, and its scales are 1."""

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as a cache of cache_dtype stores it."""
    if cache_dtype != torch.float8_e4m3fn:
        return x.to(cache_dtype)
    # Clamped, since the cast does not saturate: past 448 it would give NaN.
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Stored values x as dtype."""
    if x.dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def kv_scales(cache: torch.Tensor, scale: float) -> float:
    """The scale a kernel applies to what it reads from cache: the layer's for an fp8 cache, else 1."""
    return scale if cache.dtype == torch.float8_e4m3fn else 1.0
