"""CpuTier: the bookkeeping of the KV blocks kept in CPU memory under the GPU prefix cache (--kv-offload-gb).

When the GPU pool evicts a cached prefix block to reuse it, the block's KV is copied to a CPU block first and stays
named by its hash here, least recently used evicted first. A later prompt whose prefix runs on past the GPU's
cached blocks finds the next ones here, and they are copied back into fresh GPU blocks before the step that reads
them. So a preempted request, whose freed full blocks are evicted to the CPU as others need room, comes back with
its blocks loaded rather than recomputed: one mechanism for the prefix tier and for swapping on preemption.

Long-context mode (a sequence longer than the GPU pool) takes its blocks from the same pool: a block it holds is out
of the LRU order, never evicted, until the sequence releases it.

Only ids live here; the copies themselves are the model runner's (worker/kv_offload.py), which the block manager
asks for through the step's kv_swap_out / kv_swap_in lists.
"""

from collections import OrderedDict


class CpuTier:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.cached: dict[int, int] = {}  # block hash -> CPU block id
        self.hashes: list[int | None] = [None] * num_blocks
        self.token_bytes: list[bytes] = [b""] * num_blocks  # to check a hit token by token, as on the GPU
        # Every block, least recently used first: free ones (never filled) lead, then cached ones by last use.
        self.lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.held = 0  # blocks held by long-context sequences
        self.allocated = 0  # blocks given to long-context sequences, in all
        self.stored = 0  # blocks copied here from the GPU
        self.loaded = 0  # blocks copied back
        # Blocks this step copies back to the GPU: not to be overwritten by a copy from the GPU in the same step
        # (the step's copies to the CPU run before its copies back, worker/kv_offload.py).
        self.reading: set[int] = set()

    @property
    def num_used(self) -> int:
        return len(self.cached) + self.held

    @property
    def num_available(self) -> int:
        """Blocks that allocate() can give: free ones, and cached ones it may evict."""
        return len(self.lru) - len(self.reading)

    def allocate(self) -> int:
        """A block for a long-context sequence, held until release(); the caller checked num_available."""
        block_id = next(b for b in self.lru if b not in self.reading)
        del self.lru[block_id]
        old = self.hashes[block_id]
        if old is not None:
            del self.cached[old]
            self.hashes[block_id] = None
            self.token_bytes[block_id] = b""
        self.held += 1
        self.allocated += 1
        return block_id

    def release(self, block_id: int) -> None:
        self.lru[block_id] = None
        self.lru.move_to_end(block_id, last=False)  # empty: the first to be used again
        self.held -= 1

    def lookup(self, block_hash: int, token_bytes: bytes) -> int | None:
        """The CPU block holding these tokens, if any."""
        block_id = self.cached.get(block_hash)
        if block_id is None or self.token_bytes[block_id] != token_bytes:
            return None
        return block_id

    def read(self, block_id: int) -> None:
        """This step copies the block back to the GPU."""
        self.loaded += 1
        self.lru.move_to_end(block_id)
        self.reading.add(block_id)

    def store(self, block_hash: int, token_bytes: bytes) -> int | None:
        """A CPU block for an evicted GPU block's KV (the least recently used one, evicted here in turn); None
        when this block is here already."""
        if block_hash in self.cached:
            self.lru.move_to_end(self.cached[block_hash])
            return None
        block_id = next((b for b in self.lru if b not in self.reading), None)
        if block_id is None:  # every block is being read back this step: this one is lost, as without a tier
            return None
        del self.lru[block_id]
        old = self.hashes[block_id]
        if old is not None:
            del self.cached[old]
        self.hashes[block_id] = block_hash
        self.token_bytes[block_id] = token_bytes
        self.cached[block_hash] = block_id
        self.lru[block_id] = None
        self.stored += 1
        return block_id
