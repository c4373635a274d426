"""Sampling from raw logits in one pass: argmax(logits / T + Gumbel noise), or argmax(logits) where T = 0.

The Gumbel-max trick draws from softmax(logits / T) without forming the softmax: the torch path of a
temperature-only batch reads and writes the [rows, vocab] fp32 logits about nine times (a float copy,
the division, softmax, the noise, probs / noise, argmax), which at batch 256 and a 152k vocabulary is
~0.6 ms a step on an H200; this kernel reads the bf16 logits once. Each program takes a slice of one row
and writes its best (score, column); the partials are then reduced in torch.

The noise comes from a counter-based integer hash of (key, row, column), not from a torch.Generator, so
a PyTorch reference reproduces it exactly (`gumbel_noise_ref`) and nothing is written to memory.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

_BLOCK_V = 4096
_GOLDEN = 0x9E3779B9


@triton.jit
def _lowbias32(x):
    # Chris Wellons' lowbias32 integer hash: a bijection on uint32 with near-ideal avalanche.
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


# Triton compiles a separate variant for integer arguments equal to 1 or divisible by 16, and types them by value
# (int32, or int64 from 2^31): with a key that changes every step, new variants would compile (~1 s each) in the
# middle of serving. So the key is not specialized, and the caller passes it as a signed 32-bit value.
@triton.jit(do_not_specialize=["key"])
def _gumbel_max_kernel(logits_ptr, temps_ptr, part_val_ptr, part_idx_ptr, stride_row, vocab, num_parts, key,
                       BLOCK_V: tl.constexpr, FAST_LOG: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < vocab
    logits = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=valid, other=-float("inf"))
    logits = logits.to(tl.float32)
    temp = tl.load(temps_ptr + row)
    if temp > 0:
        # 0x9E3779B9 is _GOLDEN (a jit function may read only constexpr globals).
        row_key = _lowbias32((key + row.to(tl.uint32) * 0x9E3779B9).to(tl.uint32))
        bits = _lowbias32(cols.to(tl.uint32) ^ row_key)
        # 24 random bits, centred in their interval: u lies strictly inside (0, 1).
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        # Gumbel noise -log(e) of the exponential draw e = -log(u). The kernel is bound by this math, not by its
        # reads: the inner log stays exact, since the winning columns have u near 1 where e is tiny and a fast
        # log's absolute error (~2^-22) would swamp it (with both logs fast, 13 of 2,048 draws differed from the
        # reference); the outer one is the fast hardware log, off by ~1e-7 in noise of order 1. Measured on an
        # H100 at 256 x 151,936 bf16 logits (probe at 275aa23): 113 -> 80 us, reading alone 34 us.
        exp_draw = -tl.log(u)
        if FAST_LOG:
            noise = -libdevice.fast_logf(exp_draw)
        else:  # the interpreter has no libdevice
            noise = -tl.log(exp_draw)
        scores = logits * (1.0 / temp) + noise
    else:
        scores = logits
    best = tl.max(scores, axis=0)
    # The first column holding the maximum, as torch.argmax picks it.
    idx = tl.min(tl.where(scores == best, cols, vocab), axis=0)
    tl.store(part_val_ptr + row * num_parts + part, best)
    tl.store(part_idx_ptr + row * num_parts + part, idx)


def _as_int32(key: int) -> int:
    """key's low 32 bits as a signed 32-bit int (the kernel uses them as uint32 either way)."""
    key &= 0xFFFFFFFF
    return key - (1 << 32) if key >= 1 << 31 else key


def gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, key: int) -> torch.Tensor:
    """One token per row of logits [rows, vocab] (any float dtype, unit column stride): a draw from
    softmax(logits / T) for rows with T > 0 (temperatures [rows] fp32), the argmax for rows with T = 0.
    `key` (any int) selects the noise; the same key, logits and temperatures give the same tokens."""
    assert logits.dim() == 2 and logits.stride(1) == 1 and temperatures.dtype == torch.float32
    rows, vocab = logits.shape
    num_parts = triton.cdiv(vocab, _BLOCK_V)
    part_val = torch.empty(rows, num_parts, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, num_parts, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_max_kernel[(rows, num_parts)](logits, temperatures, part_val, part_idx, logits.stride(0), vocab,
                                              num_parts, _as_int32(key), BLOCK_V=_BLOCK_V, FAST_LOG=logits.is_cuda,
                                              num_warps=8)
    # argmax takes the first maximum, so ties between parts also go to the lowest column.
    return part_idx.gather(1, part_val.argmax(dim=1, keepdim=True))[:, 0]


def _lowbias32_ref(x: torch.Tensor) -> torch.Tensor:
    """The same hash on int64 tensors holding uint32 values."""
    mask = 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & mask
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & mask
    return x ^ (x >> 16)


def gumbel_noise_ref(rows: int, vocab: int, key: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The kernel's Gumbel noise [rows, vocab] in fp32, computed in PyTorch."""
    mask = 0xFFFFFFFF
    row_ids = torch.arange(rows, dtype=torch.int64, device=device)
    row_key = _lowbias32_ref(((key & mask) + row_ids * _GOLDEN) & mask)
    bits = _lowbias32_ref(torch.arange(vocab, dtype=torch.int64, device=device)[None, :] ^ row_key[:, None])
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(u))


def gumbel_max_sample_ref(logits: torch.Tensor, temperatures: torch.Tensor, key: int) -> torch.Tensor:
    noise = gumbel_noise_ref(logits.shape[0], logits.shape[1], key, logits.device)
    x = logits.float()
    t = temperatures[:, None]
    scores = torch.where(t > 0, x * (1 / t.clamp_min(1e-30)) + noise, x)
    return scores.argmax(dim=1)
