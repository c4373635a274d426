"""BlockGrid: the KV pool at a glance, small enough to send many times a second (the web page's block grid).

A pool can hold 100k+ blocks, so the grid has at most MAX_CELLS cells: block i of n is in cell i * cells // n (a
run of about n / cells consecutive ids), and a cell holds how many of its blocks are in each state. Block ids in
order, since the free queue hands out the lowest ids first on a fresh pool: the grid fills from its top left.

States of a block of the GPU pool (BlockManager):
- free: in the free queue, holding nothing;
- used: held by running sequences, not in the prefix cache (a block still filling, or caching off);
- prefix: held by running sequences and in the prefix cache (a full block a later prompt can share);
- cached: in the prefix cache and held by nobody: parked in the free queue, reused on a hit until evicted.
A block of the CPU tier (--kv-offload-gb) is free, or cpu: holding an evicted prefix block's KV.

Cost: a few numpy passes over the pool plus reading the free queue and the cache map, about 2 ms for 100k blocks
on one core (most of it turning those two into arrays); the engine computes it only while someone watches, and
at most a few times a second (step_view.py).
"""

from dataclasses import dataclass

import numpy as np

from nanoserve.engine.block_manager import BlockManager

GPU_STATES = ("free", "used", "prefix", "cached")
CPU_STATES = ("free", "cpu")
MAX_CELLS = 1024
_MAX_PER_CELL = (1 << 16) - 1  # counts travel as uint16


@dataclass(frozen=True)
class BlockGrid:
    """One pool's cells: `counts` holds, cell after cell, one uint16 count per state (bytes: cheap to pickle
    across the engine process's pipe every step, and to compare)."""

    states: tuple[str, ...]
    num_blocks: int
    counts: bytes

    @property
    def num_cells(self) -> int:
        return len(self.counts) // (2 * len(self.states))

    def array(self) -> np.ndarray:
        """counts[cell, state]."""
        return np.frombuffer(self.counts, "<u2").reshape(-1, len(self.states))

    def per_state(self) -> dict[str, list[int]]:
        """{state: [its count in each cell]}."""
        return dict(zip(self.states, self.array().T.tolist(), strict=True))

    def totals(self) -> dict[str, int]:
        """Blocks in each state over the whole pool."""
        return dict(zip(self.states, self.array().sum(axis=0, dtype=np.int64).tolist(), strict=True))


def grid_of(state: np.ndarray, states: tuple[str, ...], max_cells: int = MAX_CELLS) -> BlockGrid:
    """The grid of a pool whose block i is in state states[state[i]]."""
    n = len(state)
    if n == 0:
        return BlockGrid(states, 0, b"")
    # More cells than max_cells only where a cell would overflow uint16: a pool of over 67M blocks.
    num_cells = max(min(n, max_cells), -(-n // _MAX_PER_CELL))
    cell = np.arange(n, dtype=np.int64) * num_cells // n
    counts = np.bincount(cell * len(states) + state, minlength=num_cells * len(states))
    return BlockGrid(states, n, counts.astype("<u2").tobytes())


def gpu_grid(bm: BlockManager, max_cells: int = MAX_CELLS) -> BlockGrid:
    n = bm.num_blocks
    free = np.zeros(n, dtype=bool)
    free[np.fromiter(bm.free, dtype=np.intp, count=len(bm.free))] = True
    # Every block with a hash is in the cache map (and the map names no other block).
    hashed = np.zeros(n, dtype=bool)
    hashed[np.fromiter(bm.cached.values(), dtype=np.intp, count=len(bm.cached))] = True
    state = np.where(free, np.where(hashed, 3, 0), np.where(hashed, 2, 1))  # GPU_STATES' indices
    return grid_of(state, GPU_STATES, max_cells)


def cpu_grid(bm: BlockManager, max_cells: int = MAX_CELLS) -> BlockGrid | None:
    """The CPU tier's grid, or None without one."""
    tier = bm.cpu
    if tier is None:
        return None
    state = np.zeros(tier.num_blocks, dtype=np.int64)
    state[np.fromiter(tier.cached.values(), dtype=np.intp, count=len(tier.cached))] = 1
    return grid_of(state, CPU_STATES, max_cells)
