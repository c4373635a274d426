"""The kernel variants that tests/kernels/sm90_compile.py compiles for sm_90: each a call of a kernel's wrapper (the
function the layers call) with small CPU tensors of the dtypes the engine uses on a GPU (bf16 activations and
caches, int32 tables, int64 positions and slots, fp32 rotary tables and sinks, fp8 weights), and the flags that
select its constexpr branches. What a variant compiles is decided by dtypes, constexprs, launch options and the
divisibility of its runtime ints, not by its sizes, so sizes are as small as the wrappers allow. The costliest
variants come first (the compile pool starts them first).
"""

import torch

from nanoserve.kernels.activation import act_and_mul, act_and_mul_fp8, silu_and_mul
from nanoserve.kernels.chunk_attention import chunk_attention
from nanoserve.kernels.decode_attention import decode_attention
from nanoserve.kernels.decode_order import longest_first_order
from nanoserve.kernels.decode_rope_attention import decode_rope_attention
from nanoserve.kernels.fp8_block_gemm import fp8_block_linear
from nanoserve.kernels.fp8_experts import scale_shape, stacked_scale_shape
from nanoserve.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv
from nanoserve.kernels.fp8_quant import quantize_rows
from nanoserve.kernels.fused_moe import CONFIG_DIR, MoeConfig, fused_moe, fused_moe_with_config
from nanoserve.kernels.gemv import skinny_linear, skinny_norm_linear, skinny_silu_mul_linear
from nanoserve.kernels.kv_store import store_kvcache
from nanoserve.kernels.moe_align import moe_align_block_size
from nanoserve.kernels.moe_gemv import moe_gemv
from nanoserve.kernels.moe_routing import router_topk, topk_softmax
from nanoserve.kernels.prefill.attention import prefill_attention
from nanoserve.kernels.prefill.split_scratch import SplitScratch
from nanoserve.kernels.prefill.tile_map import SPLIT_MAP_COLUMNS
from nanoserve.kernels.qkv_rope_store import qkv_rope_store
from nanoserve.kernels.rms_norm import rms_norm, rms_norm_fp8
from nanoserve.kernels.rotary import apply_rotary
from nanoserve.kernels.sampling import gumbel_max_sample
from nanoserve.kernels.silu_mul_gemv import silu_mul_gemv
from nanoserve.kernels.w4_experts import w4_shapes, weight_block
from nanoserve.kernels.w4a16_gemm import w4a16_linear

BF16, FP32, I32, I64, FP8 = torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.float8_e4m3fn
BLOCK_SIZE = 16  # KV cache block size


class Skip(Exception):
    """A variant that cannot be compiled on this machine, for the reason given."""


def _zeros(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def _cache(heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    return _zeros(8, BLOCK_SIZE, heads, head_dim, dtype=dtype)


def _prefill(dtype: torch.dtype, block_m: int, head_dim: int, splits: bool, window: bool, sinks: bool,
             softcap: bool = False, kv: torch.dtype | None = None):
    """One prefill launch as the engine makes it: a device map (prefill/tile_map.py's columns) and out given. kv: the
    cache's dtype (fp8: kv_cache_dtype fp8), dtype's by default."""
    def call() -> None:
        hq, hkv, tokens = 8, 2, 64
        q = _zeros(tokens, hq, head_dim, dtype=dtype)
        scratch = SplitScratch.allocate(4, hq // (hq // hkv), block_m, head_dim, "cpu") if splits else None
        prefill_attention(q, _cache(hkv, head_dim, kv or dtype), _cache(hkv, head_dim, kv or dtype),
                          torch.tensor([0, tokens], dtype=I32), torch.tensor([tokens], dtype=I32),
                          _zeros(1, 8, dtype=I32), tokens, 0.125, out=torch.empty_like(q),
                          tile_map=_zeros(4, SPLIT_MAP_COLUMNS, dtype=I32),
                          block_m=block_m, split_scratch=scratch, window=128 if window else None,
                          sinks=_zeros(hq, dtype=FP32) if sinks else None, softcap=50.0 if softcap else None,
                          k_scale=0.5, v_scale=0.25)
    return call


def _decode(dtype: torch.dtype, batch: int, head_dim: int, num_splits: int | None, fused: bool, order: bool,
            window: bool, sinks: bool, softcap: bool = False, kv: torch.dtype | None = None):
    """decode_attention: unsplit (num_splits 1), split with the reduce launch, or split and merged in one (fused).
    kv: the cache's dtype, dtype's by default."""
    def call() -> None:
        hq, hkv = 8, 2
        q = _zeros(batch, hq, head_dim, dtype=dtype)
        decode_attention(q, _cache(hkv, head_dim, kv or dtype), _cache(hkv, head_dim, kv or dtype),
                         _zeros(batch, dtype=I32),
                         _zeros(batch, 8, dtype=I32), 0.125, num_splits=num_splits,
                         counters=_zeros(batch * hkv, dtype=I32) if fused else None,
                         order=_zeros(batch, dtype=I64) if order else None, window=128 if window else None,
                         sinks=_zeros(hq, dtype=FP32) if sinks else None, softcap=50.0 if softcap else None,
                         k_scale=0.5, v_scale=0.25)
    return call


def _rope_args(batch: int, hq: int, hkv: int, head_dim: int, norm: bool, dtype: torch.dtype = BF16,
               rotary_dim: int | None = None, kv: torch.dtype | None = None) -> tuple:
    """qkv_rope_store's arguments up to slot_mapping (decode_rope_attention takes the same first); rotary_dim <
    head_dim: partial rotary (the tables' width); kv: the cache's dtype, dtype's by default."""
    weights = (_zeros(head_dim, dtype=dtype), _zeros(head_dim, dtype=dtype)) if norm else (None, None)
    half = (rotary_dim or head_dim) // 2
    return (_zeros(batch, (hq + 2 * hkv) * head_dim, dtype=dtype), hq, hkv, _zeros(batch, dtype=I64),
            _zeros(64, half, dtype=FP32), _zeros(64, half, dtype=FP32), *weights, 1e-6,
            _cache(hkv, head_dim, kv or dtype), _cache(hkv, head_dim, kv or dtype), _zeros(batch, dtype=I64))


def _decode_rope(batch: int, norm: bool, num_splits: int | None, fused: bool, prefetch: bool, window: bool,
                 sinks: bool, gemma: bool = False, head_dim: int = 128, rotary_dim: int | None = None,
                 kv: torch.dtype | None = None):
    """gemma: soft-capped scores and norms scaled by 1 + weight; kv: the cache's dtype, bf16 by default."""
    def call() -> None:
        hq, hkv = 16, 8
        decode_rope_attention(*_rope_args(batch, hq, hkv, head_dim, norm, rotary_dim=rotary_dim, kv=kv),
                              _zeros(batch, dtype=I32), _zeros(batch, 8, dtype=I32), 0.125, num_splits=num_splits,
                              counters=_zeros(batch * hkv, dtype=I32) if fused else None, prefetch=prefetch,
                              window=128 if window else None, sinks=_zeros(hq, dtype=FP32) if sinks else None,
                              softcap=50.0 if gemma else None, norm_offset=1.0 if gemma else 0.0, k_scale=0.5,
                              v_scale=0.25)
    return call


def _chunk(dtype: torch.dtype, rows: int, accumulate: bool, window: bool, softcap: bool = False,
           head_dim: int = 128, kv: torch.dtype | None = None):
    def call() -> None:
        q = _zeros(rows, 8, head_dim, dtype=dtype)
        chunk_attention(q, _cache(2, head_dim, kv or dtype), _cache(2, head_dim, kv or dtype),
                        torch.arange(4, dtype=I32), 64, 0, 64, 0.125, _zeros(rows, 8, head_dim, dtype=FP32),
                        _zeros(rows, 8, dtype=FP32), accumulate, window=128 if window else None,
                        softcap=50.0 if softcap else None, k_scale=0.5, v_scale=0.25)
    return call


def _gemv(m: int, n: int, k: int, dtype: torch.dtype = BF16, bias: bool = False, prologue: str | None = None,
          late_dependents: bool = False, fp8: bool = False):
    """The skinny GEMM (kernels/gemv.py): m, n, k pick its path (CUDA cores or tensor cores) and tiles; fp8: an fp8
    weight with per-row scales."""
    def call() -> None:
        w, b = _zeros(n, k, dtype=FP8 if fp8 else dtype), _zeros(n, dtype=dtype) if bias else None
        scale = _zeros(n, dtype=FP32) if fp8 else None
        if prologue in ("norm", "gemma_norm"):  # Gemma's: 1 + weight
            skinny_norm_linear(_zeros(m, k, dtype=dtype), _zeros(m, k, dtype=dtype), _zeros(k, dtype=dtype), 1e-6,
                               w, b, late_dependents=late_dependents, weight_offset=float(prologue == "gemma_norm"),
                               weight_scale=scale)
        elif prologue in ("silu_mul", "gelu_tanh"):
            skinny_silu_mul_linear(_zeros(m, 2 * k, dtype=dtype), w, b,
                                   activation="silu" if prologue == "silu_mul" else prologue, weight_scale=scale)
        else:
            skinny_linear(_zeros(m, k, dtype=dtype), w, b, weight_scale=scale)
    return call


def _experts(e: int, h: int, i: int, mxfp4: bool, fp8: str | None = None,
             w4: str | None = None) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
    """w13 and w2 in bf16, or (mxfp4) as kernels/mxfp4_unpack.py's bytes with their scales as keywords, or (fp8 "row"
    or "block") as kernels/fp8_experts.py's fp8 values with fp32 scales per row or per 128 x 128 block, or (w4 "row",
    "group" or "group-asym") as kernels/w4_experts.py's int32s with fp32 scales per row or per group of 128 (and
    uint8 zero points)."""
    if w4 is not None:
        group = -1 if w4 == "row" else 128
        (w13_shape, w13_scales), (w2_shape, w2_scales) = w4_shapes(e, 2 * i, h, group), w4_shapes(e, h, i, group)
        scales = dict(w13_scale=_zeros(*w13_scales, dtype=FP32), w2_scale=_zeros(*w2_scales, dtype=FP32),
                      weight_block=weight_block(group))
        if w4 == "group-asym":
            scales.update(w13_zeros=_zeros(*w13_scales, dtype=torch.uint8), w2_zeros=_zeros(*w2_scales,
                                                                                            dtype=torch.uint8))
        return (_zeros(*w13_shape, dtype=I32), _zeros(*w2_shape, dtype=I32)), scales
    if fp8 is not None:
        block = (128, 128) if fp8 == "block" else None
        scales = dict(w13_scale=_zeros(*stacked_scale_shape(e, i, h, block), dtype=FP32),
                      w2_scale=_zeros(*scale_shape(e, h, i, block), dtype=FP32), weight_block=block)
        return (_zeros(e, 2 * i, h, dtype=FP8), _zeros(e, h, i, dtype=FP8)), scales
    if not mxfp4:
        return (_zeros(e, 2 * i, h), _zeros(e, h, i)), {}
    u8 = torch.uint8
    return ((_zeros(e, 2 * i, h // 2, dtype=u8), _zeros(e, h, i // 2, dtype=u8)),
            dict(w13_scale=_zeros(e, 2 * i, h // 32, dtype=u8), w2_scale=_zeros(e, h, i // 32, dtype=u8)))


def _moe(tokens: int, activation: str, bias: bool, config: MoeConfig | None = None, mxfp4: bool = False,
         dtype: torch.dtype = BF16, fp8: str | None = None, w4: str | None = None):
    """fused_moe (its align, gate/up, down and sum launches): by default_config's rule, or with a given config;
    mxfp4: MXFP4 weights, fp8: FP8 weights scaled per "row" or "block", w4: W4 weights as _experts takes them
    (dtype: the activations')."""
    def call() -> None:
        e, h, i, top_k = 8, 256, 256, 2
        weights, scales = _experts(e, h, i, mxfp4, fp8, w4)
        args = (_zeros(tokens, h, dtype=dtype), *weights, _zeros(tokens, top_k, dtype=FP32),
                _zeros(tokens, top_k, dtype=I32))
        biases = dict(w13_bias=_zeros(e, 2 * i, dtype=dtype), w2_bias=_zeros(e, h, dtype=dtype)) if bias else {}
        biases |= scales
        if config is None:
            fused_moe(*args, activation=activation, **biases)
        else:
            fused_moe_with_config(*args, config, activation=activation, **biases)
    return call


def _moe_gemv(tokens: int, top_k: int, hidden: int, inter: int, activation: str, bias: bool, norm: bool = False,
              mxfp4: bool = False, fp8: str | None = None, w4: str | None = None):
    """moe_gemv (gate/up and down GEMVs): dims the tiles divide or not, top_k a power of two or padded to one, with the
    RMSNorm prologue or without; mxfp4: MXFP4 weights, fp8: FP8 weights scaled per "row" or "block", w4: W4 weights
    as _experts takes them."""
    def call() -> None:
        e = 8
        weights, scales = _experts(e, hidden, inter, mxfp4, fp8, w4)
        biases = dict(w13_bias=_zeros(e, 2 * inter), w2_bias=_zeros(e, hidden), **scales) if bias else scales
        moe_gemv(_zeros(tokens, hidden), *weights,
                 _zeros(tokens, top_k, dtype=FP32), _zeros(tokens, top_k, dtype=I32), activation=activation,
                 norm=(_zeros(hidden), 1e-6) if norm else None, **biases)
    return call


def _tuned_moe_configs() -> list[tuple[str, int, MoeConfig]]:
    """Each measured table's (fused_moe_configs/) configs for its least and most tokens, with a token count that
    takes the same alignment path."""
    import json

    picked = []
    for path in sorted(CONFIG_DIR.glob("*.json")):
        table = json.loads(path.read_text())["configs"]
        for m, tokens in ((min(table, key=int), 1), (max(table, key=int), 512)):
            picked.append((f"{path.stem} M={m}", tokens, MoeConfig.from_json(table[m])))
    return picked


def _fp8_linear(m: int, block: tuple[int, int], split: int | None = None):
    def call() -> None:
        n, k = 256, 512
        w = _zeros(n, k, dtype=FP32).to(torch.float8_e4m3fn)
        fp8_block_linear(_zeros(m, k), w, _zeros(-(-n // block[0]), -(-k // block[1]), dtype=FP32), block,
                         _zeros(n), split=split)
    return call


def _w4a16(m: int, n: int, k: int, group: int, zeros: bool, perm: bool, bias: bool):
    """A 4-bit layer as quantization/w4_linear.py holds it: bf16 activations, fp16 scales (GPTQ's and AWQ's),
    uint8 zero points, int32 act-order permutation."""
    def call() -> None:
        groups = 1 if group == -1 else k // group
        w4a16_linear(_zeros(m, k), _zeros(k // 8, n, dtype=I32), _zeros(groups, n, dtype=torch.float16),
                     _zeros(groups, n, dtype=torch.uint8) if zeros else None, _zeros(k, dtype=I32) if perm else None,
                     group, _zeros(n) if bias else None)
    return call


def _sampling() -> None:
    try:
        gumbel_max_sample(_zeros(2, 1000, dtype=FP32), _zeros(2, dtype=FP32), 1234)
    except RuntimeError:
        pass  # the kernel was compiled, not run: the host's gather after it reads uninitialized indices


VARIANTS = [
    ("prefill bf16 BLOCK_M=64 D=128 splits+window+sinks", _prefill(BF16, 64, 128, True, True, True)),
    ("prefill bf16 BLOCK_M=64 D=128 plain", _prefill(BF16, 64, 128, False, False, False)),
    # head_dim 256 (Gemma 2, Gemma 3 1B-12B): the tile rules that keep shared memory in bounds, with Gemma's
    # soft-capping and (1 + w) q/k norms (a few instructions each; at head_dim 128 they compile the same way).
    ("prefill bf16 BLOCK_M=64 D=256 splits+window+softcap", _prefill(BF16, 64, 256, True, True, False, True)),
    ("decode bf16 batch 64 D=256 split+reduce window+softcap", _decode(BF16, 64, 256, 2, False, False, True, False,
                                                                       True)),
    ("decode_rope bf16 D=256 fused gemma norm+softcap window",
     _decode_rope(2, True, 4, True, True, True, False, True, 256)),
    ("chunk_attention bf16 D=256 64-row window+softcap", _chunk(BF16, 64, False, True, True, 256)),
    ("prefill bf16 BLOCK_M=16 D=64 splits+window+sinks", _prefill(BF16, 16, 64, True, True, True)),
    # kv_cache_dtype fp8: the cache's tiles widened to bf16, its scales applied; the store's quantization. (Also
    # compiled once, left out for time: prefill BLOCK_M=64 splits+window+sinks, decode D=256 and batch 64 split+reduce,
    # partial rotary.)
    ("prefill bf16 fp8 KV BLOCK_M=16 D=128 plain", _prefill(BF16, 16, 128, False, False, False, kv=FP8)),
    ("decode bf16 fp8 KV fused order window+sinks", _decode(BF16, 2, 128, 4, True, True, True, True, kv=FP8)),
    ("decode_rope bf16 fp8 KV fused norm", _decode_rope(2, True, 4, True, True, False, False, kv=FP8)),
    ("chunk_attention bf16 fp8 KV 64-row", _chunk(BF16, 64, False, False, kv=FP8)),
    ("qkv_rope_store bf16 fp8 KV norm", lambda: qkv_rope_store(*_rope_args(4, 16, 8, 128, True, kv=FP8),
                                                                k_scale=0.5, v_scale=0.25)),
    ("kv_store bf16 fp8 KV", lambda: store_kvcache(_zeros(4, 2, 128), _zeros(4, 2, 128), _cache(2, 128, FP8),
                                                   _cache(2, 128, FP8), _zeros(4, dtype=I64), 0.5, 0.25)),
    ("prefill fp32 BLOCK_M=16 D=128 splits", _prefill(FP32, 16, 128, True, False, False)),
    # fp32 with the window and sinks on 16-row tiles, as chunk_attention's below: on 64-row ones it alone took a
    # sixth of the compile time (the 64-row tiles are the bf16 variants' above).
    ("prefill fp32 BLOCK_M=16 D=64 window+sinks", _prefill(FP32, 16, 64, False, True, True)),
    ("decode_rope bf16 fused norm window+sinks", _decode_rope(2, True, 4, True, True, True, True)),
    ("decode_rope bf16 split+reduce no prefetch", _decode_rope(2, False, 4, False, False, False, False)),
    ("decode_rope bf16 unsplit", _decode_rope(2, True, 1, False, True, False, False)),
    ("decode_rope bf16 fused partial rotary 96/128",
     _decode_rope(2, False, 4, True, True, False, False, rotary_dim=96)),
    ("decode bf16 fused order window+sinks", _decode(BF16, 2, 128, 4, True, True, True, True)),
    ("decode bf16 split+reduce", _decode(BF16, 2, 128, 4, False, False, False, False)),
    ("decode bf16 batch 64 unsplit (128-key tiles)", _decode(BF16, 64, 128, 1, False, True, False, False)),
    ("decode fp32 D=64 split+reduce window", _decode(FP32, 2, 64, 4, False, False, True, False)),
    ("chunk_attention bf16 16-row accumulate window", _chunk(BF16, 1, True, True)),
    ("chunk_attention bf16 64-row", _chunk(BF16, 64, False, False)),
    # fp32 takes the 16-row tile: its 64-row one alone took longer (15 s) than all the bf16 chunk variants.
    ("chunk_attention fp32 16-row accumulate", _chunk(FP32, 1, True, False)),
    *[(f"fused_moe tuned {name}", _moe(tokens, "silu", False, config))
      for name, tokens, config in _tuned_moe_configs()],
    ("fused_moe bf16 decode rule silu", _moe(4, "silu", False)),
    ("fused_moe bf16 prefill rule swigluoai+bias", _moe(512, "swigluoai", True)),
    ("moe_gemv bf16 top-8 silu", _moe_gemv(2, 8, 512, 256, "silu", False)),
    ("moe_gemv bf16 top-8 silu norm", _moe_gemv(1, 8, 512, 256, "silu", False, norm=True)),
    ("moe_gemv bf16 top-3 ragged swigluoai+bias", _moe_gemv(2, 3, 320, 320, "swigluoai", True)),
    # gpt-oss's MXFP4 experts: unpacked in registers (kernels/mxfp4_unpack.py), at its hidden size in the GEMVs (2880:
    # a masked tail).
    ("fused_moe bf16 MXFP4 decode rule swigluoai+bias", _moe(4, "swigluoai", True, mxfp4=True)),
    ("fused_moe bf16 MXFP4 prefill rule swigluoai+bias", _moe(512, "swigluoai", True, mxfp4=True)),
    # fp32 activations (the GPU engine tests' dtype): the 4-byte tiles must fit in shared memory.
    ("fused_moe fp32 MXFP4 prefill rule swigluoai+bias", _moe(512, "swigluoai", True, mxfp4=True, dtype=FP32)),
    ("moe_gemv bf16 MXFP4 top-4 swigluoai+bias norm", _moe_gemv(1, 4, 2880, 2880, "swigluoai", True, norm=True,
                                                                mxfp4=True)),
    ("moe_gemv bf16 MXFP4 top-4 swigluoai+bias", _moe_gemv(4, 4, 512, 256, "swigluoai", True, mxfp4=True)),
    # FP8 experts (Qwen3-MoE, Qwen2-MoE, Mixtral FP8 checkpoints), weight-only: per-row scales (per-tensor and
    # per-channel checkpoints) and 128 x 128 blocks (Qwen3-FP8), converted in registers.
    ("fused_moe bf16 FP8 block decode rule silu", _moe(4, "silu", False, fp8="block")),
    ("fused_moe bf16 FP8 block prefill rule silu", _moe(512, "silu", False, fp8="block")),
    ("fused_moe bf16 FP8 row prefill rule silu", _moe(512, "silu", False, fp8="row")),
    ("fused_moe fp32 FP8 block prefill rule silu", _moe(512, "silu", False, fp8="block", dtype=FP32)),
    ("moe_gemv bf16 FP8 block top-8 silu norm", _moe_gemv(1, 8, 2048, 768, "silu", False, norm=True, fp8="block")),
    ("moe_gemv bf16 FP8 row top-8 silu", _moe_gemv(2, 8, 512, 256, "silu", False, fp8="row")),
    # 4-bit experts (GPTQ, AWQ, compressed-tensors MoE checkpoints), weight-only: groups of 128 with zero points or
    # without (symmetric) and per row, unpacked in registers; Qwen3-30B-A3B's shapes in the GEMVs (768: whole tiles).
    ("fused_moe bf16 W4 group-asym decode rule silu", _moe(4, "silu", False, w4="group-asym")),
    ("fused_moe bf16 W4 group prefill rule silu", _moe(512, "silu", False, w4="group")),
    ("fused_moe bf16 W4 row prefill rule silu", _moe(512, "silu", False, w4="row")),
    ("fused_moe fp32 W4 group-asym prefill rule silu", _moe(512, "silu", False, w4="group-asym", dtype=FP32)),
    ("moe_gemv bf16 W4 group top-8 silu norm", _moe_gemv(1, 8, 2048, 768, "silu", False, norm=True, w4="group")),
    ("moe_gemv bf16 W4 group-asym top-8 silu", _moe_gemv(2, 8, 512, 256, "silu", False, w4="group-asym")),
    ("moe_gemv bf16 W4 row top-8 silu", _moe_gemv(2, 8, 512, 256, "silu", False, w4="row")),
    ("moe_align 8192 pairs (count/layout/scatter)", lambda: moe_align_block_size(_zeros(4096, 2, dtype=I64), 8, 64)),
    ("gemv bf16 M=1 CUDA cores", _gemv(1, 512, 1024)),
    ("gemv bf16 M=1 CUDA cores K>=3072 bias", _gemv(1, 1024, 3072, bias=True)),
    ("gemv bf16 M=4 tensor cores", _gemv(4, 4096, 512)),
    ("gemv bf16 M=1 norm+residual late dependents", _gemv(1, 512, 1024, prologue="norm", late_dependents=True)),
    ("gemv bf16 M=16 norm+residual tensor cores", _gemv(16, 4096, 1024, prologue="norm")),
    ("gemv bf16 M=1 silu_mul", _gemv(1, 512, 1000, prologue="silu_mul")),
    ("gemv bf16 M=1 gemma norm+residual", _gemv(1, 512, 1024, prologue="gemma_norm")),
    ("gemv bf16 M=1 gelu_tanh_mul", _gemv(1, 512, 1000, prologue="gelu_tanh")),
    ("gemv fp8 weight M=1 CUDA cores bias", _gemv(1, 1024, 3072, bias=True, fp8=True)),
    ("gemv fp8 weight M=1 tensor cores", _gemv(1, 8192, 4096, fp8=True)),
    ("gemv fp8 weight M=4 tensor cores", _gemv(4, 4096, 512, fp8=True)),
    ("gemv fp8 weight M=32 tensor cores", _gemv(32, 1024, 3072, fp8=True)),
    ("gemv fp8 weight M=1 norm+residual late dependents", _gemv(1, 512, 1024, prologue="norm", late_dependents=True,
                                                                fp8=True)),
    ("gemv fp8 weight M=1 silu_mul", _gemv(1, 512, 1000, prologue="silu_mul", fp8=True)),
    ("silu_mul_gemv bf16", lambda: silu_mul_gemv(_zeros(1, 2048), _zeros(512, 1024))),
    ("silu_mul_gemv bf16 gelu_tanh", lambda: silu_mul_gemv(_zeros(1, 2048), _zeros(512, 1024), "gelu_tanh")),
    ("fp8_block_linear M=1 FP8 dot", _fp8_linear(1, (128, 128))),
    ("fp8_block_linear M=1 FP8 dot split K", _fp8_linear(1, (128, 128), split=4)),
    ("fp8_block_linear M=200 FP8 dot", _fp8_linear(200, (128, 128))),
    ("fp8_block_linear M=32 upcast (16-wide K blocks)", _fp8_linear(32, (16, 16))),
    # One row: kernels/w4a16_gemv.py at its rule's tiles.
    ("w4a16 GEMV M=1 K split 8 (o_proj shape) zeros", _w4a16(1, 4096, 4096, 128, True, False, False)),
    ("w4a16 GEMV M=1 K split 4 act-order bias", _w4a16(1, 28672, 4096, 128, False, True, True)),
    ("w4a16 GEMV M=1 one group per row", _w4a16(1, 28672, 1024, -1, False, False, False)),
    ("w4a16 GEMV M=1 unsplit group 32 ragged N act-order bias", _w4a16(1, 1000, 128, 32, True, True, True)),
    ("w4a16 GEMM M=8 split zeros", _w4a16(8, 4096, 4096, 128, True, False, False)),
    ("w4a16 GEMM M=20 ragged N bias", _w4a16(20, 1000, 512, 128, True, False, True)),
    ("w4a16 GEMM M=256 act-order bias group 32", _w4a16(256, 4096, 512, 32, False, True, True)),
    ("fp8 quantize_rows dynamic", lambda: quantize_rows(_zeros(4, 4096))),
    ("fp8 gemv one row", lambda: fp8_gemv(_zeros(1, 4096, dtype=FP8), _zeros(1, 1, dtype=FP32),
                                          _zeros(6144, 4096, dtype=FP8), _zeros(6144, dtype=FP32))),
    ("fp8 gemv bias ragged K", lambda: fp8_gemv(_zeros(3, 3000, dtype=FP8), _zeros(3, 1, dtype=FP32),
                                                _zeros(512, 3000, dtype=FP8), _zeros(512, dtype=FP32),
                                                _zeros(512))),
    ("fp8 gemv split K", lambda: fp8_gemv(_zeros(1, 14336, dtype=FP8), _zeros(1, 1, dtype=FP32),
                                          _zeros(4096, 14336, dtype=FP8), _zeros(4096, dtype=FP32),
                                          config=Fp8GemvConfig(block_n=16, block_k=256, split=4))),
    ("fp8 quantize_rows static", lambda: quantize_rows(_zeros(4, 4096), _zeros(1, dtype=FP32))),
    ("qkv_rope_store bf16 norm", lambda: qkv_rope_store(*_rope_args(4, 16, 8, 128, True))),
    ("qkv_rope_store bf16 D=64", lambda: qkv_rope_store(*_rope_args(4, 4, 1, 64, False))),
    ("qkv_rope_store bf16 gemma norm", lambda: qkv_rope_store(*_rope_args(4, 16, 8, 128, True), norm_offset=1.0)),
    ("qkv_rope_store bf16 partial rotary 96/128",
     lambda: qkv_rope_store(*_rope_args(4, 24, 8, 128, False, rotary_dim=96))),
    ("qkv_rope_store bf16 norm partial rotary 32/64",
     lambda: qkv_rope_store(*_rope_args(4, 4, 1, 64, True, rotary_dim=32))),
    ("rotary bf16", lambda: apply_rotary(_zeros(4, 8, 128), _zeros(4, 2, 128), _zeros(64, 64, dtype=FP32),
                                         _zeros(64, 64, dtype=FP32), _zeros(4, dtype=I64))),
    ("rotary bf16 partial 96/128", lambda: apply_rotary(_zeros(4, 8, 128), _zeros(4, 2, 128),
                                                        _zeros(64, 48, dtype=FP32), _zeros(64, 48, dtype=FP32),
                                                        _zeros(4, dtype=I64))),
    ("kv_store bf16", lambda: store_kvcache(_zeros(4, 2, 128), _zeros(4, 2, 128), _cache(2, 128, BF16),
                                            _cache(2, 128, BF16), _zeros(4, dtype=I64))),
    ("rms_norm bf16 residual", lambda: rms_norm(_zeros(4, 4096), _zeros(4096), 1e-6, _zeros(4, 4096))),
    ("rms_norm bf16 per-head strided", lambda: rms_norm(_zeros(4, 24, 128)[:, :16], _zeros(128), 1e-6)),
    ("rms_norm bf16 residual gemma offset",
     lambda: rms_norm(_zeros(4, 4096), _zeros(4096), 1e-6, _zeros(4, 4096), weight_offset=1.0)),
    # Quantizing their output for an FP8 projection: the dynamic scales' reduction (rms_norm_fp8's static branch, and
    # the GELU and static act_and_mul_fp8, left out for time).
    ("rms_norm_fp8 bf16 residual dynamic", lambda: rms_norm_fp8(_zeros(4, 4096), _zeros(4096), 1e-6, _zeros(4, 4096))),
    ("silu_and_mul_fp8 bf16 dynamic", lambda: act_and_mul_fp8(_zeros(4, 2 * 3000))),
    ("silu_and_mul bf16", lambda: silu_and_mul(_zeros(4, 2 * 3000))),
    ("gelu_tanh_and_mul bf16", lambda: act_and_mul(_zeros(4, 2 * 3000), "gelu_tanh")),
    ("router_topk bf16 residual renormalize", lambda: router_topk(_zeros(1, 2048), _zeros(1, 2048), _zeros(2048), 1e-6,
                                                                  _zeros(128, 2048), None, 8, True,
                                                                  _zeros(1, dtype=I32))),
    ("router_topk bf16 bias ragged", lambda: router_topk(_zeros(1, 2880), None, _zeros(2880), 1e-6, _zeros(32, 2880),
                                                         _zeros(32), 4, True, _zeros(1, dtype=I32))),
    ("topk_softmax renormalize", lambda: topk_softmax(_zeros(4, 128), 8, True)),
    ("topk_softmax", lambda: topk_softmax(_zeros(4, 32, dtype=FP32), 4, False)),
    ("decode_order", lambda: longest_first_order(_zeros(200, dtype=I32), _zeros(200, dtype=I64))),
    ("sampling gumbel_max fp32", _sampling),
]
