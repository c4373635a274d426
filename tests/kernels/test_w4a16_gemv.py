"""The candidate one-row W4A16 GEMVs (kernels/w4a16_gemv.py) against the W4 layout's PyTorch reference on random
4-bit weights (on the CPU through TRITON_INTERPRET=1, fp32 and fp16 activations): with and without zero points,
act-order permutations, biases and groups, partial column tiles, K split evenly and unevenly (the last program to
finish summing the splits), and two rows."""

import pytest
import torch

from nanoserve.kernels import w4a16_gemv as gemv_module
from nanoserve.kernels.w4a16_gemv import VARIANTS, w4a16_gemv
from nanoserve.kernels.w4a16_reference import w4a16_linear_ref


def random_w4(n: int, k: int, group: int, zeros: bool, perm: bool, gen: torch.Generator):
    groups = 1 if group == -1 else k // group
    qweight = torch.randint(-1 << 31, 1 << 31, (k // 8, n), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).half()
    z = torch.randint(0, 17, (groups, n), generator=gen).to(torch.uint8) if zeros else None
    p = torch.randperm(k, generator=gen).to(torch.int32) if perm else None
    return qweight, scales, z, p


CASES = [
    # m, n, k, group, zeros, perm, bias, (block_n, block_k, split)
    (1, 40, 128, 32, True, False, True, (16, 32, 4)),     # K split in four, a partial column tile
    (1, 72, 96, -1, True, False, False, (32, 128, 2)),    # one group: tiles narrowed to 32, three split 2 + 1
    (1, 48, 256, 64, False, True, True, (16, 64, 1)),     # no zeros (8), act-order, no split
    (2, 24, 128, 128, True, True, False, (16, 32, 3)),    # two rows, four tiles split 2 + 2
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, group, zeros, perm, bias, cfg", CASES)
def test_w4a16_gemv(variant, dtype, m, n, k, group, zeros, perm, bias, cfg, device, gen):
    qweight, scales, z, p = random_w4(n, k, group, zeros, perm, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    args = [t.to(device) if t is not None else None for t in (x, qweight, scales, z, p)]
    b = None if b is None else b.to(device)
    block_n, block_k, split = cfg
    # One tile ahead unsplit (four tiles a program) and split four ways (one tile each), two elsewhere.
    got = w4a16_gemv(*args, group, b, variant=variant, block_n=block_n, block_k=block_k, split=split, num_warps=2,
                     ahead=1 if split in (1, 4) else 2)
    want = w4a16_linear_ref(*args, group, b)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_split_counters_are_left_zero(device, gen):
    """A split's counters are reset by its last program, so a second call (or a CUDA graph's replay) counts from
    zero and gives the same result."""
    qweight, scales, z, p = random_w4(32, 128, 32, True, False, gen)
    x = torch.randn(1, 128, generator=gen).to(device)
    args = (x, qweight.to(device), scales.to(device), z.to(device), None, 32)
    first = w4a16_gemv(*args, block_n=16, block_k=32, split=4, num_warps=2)
    assert not gemv_module._counters[torch.device(device)].any()
    second = w4a16_gemv(*args, block_n=16, block_k=32, split=4, num_warps=2)
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    torch.testing.assert_close(first, w4a16_linear_ref(*args), atol=1e-4, rtol=1e-4)


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="variant"):
        w4a16_gemv(torch.randn(1, 64), torch.zeros(8, 16, dtype=torch.int32), torch.ones(1, 16), None, None, -1,
                   variant="half2")
