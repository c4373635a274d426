"""Run the Triton kernels through the CPU interpreter when there is no GPU.

triton.jit picks interpreter or compiler when a kernel is defined, so TRITON_INTERPRET must be set before
the kernel modules are imported; modules that an earlier-collected test already imported are reloaded
(their public wrappers look kernels up in the module dict, so old references see the new kernels).
"""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # Helpers before the kernels that call them: a kernel binds the jit helpers its module imported.
    for _name in ("pdl", "rope_pair", "prefill.split", "prefill.tile", "kv_store", "prefill.attention", "decode_merge",
                  "decode_split", "decode_launch", "decode_attention", "decode_rope_attention", "qkv_rope_store",
                  "gemv", "silu_mul_gemv", "sampling", "decode_order", "chunk_attention", "moe_align", "mxfp4_unpack",
                  "w4_unpack", "fused_moe", "moe_gemv", "moe_routing", "fp8_quant", "fp8_gemv", "fp8_block_gemm",
                  "w4a16_gemv", "w4a16_gemm"):
        _module = sys.modules.get(f"nanoserve.kernels.{_name}")
        if _module is not None:
            importlib.reload(_module)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    device: str = DEVICE,
    pad_value: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN-poisoned caches holding random K/V for each sequence in shuffled blocks, and the block table.

    Every slot not holding a sequence's key stays NaN, so a kernel reading past seq_len shows up as NaN.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks that no table points at
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_per_seq, default=0) + 1  # one padding column past the longest sequence
    block_tables = torch.full((len(seq_lens), max_blocks), pad_value, dtype=torch.int32)
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        ids, perm = perm[:nb], perm[nb:]
        block_tables[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        for p in range(n):
            kv = torch.randn(2, num_kv_heads, head_dim, generator=generator).to(dtype)
            k_cache[ids[p // block_size], p % block_size] = kv[0].to(device)
            v_cache[ids[p // block_size], p % block_size] = kv[1].to(device)
    return k_cache, v_cache, block_tables.to(device)


def _dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Independent check for the references: one sequence's q [q_len, Hq, D] as the last q_len positions,
    keys gathered slot by slot into contiguous tensors, fp32 SDPA with an explicit causal mask (and sliding window:
    keys after position - window only). With sinks [Hq], the softmax is written out with each head's sink logit as
    an extra column that is dropped after it, as transformers' gpt-oss eager attention does. With softcap, the
    scaled scores become softcap * tanh(score / softcap) before the mask, as transformers' Gemma 2 eager attention."""
    block_size = k_cache.shape[1]
    q_len = q.shape[0]
    slots = [(int(block_table[p // block_size]), p % block_size) for p in range(seq_len)]
    k = torch.stack([k_cache[blk, off] for blk, off in slots]).float()  # [seq_len, Hkv, D]
    v = torch.stack([v_cache[blk, off] for blk, off in slots]).float()
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    qh, kh, vh = q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if sinks is None and softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=mask,
                                                               scale=scale, enable_gqa=True)[0]
        return out.transpose(0, 1)
    group = qh.shape[0] // kh.shape[0]
    kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    logits = qh @ kh.transpose(1, 2) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return (logits.softmax(-1) @ vh).transpose(0, 1)
    logits = torch.cat([logits, sinks.float().to(q.device)[:, None, None].expand(-1, q_len, 1)], dim=-1)
    probs = (logits - logits.max(-1, keepdim=True).values).softmax(-1)[..., :-1]
    return (probs @ vh).transpose(0, 1)


def _fake_graph_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan every step as if it were captured in a CUDA graph (layers/step_plan.py), so that on the CPU the engine
    takes the graphs' kernels (run by the interpreter)."""
    from nanoserve.layers.step_plan import KernelPlanner

    plan = KernelPlanner.plan
    monkeypatch.setattr(KernelPlanner, "plan", lambda self, *a, **kw: plan(self, *a, **{**kw, "graph": True}))


# Helpers are handed out as fixtures (factories) so test modules need not import conftest by name.
@pytest.fixture
def make_paged_kv():
    return _make_paged_kv


@pytest.fixture
def dense_attention():
    return _dense_attention


@pytest.fixture
def fake_graph_capture():
    return _fake_graph_capture


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture
def tol():
    return TOLERANCE
