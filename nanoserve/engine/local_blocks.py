"""LocalBlocks: the KV pages of a model's sliding-window layers, a second pool beside BlockManager's.

A query at position p of a layer with window W sees keys p - W + 1 .. p only, so once a sequence's next position to
compute is s, its blocks wholly at or before s - W are never read again by its local layers. This pool holds those
layers' pages; each sequence has a second table (Sequence.local_table) with the same logical indexing as its
block_table, in which a block out of every future query's window is given back and its entry set to NULL_BLOCK.
The null block is zeroed once at start and never written: the kernels may load it for a tile that straddles the
window's start, where zero keys and values give finite scores that the window's mask then removes.

Where some layers are global (Gemma 2/3, gpt-oss), this pool holds the windowed layers' KV beside BlockManager's;
where every layer is windowed (Mistral-7B-v0.1, Phi-3-mini-4k), it holds all of the model's KV, and BlockManager's
blocks are ids only, which number a sequence's blocks and carry the hash chain (worker/kv_cache.py sizes both).

Prefix caching: a full block is named by the same hash chain as the global pool's (BlockManager.match_prefix has
checked the tokens of the global hits), and parked in an LRU free queue when given back, so a recent prefix still
hits. A global hit of k blocks is used only up to the largest k' <= k for which this pool still holds every block a
query at position k' * block_size sees (usable_hit): a hit never reads KV that was not written for that prefix.
"""

from collections import OrderedDict

from nanoserve.engine.request import Sequence

NULL_BLOCK = 0  # a local table's entry for a block out of the window (or never taken): never read unmasked


class LocalBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks: the sliding-window pool needs at least 2 blocks, got {num_blocks}")
        self.block_size, self.window = block_size, window
        self.enable_prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) of this step, for the local layers

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_in_use(self, seq: Sequence) -> int:
        return sum(1 for b in seq.local_table if b != NULL_BLOCK)

    def first_visible(self, position: int) -> int:
        """The first logical block that a query at `position` (or any later one) sees."""
        return max(0, position - self.window + 1) // self.block_size

    def usable_hit(self, hashes: list[int], num_hits: int) -> tuple[int, list[int]]:
        """The longest prefix of num_hits global hits that this pool can serve too, and its local table (NULL_BLOCK
        before the window of the first position after it)."""
        k = num_hits if self.enable_prefix_caching else 0
        while k > 0:
            first = self.first_visible(k * self.block_size)
            ids = [self.cached.get(h) for h in hashes[first:k]]
            if None not in ids:
                return k, [NULL_BLOCK] * first + ids
            # Block first + j is missing: no hit reaching past it can be served.
            k = first + max(j for j, b in enumerate(ids) if b is None)
        return 0, []

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int, hit: list[int]) -> int:
        """Blocks this pool must give for seq's next num_new_tokens (hit: its usable_hit table on admission)."""
        self.release(seq)
        table = seq.local_table or hit
        computed = seq.num_computed_tokens or len(hit) * self.block_size
        needed = -(-(computed + num_new_tokens) // self.block_size) - len(table)
        needed -= min(needed, max(0, self.first_visible(computed) - len(table)))  # before the window: null entries
        parked = 0 if seq.local_table else sum(1 for b in hit if b != NULL_BLOCK and self.ref_count[b] == 0)
        first, last = computed // self.block_size, (computed + num_new_tokens - 1) // self.block_size
        cow = sum(1 for i in range(first, min(last + 1, len(table))) if self.ref_count[table[i]] > 1)
        return max(needed, 0) + parked + cow

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: list[int]) -> None:
        """Room for seq's next num_new_tokens, after BlockManager.allocate set num_computed_tokens; copy-on-write
        pairs go to self.copies."""
        if not seq.local_table and hit:
            for block_id in hit:
                if block_id != NULL_BLOCK:
                    if self.ref_count[block_id] == 0:
                        del self.free[block_id]
                    self.ref_count[block_id] += 1
            seq.local_table = list(hit)
        self.release(seq)
        table, bs = seq.local_table, self.block_size
        computed = seq.num_computed_tokens
        first, last = computed // bs, (computed + num_new_tokens - 1) // bs
        for i in range(first, min(last + 1, len(table))):
            old = table[i]
            assert old != NULL_BLOCK, "a block written this step is in the window"
            if self.ref_count[old] > 1:
                self.ref_count[old] -= 1
                table[i] = self._take_fresh()
                self.copies.append((old, table[i]))
        first_visible = self.first_visible(computed)
        while len(table) < -(-(computed + num_new_tokens) // bs):
            table.append(NULL_BLOCK if len(table) < first_visible else self._take_fresh())

    def append_slot(self, seq: Sequence) -> bool:
        """The decode fast path (BlockManager.append_slot): False, nothing taken, when it needs more than a fresh
        block."""
        self.release(seq)
        table = seq.local_table
        i = seq.num_computed_tokens // self.block_size
        if i < len(table):
            return self.ref_count[table[i]] == 1
        if i > len(table) or not self.free:
            return False
        table.append(self._take_fresh())
        return True

    def release(self, seq: Sequence) -> None:
        """Give back the blocks no query from seq's next position on can see. Safe at any time: a sequence's
        num_computed_tokens only grows, save when preemption frees it whole or a verify step steps it back to past
        the start it was scheduled at."""
        table = seq.local_table
        i = min(self.first_visible(seq.num_computed_tokens), len(table)) - 1
        # Released entries form a leading run of nulls: walk back from the window's start to it.
        while i >= 0 and table[i] != NULL_BLOCK:
            block_id = table[i]
            table[i] = NULL_BLOCK
            if self.enable_prefix_caching and i < len(seq.block_hashes):
                self._name(block_id, seq.block_hashes[i])  # its KV is written: a later prefix may hit it
            self._unref(block_id)
            i -= 1

    def _name(self, block_id: int, block_hash: int) -> None:
        if self.block_hash[block_id] is None and block_hash not in self.cached:
            self.block_hash[block_id] = block_hash
            self.cached[block_hash] = block_id

    def _unref(self, block_id: int) -> None:
        self.ref_count[block_id] -= 1
        assert self.ref_count[block_id] >= 0
        if self.ref_count[block_id] == 0:
            self.free[block_id] = None
            if self.block_hash[block_id] is None:  # nothing to hit: reused before cached blocks
                self.free.move_to_end(block_id, last=False)

    def _take_fresh(self) -> int:
        block_id = self.free.popitem(last=False)[0]
        h = self.block_hash[block_id]
        if h is not None:  # evict the least recently freed cached block
            if self.cached.get(h) == block_id:
                del self.cached[h]
            self.block_hash[block_id] = None
        self.ref_count[block_id] = 1
        return block_id

    def cache_blocks(self, seq: Sequence, start: int, num_full: int) -> None:
        """Name seq's full blocks start .. num_full - 1 still in its table (BlockManager.cache_full_blocks)."""
        table = seq.local_table
        for i in range(start, min(num_full, len(table))):
            if table[i] != NULL_BLOCK:
                self._name(table[i], seq.block_hashes[i])

    def trim(self, seq: Sequence, keep: int) -> None:
        """Give back the table's entries past `keep` (a verify step's rejected lookahead blocks)."""
        while len(seq.local_table) > keep:
            block_id = seq.local_table.pop()
            if block_id != NULL_BLOCK:
                assert self.ref_count[block_id] == 1 and self.block_hash[block_id] is None
                self._unref(block_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for block_id in parent.local_table:
            if block_id != NULL_BLOCK:
                self.ref_count[block_id] += 1
        child.local_table = list(parent.local_table)

    def free_seq(self, seq: Sequence) -> None:
        for block_id in reversed(seq.local_table):
            if block_id != NULL_BLOCK:
                self._unref(block_id)
        seq.local_table = []

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies
