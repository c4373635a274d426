"""The one-row W4A16 GEMV (kernels/w4a16_gemv.py) against the W4 layout's PyTorch reference on random 4-bit weights
(on the CPU through TRITON_INTERPRET=1, fp32 and fp16 activations): with and without zero points, act-order
permutations, biases and groups, partial column tiles, K split evenly and unevenly (the last program to finish
summing the splits, on a caller's counters that it leaves zero), and two rows; and its tile rule at the shapes it
was measured on."""

import pytest
import torch
from w4_layout import random_w4

from nanoserve.kernels.w4a16_gemv import GemvConfig, gemv_config, split_counters, w4a16_gemv
from nanoserve.kernels.w4a16_reference import w4a16_linear_ref

CASES = [
    # m, n, k, group, zeros, perm, bias, (block_n, block_k, split)
    (1, 40, 128, 32, True, False, True, (16, 32, 4)),     # K split in four, a partial column tile
    (1, 72, 96, -1, True, False, False, (32, 128, 2)),    # one group: tiles narrowed to 32, three split 2 + 1
    (1, 48, 256, 64, False, True, True, (16, 64, 1)),     # no zeros (8), act-order, no split
    (2, 24, 128, 128, True, True, False, (16, 32, 3)),    # two rows, four tiles split 2 + 2
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, group, zeros, perm, bias, cfg", CASES)
def test_w4a16_gemv(dtype, m, n, k, group, zeros, perm, bias, cfg, device, gen):
    qweight, scales, z, p = random_w4(n, k, group, zeros, perm, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    args = [t.to(device) if t is not None else None for t in (x, qweight, scales, z, p)]
    b = None if b is None else b.to(device)
    block_n, block_k, split = cfg
    # One tile ahead unsplit (four tiles a program) and split four ways (one tile each), two elsewhere.
    config = GemvConfig(block_n, block_k, split, num_warps=2, ahead=1 if split in (1, 4) else 2)
    got = w4a16_gemv(*args, group, b, config=config)
    want = w4a16_linear_ref(*args, group, b)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_split_counters_are_left_zero(device, gen):
    """At the rule's tiles (K split 8 ways, two column tiles), a split's counters are reset by its last program, so
    a second call on the same buffer (or a CUDA graph's replay) counts from zero and gives the same result."""
    qweight, scales, z, p = random_w4(200, 1024, 32, True, False, gen)
    x = torch.randn(1, 1024, generator=gen).to(device)
    args = (x, qweight.to(device), scales.to(device), z.to(device), None, 32)
    assert gemv_config(200, 1024, 32).split == 8
    counters = split_counters(200, device)
    first = w4a16_gemv(*args, counters=counters)
    assert counters.shape == (2,) and not counters.any()
    second = w4a16_gemv(*args, counters=counters)
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    torch.testing.assert_close(first, w4a16_linear_ref(*args), atol=1e-4, rtol=1e-4)


def test_config_by_shape():
    """Llama-3.1-8B's projections at the splits the H200 measured fastest (qkv, o, gate_up, down); the tiles
    narrowed to the groups; a K of fewer than eight tiles is not split."""
    assert [gemv_config(n, k, 128).split for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))] \
        == [8, 8, 4, 16]
    assert gemv_config(4096, 4096, 128) == GemvConfig(128, 128, 8, 4, 1, 1)
    assert gemv_config(4096, 4096, 32).block_k == 32 and gemv_config(4096, 4096, -1).block_k == 128
    assert gemv_config(4096, 896, 128).split == 1
