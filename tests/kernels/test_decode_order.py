"""The longest-first dispatch order of decode attention against torch.sort's stable descending order."""

import pytest
import torch

from nanoserve.kernels.decode_order import longest_first_order, longest_first_order_ref


@pytest.mark.parametrize("n", [1, 5, 64, 65, 200, 256])
@pytest.mark.parametrize("out_dtype", [torch.int64, torch.int32])
def test_matches_stable_descending_sort(device, gen, n, out_dtype):
    # Few distinct lengths, so most have ties; zeros stand for a CUDA graph's padding rows.
    seq_lens = torch.randint(0, 6, (n,), generator=gen, dtype=torch.int32) * 100
    seq_lens[n // 2:] = torch.randint(0, 3000, (n - n // 2,), generator=gen, dtype=torch.int32)
    seq_lens = seq_lens.to(device)
    out = torch.full((n,), -7, dtype=out_dtype, device=device)
    got = longest_first_order(seq_lens, out)
    assert got is out
    want = longest_first_order_ref(seq_lens, torch.empty(n, dtype=out_dtype, device=device))
    assert torch.equal(got, want)
    assert torch.equal(torch.sort(got).values.long().cpu(), torch.arange(n))  # a permutation


def test_rejects_a_float_output(device):
    with pytest.raises(AssertionError, match="int32 or int64"):
        longest_first_order(torch.zeros(4, dtype=torch.int32, device=device), torch.zeros(4, device=device))
