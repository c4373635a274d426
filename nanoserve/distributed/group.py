"""TensorParallelGroup: a rank's place in the tensor-parallel world and the collectives the model needs.

Built on torch.distributed: NCCL moves activations between GPUs (gloo on the CPU), and a second, gloo group
carries the host-side control messages (each step's packed inputs) between the ranks' CPUs, as vLLM's cpu_group
does: NCCL moves only device tensors, and a worker waiting on the host for its next step must not tie up its GPU
stream. With one rank every collective is a no-op, so the single-GPU engine runs the same code at no cost.

Rank 0's per-step messages (send_host / recv_host) reach the other ranks of its node through a ring in shared memory
(distributed/shm_broadcast.py) when it could be made, and the ranks of other nodes through gloo: a gloo broadcast is
two rounds of TCP through the kernel on the host's critical path, every step.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from nanoserve.distributed.shm_broadcast import ShmBroadcast
from nanoserve.distributed.symm_all_reduce import SymmAllReduce


@dataclass
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # activations: NCCL on CUDA, gloo on the CPU
    cpu_group: dist.ProcessGroup | None = None  # host messages: gloo
    # Rank 0's per-step messages: the shared-memory ring of its node (rank 0 writes, the node's other ranks read),
    # and gloo for the ranks that do not read the ring (other nodes; all of them when there is no ring).
    host_ring: ShmBroadcast | None = None
    host_group: dist.ProcessGroup | None = None  # None: no rank takes them through gloo
    # GPUs with peer access: small all-reduces over symmetric memory (distributed/symm_all_reduce.py), NCCL above.
    symm: SymmAllReduce | None = None

    def shard(self, total: int) -> tuple[int, int]:
        """(start, size) of this rank's equal share of `total` rows (config.py checked that it divides)."""
        size = total // self.size
        return self.rank * size, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (a row-parallel layer's partial outputs)."""
        if self.size > 1:
            if self.symm is not None and self.symm.fits(x):
                return self.symm.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n] on every rank -> [rows, size * n], rank r's columns at r * n (a vocab-parallel LM head's
        logits). Every rank gets them, so that the call is the same collective on all ranks; only rank 0 samples."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place, through the activations group (device tensors on CUDA)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def send_host(self, message: np.ndarray) -> None:
        """Rank 0: an int64 array to every other rank (recv_host there)."""
        if self.host_ring is not None:
            self.host_ring.write(message)
        if self.host_group is not None:
            dist.broadcast(torch.tensor([len(message)], dtype=torch.int64), src=0, group=self.host_group)
            dist.broadcast(torch.from_numpy(message), src=0, group=self.host_group)

    def recv_host(self) -> np.ndarray:
        """A rank other than 0: rank 0's next send_host array."""
        if self.host_ring is not None:
            message = self.host_ring.read()
            if message is None:
                raise RuntimeError("rank 0 closed the step ring")
            return np.frombuffer(message, np.int64)
        length = torch.empty(1, dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.host_group)
        message = torch.empty(int(length), dtype=torch.int64)
        dist.broadcast(message, src=0, group=self.host_group)
        return message.numpy()

    def all_reduce_min_host(self, value: int) -> int:
        """The smallest of the ranks' `value`s, through the gloo group (e.g. KV blocks that fit on every GPU)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())
