"""TensorParallelGroup: a rank's place in the tensor-parallel world and the collectives the model needs.

Built on torch.distributed: NCCL moves activations between GPUs (gloo on the CPU), and a second, gloo group
carries the host-side control messages (each step's packed inputs) between the ranks' CPUs, as vLLM's cpu_group
does: NCCL moves only device tensors, and a worker waiting on the host for its next step must not tie up its GPU
stream. With one rank every collective is a no-op, so the single-GPU engine runs the same code at no cost.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # activations: NCCL on CUDA, gloo on the CPU
    cpu_group: dist.ProcessGroup | None = None  # host messages: gloo

    def shard(self, total: int) -> tuple[int, int]:
        """(start, size) of this rank's equal share of `total` rows (config.py checked that it divides)."""
        size = total // self.size
        return self.rank * size, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (a row-parallel layer's partial outputs)."""
        if self.size > 1:
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

    def broadcast_host(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor x on every rank, in place, through the gloo group."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.cpu_group)
        return x

    def all_reduce_min_host(self, value: int) -> int:
        """The smallest of the ranks' `value`s, through the gloo group (e.g. KV blocks that fit on every GPU)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())
