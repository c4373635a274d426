"""Which replica (or backend server) a request goes to: cache-aware, least-load or round-robin routing.

Plain code, no I/O: `serve --data-parallel-size N` (runtime/data_parallel.py) routes each request to one of its N
engine processes with it, and `nanoserve router` (router/) to one of its backend servers.

Cache-aware routing (the default) sends a request where its prompt's prefix is most likely cached already. The
router cannot see an engine's prefix cache, so it keeps its own approximation: per backend, a PrefixIndex of the
prompts it sent there, as chained hashes of fixed-size chunks (token ids where the router has them, characters
where it has only text), evicted least recently used. For a request, the match on a backend is the number of leading
chunks of its prompt found in that backend's index. The policy, with its parameters (RoutingConfig):

1. A shared prefix does not count. The policy remembers, over all backends, which chunks different prompts have
   continued differently (`hot_children` distinct next chunks: a system prompt, a few-shot preamble, a shared
   document); the prompt's leading chunks up to its deepest such chunk are its shared prefix. Every backend can
   cache a shared prefix for one prefill, so it must not pull every new conversation to the backend that saw it
   first; only the match beyond it is a reason to follow.
2. Among the backends whose load is within `balance_abs` requests, or `balance_rel` times, of the least loaded
   one (load: requests in flight there, as the caller counts them), take the one with the longest match beyond
   the shared prefix, if that is at least `min_match_chunks` chunks.
3. Otherwise the least loaded backend; ties go round-robin, so a burst of new prefixes spreads over the backends.
4. Either way the prompt's chunks are recorded in the chosen backend's index at once, so the next request with
   the same prefix follows it there even while the first is still prefilling.

Why these numbers (SGLang's router has the same two ideas, a cache threshold and a balance threshold; these are
chosen for nanoserve, where the engine's prefix cache works in blocks of 16 tokens):
- chunk_tokens = 16: the engine's default block size, the unit its prefix cache can reuse; chunk_chars = 64, about
  16 tokens of English text to a BPE tokenizer.
- min_match_chunks = 2 (32 tokens): a shorter match saves less prefill than a step's worth of queueing behind a
  busier replica costs; any longer one (a conversation's history, a document asked about again) is worth following.
- hot_children = 2: a chunk continued two different ways is already shared. Without step 1, bench multi-turn's
  conversations (1,000 shared system tokens, then their own turns; 96 conversations, 16 at a time, DP=4 on 4
  H200s, b26541b) all followed the system prompt to two of the four replicas (the other two got none: 16 in flight
  never put a replica 8 above the least) and hit 0.687 of their prompt tokens in the cache, against 0.846 for one
  replica with the four pools' blocks; a simulation of the same run (the engines' LRU block caches included)
  reproduced 0.718 and 0.847, and with step 1 gives 0.847 with every replica used (also at 4 and 64
  at a time, and over 8 replicas).
- balance_abs = 8, balance_rel = 0.25: continuous batching runs a replica's requests together, so a few more in
  flight cost each of them little until its batch is full, while a hit saves the whole prefix's prefill. A
  replica more than 8 requests and 25 % above the least loaded is skipped: one hot prefix (every request sharing
  a system prompt) then still spreads over the replicas instead of queueing on one, and each of them caches it.
- max_chunks = 65,536 per backend (~6 MB of index): about what a large GPU's KV pool holds (an 8B model on an
  80 GB GPU keeps ~50k blocks of 16 tokens); remembering more than the engine can still have cached only makes the
  router follow prefixes that were evicted there long ago.
"""

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from nanoserve.config import ROUTING_POLICIES

POLICIES = ROUTING_POLICIES


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "cache_aware"
    chunk_tokens: int = 16
    chunk_chars: int = 64
    min_match_chunks: int = 2
    balance_abs: int = 8
    balance_rel: float = 0.25
    max_chunks: int = 65_536
    hot_children: int = 2

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("chunk_tokens", "chunk_chars", "min_match_chunks", "max_chunks", "hot_children"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.balance_abs < 0 or self.balance_rel < 0:
            raise ValueError(f"balance_abs, balance_rel: must be >= 0, got {self.balance_abs}, {self.balance_rel}")


def prefix_hashes(prompt: str | Sequence[int], config: RoutingConfig) -> list[int]:
    """The chained hashes of the prompt's full chunks: hash i names chunk i and everything before it, so equal
    hashes mean equal prefixes (up to collisions, which only misroute). A partial last chunk is left out, as the
    engine caches only full blocks. Token ids and text hash differently: a backend is routed by one kind only."""
    if isinstance(prompt, str):
        data, size = prompt.encode("utf-8", "surrogatepass"), config.chunk_chars
        # Characters, not bytes, make a chunk; encoded once, cut by character offsets (ASCII fast path).
        if len(data) != len(prompt):
            return _chain(
                [prompt[i : i + size].encode("utf-8", "surrogatepass") for i in range(0, len(prompt) - size + 1, size)]
            )
        return _chain([data[i : i + size] for i in range(0, len(data) - size + 1, size)])
    size = config.chunk_tokens
    data = array("q", prompt).tobytes()
    step = size * 8
    return _chain([data[i : i + step] for i in range(0, len(data) - step + 1, step)])


def _chain(chunks: list[bytes]) -> list[int]:
    hashes, prev = [], 0
    for chunk in chunks:
        prev = xxhash.xxh3_64_intdigest(chunk, prev)
        hashes.append(prev)
    return hashes


class PrefixIndex:
    """One backend's chunk hashes, least recently used first, at most `max_chunks` of them."""

    def __init__(self, max_chunks: int) -> None:
        self.max_chunks = max_chunks
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: list[int]) -> int:
        """How many leading chunks of a prompt with these hashes are here."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        """Record a prompt sent here (its chunks become the most recently used), evicting the oldest past the
        bound. A prompt longer than the bound keeps its last max_chunks chunks, which alone never match (a match
        starts at chunk 0): such a prompt is beyond what the index can help with."""
        lru = self._lru
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.max_chunks:
            lru.popitem(last=False)


class RoutingPolicy:
    """Picks a backend for each request. Backends are named by any hashable key (a replica's index, a URL)."""

    def __init__(self, config: RoutingConfig | None = None, backends: Sequence[Hashable] = ()) -> None:
        self.config = config or RoutingConfig()
        self._indexes: dict[Hashable, PrefixIndex] = {}
        self._turn = 0  # round-robin position, over the candidates of each call
        # Over all backends, least recently used first, at most max_chunks each: the chunks seen, and how many
        # distinct next chunks each has had.
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._children: OrderedDict[int, int] = OrderedDict()
        for key in backends:
            self.add_backend(key)

    @property
    def backends(self) -> list[Hashable]:
        return list(self._indexes)

    def add_backend(self, key: Hashable) -> None:
        self._indexes.setdefault(key, PrefixIndex(self.config.max_chunks))

    def remove_backend(self, key: Hashable) -> None:
        """Forget a backend and what it cached (one that comes back starts cold)."""
        self._indexes.pop(key, None)

    def match(self, key: Hashable, hashes: list[int]) -> int:
        """The leading chunks of a prompt with these hashes that backend `key` has seen (for tests and logs)."""
        return self._indexes[key].match(hashes)

    def choose(self, prompt: str | Sequence[int] | None, loads: Mapping[Hashable, int]) -> Hashable:
        """The backend for one request, among those in `loads` (the healthy ones, with their requests in flight),
        each of which must have been added; records the prompt there. `prompt` None: a request without one to
        route by (it goes by load). Raises ValueError if `loads` is empty."""
        if not loads:
            raise ValueError("backends: none is available")
        candidates = list(loads)
        policy = self.config.policy
        if policy == "round_robin":
            key = candidates[self._turn % len(candidates)]
            self._turn += 1
            return key
        hashes = prefix_hashes(prompt, self.config) if prompt is not None and policy == "cache_aware" else []
        key = self._by_prefix(hashes, loads, self.shared_prefix(hashes)) if hashes else None
        if key is None:
            key = self._least_loaded(candidates, loads)
        if hashes:
            self._indexes[key].insert(hashes)
            self._record(hashes)
        return key

    def shared_prefix(self, hashes: list[int]) -> int:
        """How many leading chunks of a prompt with these hashes other prompts share (up to its deepest chunk that
        has been continued `hot_children` different ways)."""
        shared = 0
        for i, h in enumerate(hashes[:-1]):
            if h not in self._seen:
                break
            if self._children.get(h, 0) >= self.config.hot_children:
                shared = i + 1
        return shared

    def _record(self, hashes: list[int]) -> None:
        seen, children, bound = self._seen, self._children, self.config.max_chunks
        for i, h in enumerate(hashes):
            if h in seen:
                seen.move_to_end(h)
                if h in children:  # a hot chunk stays counted while prompts still pass through it
                    children.move_to_end(h)
                continue
            seen[h] = None
            if i:
                parent = hashes[i - 1]
                children[parent] = children.pop(parent, 0) + 1
        for lru in (seen, children):
            while len(lru) > bound:
                lru.popitem(last=False)

    def _by_prefix(self, hashes: list[int], loads: Mapping[Hashable, int], shared: int) -> Hashable | None:
        c = self.config
        least = min(loads.values())
        limit = max(least + c.balance_abs, least * (1 + c.balance_rel))
        best, best_match = None, c.min_match_chunks - 1
        for key, load in loads.items():
            if load > limit:
                continue
            matched = self._indexes[key].match(hashes) - shared
            # The longer match wins; on equal matches, the lighter load.
            if matched > best_match or (matched == best_match and best is not None and load < loads[best]):
                best, best_match = key, matched
        return best

    def _least_loaded(self, candidates: list[Hashable], loads: Mapping[Hashable, int]) -> Hashable:
        least = min(loads.values())
        tied = [key for key in candidates if loads[key] == least]
        key = tied[self._turn % len(tied)]
        self._turn += 1
        return key
