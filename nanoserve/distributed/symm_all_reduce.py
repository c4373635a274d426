"""SymmAllReduce: the small all-reduces of tensor parallelism over peer-to-peer device buffers.

A decode step all-reduces a few KB to a few hundred KB twice a layer. NCCL's ring pays several microseconds of
protocol for each (2 x H200: 9.7 us for 8 KB inside a CUDA graph, 41 us eager); a one-shot all-reduce over
symmetric memory has each GPU read every peer's buffer through NVLink and sum it itself, after one barrier
(6.7 us in a graph, 13.8 us eager). PyTorch ships it (torch.distributed._symmetric_memory; the op
torch.ops.symm_mem.one_shot_all_reduce_copy_out, or _out after a copy where torch lacks that). It needs peer access
between the GPUs, not NVLink multicast, which the lent machines keep off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1): the multimem ops are not used here, so those settings hold.

Past a size each GPU reading every peer's whole buffer costs more than it saves; there a two-shot all-reduce
(torch.ops.symm_mem.two_shot_all_reduce_: each GPU sums its 1/N of the peers' buffers, then writes its sums to
every peer, also over peer access alone) takes over, up to TWO_SHOT_MAX_BYTES; above, NCCL's bandwidth wins and the
caller uses it. Microseconds per bf16 all-reduce in a CUDA graph, 4 x H200 (NVLink, multicast off, torch 2.11,
c6bbeb4; NCCL / one-shot / two-shot):

    256 KB 15.5 / 11.3 / 11.6    1 MB 21.6 / 19.1 / 15.7    2 MB 30.7 / 30.3 / 21.8
    8 MB   64.2 / 97.0 / 59.9    16 MB 95.6 / 189 / 107

At 4 ranks one-shot stops at 256 KB; two ranks each read one peer only, and one-shot beat NCCL to 1 MB there (2 x
H200, GPU-MACHINE.md); two-shot is not measured at 2 ranks, so they go to NCCL above 1 MB. The batch-256 decode step
of Llama-3.1-8B at TP=4 (2 MB messages) went 6.47 -> 5.66 ms.

Each rank allocates its symmetric buffers once, at start (a collective rendezvous); a call copies the input into
one, runs the op with the input as its output (one-shot; two-shot reduces the buffer in place and copies it back),
and so works in place and inside CUDA graphs (the buffer's address is fixed).
"""

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Measured on 2 x H200 (NV18, torch 2.11; /work/shared/GPU-MACHINE.md): one-shot beats NCCL up to 1 MB, eager and
# in a CUDA graph (1 MB: 13.3 vs 16.6 us in a graph); above, each GPU reading every peer's whole buffer loses to
# NCCL's ring.
ONE_SHOT_MAX_BYTES = 1 << 20  # at two ranks, where two-shot is not used
ONE_SHOT_MAX_BYTES_4 = 256 << 10  # at four ranks and more, with two-shot above
TWO_SHOT_MAX_BYTES = 8 << 20
_DTYPES = (torch.bfloat16, torch.float32)  # the op's kernels


@dataclass
class SymmAllReduce:
    group_name: str
    # Two buffers used in turn: a rank that has finished one all-reduce may start copying into the next one's
    # buffer while a slower peer still reads the previous one (the op's closing barrier makes this moot in the
    # versions that have it; the second buffer keeps it safe in those that do not).
    buffers: tuple[torch.Tensor, torch.Tensor]
    max_bytes: int  # the buffers' size: two-shot up to it, where torch has it
    copy_in_op: bool  # torch has one_shot_all_reduce_copy_out
    one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES
    calls: int = 0

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.dtype in _DTYPES
            and x.is_contiguous()
            and x.nbytes <= self.max_bytes
            and x.nbytes % 16 == 0
            and x.data_ptr() % 16 == 0
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (a tensor that fits())."""
        buffer = self.buffers[self.calls % 2]
        self.calls += 1
        flat = x.view(-1)
        symm = buffer.view(x.dtype)[: flat.numel()]
        if x.nbytes > self.one_shot_max_bytes:
            symm.copy_(flat)
            torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", self.group_name)
            flat.copy_(symm)
        elif self.copy_in_op:
            # The op copies the input into the symmetric buffer, meets the peers, then sums their buffers into its
            # output, one kernel. Output and input may be one tensor: each thread copies the elements it later writes.
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(symm, flat, "sum", self.group_name, flat)
        else:  # torch versions without it: the copy is a kernel of its own
            symm.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(symm, "sum", self.group_name, flat)
        return x


def unavailable_reason(device: torch.device, local_devices: int, nnodes: int) -> str | None:
    """Why this rank cannot use SymmAllReduce, or None when it can."""
    if device.type != "cuda":
        return "not on CUDA"
    if nnodes > 1:
        return "ranks on several nodes"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        return f"torch has no symmetric memory ({exc})"
    if not all(hasattr(symm_mem, name) for name in ("empty", "rendezvous")):
        return "torch.distributed._symmetric_memory lacks empty/rendezvous"
    if not any(hasattr(torch.ops.symm_mem, op) for op in ("one_shot_all_reduce_copy_out", "one_shot_all_reduce_out")):
        return "torch lacks torch.ops.symm_mem.one_shot_all_reduce_out"
    for peer in range(local_devices):
        if peer != device.index and not torch.cuda.can_device_access_peer(device.index, peer):
            return f"GPU {device.index} has no peer access to GPU {peer}"
    return None


def connect(
    group: dist.ProcessGroup,
    cpu_group: dist.ProcessGroup,
    device: torch.device,
    local_devices: int,
    nnodes: int,
    disabled: bool = False,
    max_bytes: int | None = None,
) -> SymmAllReduce | None:
    """Every rank of `group` together: a SymmAllReduce if every rank can use one, else None (NCCL for every
    all-reduce), said once, by rank 0, with the reason."""
    reason = "disabled (disable_custom_all_reduce)" if disabled else unavailable_reason(device, local_devices, nnodes)
    # Together: a rank that took the other path would wait in a collective its peers never join.
    ok = torch.tensor([0 if reason else 1], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group)
    rank = dist.get_rank(group)
    if ok.item() == 0:
        if rank == 0:  # a warning unless asked for: it costs batch-1 latency
            log = logger.info if disabled or nnodes > 1 else logger.warning
            log("tensor parallel: NCCL for every all-reduce (%s)", reason or "another rank cannot use symmetric memory")
        return None
    import torch.distributed._symmetric_memory as symm_mem

    # Two-shot where it was measured, four ranks and more; two ranks keep one-shot to 1 MB, then NCCL, as measured.
    two_shot = dist.get_world_size(group) >= 4 and hasattr(torch.ops.symm_mem, "two_shot_all_reduce_")
    if max_bytes is None:
        max_bytes = TWO_SHOT_MAX_BYTES if two_shot else ONE_SHOT_MAX_BYTES
    one_shot = ONE_SHOT_MAX_BYTES_4 if two_shot else max_bytes  # without two-shot, one-shot takes all the buffer holds
    try:
        buffers = tuple(symm_mem.empty(max_bytes, dtype=torch.uint8, device=device) for _ in range(2))
        for buffer in buffers:
            symm_mem.rendezvous(buffer, group.group_name)
    except RuntimeError as exc:  # the peers fail the same way: the rendezvous is collective
        logger.warning("tensor parallel: symmetric memory failed (%s): NCCL for every all-reduce", exc)
        return None
    if rank == 0:
        logger.info(
            "tensor parallel: all-reduces of up to %d KiB through symmetric memory (one-shot up to %d KiB, then "
            "two-shot), NCCL above (NCCL_NVLS_ENABLE=%s, TORCH_SYMM_MEM_DISABLE_MULTICAST=%s)",
            max_bytes >> 10,
            min(max_bytes, one_shot) >> 10,
            os.environ.get("NCCL_NVLS_ENABLE", "unset"),
            os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "unset"),
        )
    return SymmAllReduce(
        group.group_name,
        buffers,
        max_bytes,
        hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"),
        one_shot_max_bytes=min(one_shot, max_bytes),
    )
