"""BlockManager: the KV pool's pages, with reference counts and automatic prefix caching.

A full block is named by a hash chained over every token before it (xxhash), so two requests with
the same first k*block_size tokens share k physical blocks. Blocks whose last user finished stay in
the hash map, parked in a free queue, and are evicted least-recently-freed first; with a CPU tier
(engine/cpu_tier.py) an evicted block's KV goes to CPU memory, where a later prefix match finds it.

A sequence that can never fit the GPU pool runs in long-context mode on the same CPU pool: its blocks before the one
its next tokens start in move to CPU blocks it holds (Sequence.cpu_blocks), and attention streams them back layer by
layer (worker/kv_ring.py). Its blocks are not offered to the prefix cache.
"""

import struct
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from nanoserve.engine.cpu_tier import CpuTier
from nanoserve.engine.local_blocks import LocalBlocks
from nanoserve.engine.request import Sequence


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_bytes: bytes = b""  # its tokens (token_bytes()), kept to check a hash hit token by token


def token_bytes(token_ids: list[int]) -> bytes:
    """Tokens as int64 little-endian bytes, what block hashes and hit checks read."""
    # struct packs a list of Python ints about twice as fast as numpy converts it (17 vs 37 us for 2,096).
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


@dataclass
class Prefix:
    """A prompt's cached leading blocks: on the GPU, then the ones after them in the CPU tier."""

    gpu: list[int]
    cpu: list[int]
    local: list[int] = field(default_factory=list)  # the window pool's table for the gpu blocks (LocalBlocks)

    def __len__(self) -> int:
        return len(self.gpu) + len(self.cpu)


NO_PREFIX = Prefix([], [])


def chain_hash(prev_hash: int, block_bytes: bytes) -> int:
    """The hash of a block: its tokens' bytes, seeded with the previous block's hash (0 for the first)."""
    return xxhash.xxh3_64_intdigest(block_bytes, prev_hash)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_cpu_blocks: int = 0,
                 cpu_prefix_tier: bool = True, local: LocalBlocks | None = None) -> None:
        """cpu_prefix_tier: whether evicted prefix blocks go to the CPU pool (else it serves long context only);
        local: the sliding-window layers' pool, if they have their own."""
        assert local is None or not num_cpu_blocks, "the CPU tier is single-pool only"
        self.local = local
        self.block_size = block_size
        self.block_bytes = block_size * 8  # a block's tokens as token_bytes() gives them (int64 each)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = 0  # of which found there (on the GPU or in the CPU tier)
        self.cpu_prefix_hits = 0  # of which in the CPU tier
        self.cpu = CpuTier(num_cpu_blocks) if num_cpu_blocks else None
        self.cpu_prefix_tier = cpu_prefix_tier and enable_prefix_caching
        # KV copies the next step makes before its forward pass: (GPU block, CPU block) to the CPU tier, then
        # (CPU block, GPU block) back (take_swaps).
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """The share of the pool in use; with a window pool, of the fuller pool (the one that preempts first)."""
        usage = 1.0 - len(self.free) / len(self.blocks)
        if self.local is not None:
            usage = max(usage, 1.0 - self.local.num_free_blocks / (self.local.num_blocks - 1))
        return usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------
    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The KV copies to and from the CPU tier that this step's allocations asked for; a new step starts."""
        out, back = self.swap_out, self.swap_in
        self.swap_out, self.swap_in = [], []
        if self.cpu is not None:
            self.cpu.reading.clear()
        return out, back

    def take_local_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs of the window pool that this step's allocations asked for."""
        return self.local.take_copies() if self.local is not None else []

    def match_prefix(self, seq: Sequence) -> Prefix:
        """The blocks holding this sequence's longest cached prefix; its last token is always left
        out, since the forward pass must compute at least one token to sample from."""
        # prompt_logprobs need every prompt position computed, so such requests skip the cache.
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return NO_PREFIX
        num_full = (seq.num_tokens - 1) // self.block_size
        # One conversion for hashing and checking: for a long prompt it costs about what the hashing does.
        data = token_bytes(seq.token_ids[:num_full * self.block_size])
        self._extend_hashes(seq, num_full, data)
        hits = []
        for h in seq.block_hashes[:num_full]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        # The hits' tokens checked in one comparison; only a mismatch (a hash collision) is found block by block.
        width = self.block_bytes
        cached = b"".join([self.blocks[b].token_bytes for b in hits])
        collided = cached != data[:len(cached)]
        if collided:
            hits = next(hits[:i] for i in range(len(hits))
                        if cached[i * width:(i + 1) * width] != data[i * width:(i + 1) * width])
        if self.local is not None:
            usable, local = self.local.usable_hit(seq.block_hashes, len(hits))
            return Prefix(hits[:usable], [], local)
        if collided:
            return Prefix(hits, [])
        cpu_hits = []
        if self.cpu is not None and self.cpu_prefix_tier:
            # The prefix may go on in the CPU tier, which the engine keeps only for models where loading a block
            # beats recomputing it (worker/kv_cache.py's prefix_load_pays: Llama-3.1-8B yes, Qwen3-0.6B no, as
            # measured on an H100); there a hit is always loaded, which also spends none of the step's token budget.
            for i in range(len(hits), num_full):
                block_id = self.cpu.lookup(seq.block_hashes[i], data[i * width:(i + 1) * width])
                if block_id is None:
                    break
                cpu_hits.append(block_id)
        return Prefix(hits, cpu_hits)

    def _extend_hashes(self, seq: Sequence, num_full: int, data: bytes | None = None, first: int = 0) -> None:
        """Hash blocks up to num_full; data: token_bytes of blocks first..num_full-1, if at hand."""
        start = len(seq.block_hashes)
        if start >= num_full:
            return
        bs, width = self.block_size, self.block_bytes
        # One conversion for every new block: for a long prompt, converting block by block cost more
        # than the hashing.
        if data is None:
            data = token_bytes(seq.token_ids[start * bs:num_full * bs])
        else:
            assert first <= start, "data must cover every block still to hash"
            data = data[(start - first) * width:(num_full - first) * width]
        prev = seq.block_hashes[-1] if start else 0
        for j in range(0, len(data), width):
            prev = chain_hash(prev, data[j:j + width])
            seq.block_hashes.append(prev)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks that this step filled, so later requests can share them."""
        if not self.enable_prefix_caching or seq.cpu_blocks is not None:
            return
        # Pending tokens (async scheduling) are computed but not yet known, so they cannot be hashed.
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        start, bs, width = seq.num_cached_blocks, self.block_size, self.block_bytes
        data = token_bytes(seq.token_ids[start * bs:num_full * bs])
        # One conversion serves the hashes still missing (blocks of generated tokens) and the tokens kept below.
        self._extend_hashes(seq, num_full, data, start)
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            # Skip a block that is cached already, or whose twin (same tokens, filled by another
            # request in the same step) is: the cache keeps one copy.
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                block.token_bytes = data[(i - start) * width:(i - start + 1) * width]
                self.cached[h] = block.block_id
        if self.local is not None:
            self.local.cache_blocks(seq, start, num_full)
        seq.num_cached_blocks = num_full

    # -- allocation -----------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: Prefix = NO_PREFIX) -> bool:
        if seq.cpu_blocks is not None:
            return num_new_tokens <= self.long_context_room(seq)
        if self.local is not None and \
                self.local.num_new_blocks(seq, num_new_tokens, prefix.local) > self.local.num_free_blocks:
            return False
        return self._num_new_blocks(seq, num_new_tokens, prefix) <= len(self.free)

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, prefix: Prefix) -> int:
        if num_new_tokens == 1 and seq.block_table:  # a decode step: the common case, kept cheap
            computed = seq.num_computed_tokens
            if computed % self.block_size == 0:
                return 1
            return int(self.blocks[seq.block_table[computed // self.block_size]].ref_count > 1)
        table = seq.block_table or prefix.gpu
        computed = seq.num_computed_tokens or len(prefix) * self.block_size
        # A CPU-tier hit is not in the table yet: it takes a fresh block to be loaded into.
        needed = self.blocks_needed(computed + num_new_tokens) - len(table)
        # A cached block parked in the free queue is taken out of it by a hit.
        parked = [self.blocks[b].ref_count for b in prefix.gpu].count(0) if not seq.block_table else 0
        # A shared block about to be written is copied first (copy-on-write).
        first, last = computed // self.block_size, (computed + num_new_tokens - 1) // self.block_size
        cow = sum(1 for i in range(first, min(last + 1, len(table))) if self.blocks[table[i]].ref_count > 1)
        return max(needed, 0) + parked + cow

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: Prefix = NO_PREFIX) -> list[tuple[int, int]]:
        """Give `seq` room for `num_new_tokens` more tokens; returns (src, dst) block copies to do
        before the forward pass. The caller has checked can_allocate."""
        if seq.cpu_blocks is not None:
            self._allocate_long_context(seq, num_new_tokens)
            return []
        first_admission = seq.request.metrics.first_scheduled_time is None
        if not seq.block_table and self.enable_prefix_caching and first_admission:
            # Counted when the request is first admitted, not at each look-up while it waits for room, nor when a
            # prompt preempted in its prefill comes back (its own blocks would count as hits).
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(prefix) * self.block_size
            self.cpu_prefix_hits += len(prefix.cpu) * self.block_size
        if not seq.block_table and prefix:
            for block_id in prefix.gpu:
                block = self.blocks[block_id]
                if block.ref_count == 0:  # parked in the free queue
                    del self.free[block_id]
                block.ref_count += 1
            seq.block_table = list(prefix.gpu)
            for cpu_id in prefix.cpu:  # before any fresh block is taken: that may store evicted blocks in the tier
                self.cpu.read(cpu_id)
            for i, cpu_id in enumerate(prefix.cpu, start=len(prefix.gpu)):
                block = self._take_fresh()
                block.block_hash, block.token_bytes = seq.block_hashes[i], self.cpu.token_bytes[cpu_id]
                self.cached[block.block_hash] = block.block_id
                self.swap_in.append((cpu_id, block.block_id))
                seq.block_table.append(block.block_id)
            seq.num_computed_tokens = len(prefix) * self.block_size
            seq.num_cached_blocks = len(prefix)  # in the cache already: cache_full_blocks starts after them
        copies = []
        computed = seq.num_computed_tokens
        first, last = computed // self.block_size, (computed + num_new_tokens - 1) // self.block_size
        for i in range(first, min(last + 1, len(seq.block_table))):
            old = self.blocks[seq.block_table[i]]
            if old.ref_count > 1:
                new = self._take_fresh()
                old.ref_count -= 1
                seq.block_table[i] = new.block_id
                copies.append((old.block_id, new.block_id))
        while len(seq.block_table) < self.blocks_needed(computed + num_new_tokens):
            seq.block_table.append(self._take_fresh().block_id)
        if self.local is not None:
            self.local.allocate(seq, num_new_tokens, prefix.local)
        return copies

    def append_slot(self, seq: Sequence) -> bool:
        """The decode fast path: room for one more token when that needs no copy-on-write and no
        preemption (False: nothing changed, take can_allocate/allocate)."""
        if self.local is not None and not self.local.append_slot(seq):
            return False
        table = seq.block_table
        i = seq.num_computed_tokens // self.block_size
        if i < len(table):
            return self.blocks[table[i]].ref_count == 1
        if i > len(table) or not self.free:
            return False
        table.append(self._take_fresh().block_id)
        return True

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's known tokens: after a speculative verify step, those that held only
        rejected drafts' slots. Unnamed and unshared, they go first in the free queue, ahead of cached blocks."""
        keep = self.blocks_needed(len(seq.token_ids))
        if self.local is not None:
            self.local.trim(seq, keep)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.block_hash is None, "a lookahead block is the sequence's own"
            block.ref_count = 0
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)

    def _take_fresh(self) -> Block:
        block = self.blocks[self.free.popitem(last=False)[0]]
        if block.block_hash is not None:  # evict: the least recently freed cached block goes first
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
                if self.cpu_prefix_tier and self.cpu is not None and \
                        (cpu_id := self.cpu.store(block.block_hash, block.token_bytes)) is not None:
                    self.swap_out.append((block.block_id, cpu_id))
            block.block_hash = None
            block.token_bytes = b""
        block.ref_count = 1
        return block

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; writes later copy the shared tail block."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        if self.local is not None:
            self.local.fork(parent, child)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks

    # -- long-context mode --------------------------------------------------------------------------------------
    def needs_long_context(self, seq: Sequence) -> bool:
        """Whether the sequence and its next token need more blocks than the GPU pool has (and a CPU pool can help).
        One that outgrows the pool while it decodes is preempted, and comes back in this mode (recomputed)."""
        return self.cpu is not None and self.exceeds_gpu_pool(seq.num_tokens + 1)

    def exceeds_gpu_pool(self, num_tokens: int) -> bool:
        """Whether num_tokens need more blocks than the whole GPU pool has."""
        return self.blocks_needed(num_tokens) > len(self.blocks)

    def _to_move(self, seq: Sequence) -> int:
        """GPU blocks of a long-context sequence wholly before its next token: they move to the CPU."""
        return max(0, seq.num_computed_tokens // self.block_size - len(seq.cpu_blocks))

    def long_context_room(self, seq: Sequence) -> int:
        """How many new tokens a long-context sequence can take now: the GPU blocks it holds from its next token
        on, the free ones and those it gives up by moving its older blocks to the CPU (as far as the CPU has room)."""
        move = self._to_move(seq)
        if move > self.cpu.num_available:
            return 0
        # Its GPU blocks from the next token's on, the free ones, and the `move` older ones that moving frees: all it
        # holds on the GPU, and the free ones.
        blocks = len(seq.block_table) + len(self.free)
        return max(0, blocks * self.block_size - seq.num_computed_tokens % self.block_size)

    def swap_out_long_context(self, seq: Sequence) -> bool:
        """Preempt a long-context sequence by moving its GPU blocks to the CPU pool beside its older ones, so that it
        resumes where it was instead of recomputing its whole context. False (nothing changed) when it is not in
        long-context mode or the CPU pool lacks room: the caller frees it."""
        if seq.cpu_blocks is None or len(seq.block_table) > self.cpu.num_available:
            return False
        for device_id in seq.block_table:
            self._move_to_cpu(seq, device_id)
        seq.block_table = []
        return True

    def _move_to_cpu(self, seq: Sequence, device_id: int) -> None:
        """A long-context sequence's GPU block joins its CPU blocks (copied before this step's forward pass reuses
        the GPU block) and the GPU block is free."""
        cpu_id = self.cpu.allocate()
        self.swap_out.append((device_id, cpu_id))
        seq.cpu_blocks.append(cpu_id)
        self.blocks[device_id].ref_count = 0
        self.free[device_id] = None

    def _allocate_long_context(self, seq: Sequence, num_new_tokens: int) -> None:
        current = seq.num_computed_tokens // self.block_size
        if len(seq.cpu_blocks) > current:  # resumed after swap_out_long_context: its partial last block comes back
            back = seq.cpu_blocks[current:]
            del seq.cpu_blocks[current:]
            for cpu_id in back:
                block = self._take_fresh()  # first: it may store an evicted prefix block in the CPU tier
                self.swap_in.append((cpu_id, block.block_id))
                seq.block_table.append(block.block_id)
                self.cpu.release(cpu_id)
                self.cpu.reading.add(cpu_id)  # not overwritten by this step's copies to the CPU
        for _ in range(self._to_move(seq)):
            device_id = seq.block_table.pop(0)
            assert self.blocks[device_id].ref_count == 1, "a long-context sequence shares no block"
            self._move_to_cpu(seq, device_id)
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        while len(seq.cpu_blocks) + len(seq.block_table) < needed:
            seq.block_table.append(self._take_fresh().block_id)

    def free_seq(self, seq: Sequence) -> None:
        # Reversed, so a prompt's tail blocks are evicted before its head blocks, which more
        # requests share.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        if self.local is not None:
            self.local.free_seq(seq)
        for cpu_id in reversed(seq.cpu_blocks or ()):  # each to the front: the next holder gets them in order
            self.cpu.release(cpu_id)
        seq.cpu_blocks = None
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
