"""The symmetric-memory all-reduce's choices, on the CPU (its sums are checked against NCCL's on 2 GPUs:
tests/gpu/test_allreduce_gpu.py): which messages it takes, that the layers' one call site routes to it or to
torch.distributed, and why it is not used where it cannot be."""

import torch
import torch.distributed as dist

from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.distributed.symm_all_reduce import ONE_SHOT_MAX_BYTES, SymmAllReduce, unavailable_reason


class Recording(SymmAllReduce):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def symm() -> Recording:
    return Recording("0", (torch.empty(0), torch.empty(0)), ONE_SHOT_MAX_BYTES, copy_in_op=True)


def test_it_takes_small_contiguous_bf16_and_fp32_messages_only():
    s = symm()
    assert s.fits(torch.zeros(4, 1024, dtype=torch.bfloat16))  # 8 KB: a batch-1 decode of a 4096-wide model
    assert s.fits(torch.zeros(ONE_SHOT_MAX_BYTES // 4, dtype=torch.float32))
    assert not s.fits(torch.zeros(ONE_SHOT_MAX_BYTES // 2 + 8, dtype=torch.bfloat16))  # over the threshold: NCCL
    assert not s.fits(torch.zeros(8, 64, dtype=torch.float16))  # the op has no fp16 kernel
    assert not s.fits(torch.zeros(64, 8, dtype=torch.bfloat16).t())  # not contiguous
    assert not s.fits(torch.zeros(7, dtype=torch.float32))  # 28 bytes: not whole 16-byte vectors
    assert not s.fits(torch.zeros(9, dtype=torch.float32)[1:5])  # not 16-byte aligned


def test_the_layers_call_site_routes_by_size(monkeypatch):
    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: reduced.append(x.nbytes))
    tp = TensorParallelGroup(0, 2, symm=symm())
    small, large = torch.ones(4, 1024, dtype=torch.bfloat16), torch.ones(1024, 1024, dtype=torch.bfloat16)
    assert tp.all_reduce(small) is small and tp.symm.calls == 1 and not reduced
    assert tp.all_reduce(large) is large and tp.symm.calls == 1 and reduced == [large.nbytes]
    one = TensorParallelGroup()  # one rank: nothing to reduce, nothing called
    assert one.all_reduce(small) is small and reduced == [large.nbytes]


def test_reasons_it_is_not_used():
    assert unavailable_reason(torch.device("cpu"), 2, 1) == "not on CUDA"
    assert unavailable_reason(torch.device("cuda", 0), 2, 2) == "ranks on several nodes"
