"""The CPU tier under the prefix cache (--kv-offload-gb): evicted blocks are copied to CPU memory and back, a hit
there is a hit, and preempted requests come back through it with the tokens of a run that never evicted."""

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.request import Request, Sequence
from nanoserve.worker.kv_offload import KVOffloader, block_runs, by_cpu_block

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def new_seq(tokens: list[int]) -> Sequence:
    request = Request("r", None, tokens, SamplingParams(max_tokens=1), max_tokens=1)
    return Sequence(request, 0, list(tokens), len(tokens), detokenizer=None)


def compute(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and 'compute' the whole prompt, with whatever prefix it hits, and name its full blocks."""
    prefix = bm.match_prefix(seq)
    bm.allocate(seq, seq.num_tokens - len(prefix) * BS, prefix)
    seq.num_computed_tokens = seq.num_tokens
    seq.request.metrics.first_scheduled_time = 0.0
    bm.cache_full_blocks(seq)


def test_evicted_blocks_go_to_the_cpu_tier_and_come_back_on_a_hit():
    bm = BlockManager(4, BS, enable_prefix_caching=True, num_cpu_blocks=8)
    first = new_seq(list(range(1, 14)))  # 3 full blocks and one token
    compute(bm, first)
    gpu_blocks = list(first.block_table[:3])
    bm.free_seq(first)
    assert bm.take_swaps() == ([], [])
    other = new_seq(list(range(100, 116)))  # takes all 4 blocks: the 3 cached ones are evicted to the CPU
    compute(bm, other)
    out, back = bm.take_swaps()
    assert sorted(g for g, _ in out) == sorted(gpu_blocks) and back == []
    assert bm.cpu.num_used == 3 and not bm.cached.keys() & set(first.block_hashes)
    bm.free_seq(other)
    again = new_seq(list(range(1, 14)) + [50])
    prefix = bm.match_prefix(again)
    assert prefix.gpu == [] and sorted(prefix.cpu) == sorted(c for _, c in out)
    queries, hits = bm.prefix_queries, bm.prefix_hits
    compute(bm, again)
    out2, back = bm.take_swaps()
    assert [c for c, _ in back] == prefix.cpu and [g for _, g in back] == again.block_table[:3]
    assert bm.prefix_hits - hits == 12 and bm.cpu_prefix_hits == 12 and bm.prefix_queries - queries == 14
    # other's 4 cached blocks were evicted to make room: to the CPU, not over the blocks being read back.
    assert len(out2) == 4 and not {c for _, c in out2} & set(prefix.cpu)


def test_a_cpu_block_being_read_back_is_not_overwritten_in_the_same_step():
    bm = BlockManager(4, BS, enable_prefix_caching=True, num_cpu_blocks=3)
    first = new_seq(list(range(1, 14)))
    compute(bm, first)
    bm.free_seq(first)
    compute(bm, other := new_seq(list(range(100, 116))))
    bm.take_swaps()
    bm.free_seq(other)
    # The tier holds first's 3 blocks and is full; loading them back evicts other's 4 blocks from the GPU, which
    # may not take the CPU blocks being read: they are dropped instead.
    compute(bm, new_seq(list(range(1, 14)) + [50]))
    out, back = bm.take_swaps()
    assert len(back) == 3 and out == []


def test_offloader_copies_blocks_out_and_back():
    torch.manual_seed(0)
    cache = [(torch.randn(6, BS, 2, 8), torch.randn(6, BS, 2, 8)) for _ in range(3)]
    original = [(k.clone(), v.clone()) for k, v in cache]
    offloader = KVOffloader(cache, num_cpu_blocks=5)
    offloader.swap([(1, 3), (4, 4), (2, 0)], [])
    for k, v in cache:
        k.normal_()
        v.normal_()
    offloader.swap([], [(3, 0), (0, 5), (4, 2)])
    for (k, v), (k0, v0) in zip(cache, original, strict=True):
        assert torch.equal(k[0], k0[1]) and torch.equal(k[5], k0[2]) and torch.equal(k[2], k0[4])
        assert torch.equal(v[0], v0[1]) and torch.equal(v[5], v0[2]) and torch.equal(v[2], v0[4])
    assert block_runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]


def test_blocks_stored_tail_first_load_in_one_run():
    """A sequence's blocks reach the CPU tier tail first, with descending ids: the copies go by CPU block, so its
    prefix comes back in one run (one copy a layer), each block still to its own device block."""
    pairs, runs = by_cpu_block([(7, 10), (6, 11), (5, 12), (4, 13), (1, 20)], cpu=0)  # (cpu, device), coming back
    assert pairs == [(1, 20), (4, 13), (5, 12), (6, 11), (7, 10)]
    assert runs == [(0, 1, 1), (1, 4, 4)]
    pairs, runs = by_cpu_block([(10, 7), (11, 6), (12, 5)], cpu=1)  # (device, cpu) pairs, going out
    assert pairs == [(12, 5), (11, 6), (10, 7)] and runs == [(0, 5, 3)]


def _run(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in (70, 45, 90)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_prefix_evicted_to_the_cpu_and_hit_gives_the_same_tokens(checkpoints, arch):
    path = str(checkpoints[arch])
    first, _, long = _prompts()
    prompts = [first, long, first + [7]]
    reference = [_run(LLM(path, num_kv_blocks=64, block_size=16), [p])[0] for p in prompts]
    # 8 blocks of 16: the 90-token prompt (7 blocks with its output) evicts most of the first one's, to the CPU.
    llm = LLM(path, num_kv_blocks=8, block_size=16, kv_offload_gb=0.01)
    bm = llm.engine.block_manager
    assert [_run(llm, [p])[0] for p in prompts[:2]] == reference[:2]
    assert bm.cpu.stored > 0 and bm.cpu_prefix_hits == 0
    hits = bm.prefix_hits
    again = llm.generate(prompts[2], GREEDY, use_tqdm=False)[0]
    # Its 4 full prompt blocks: the first still on the GPU, the others loaded back from the CPU tier.
    assert again.num_cached_tokens == 64 and bm.prefix_hits - hits == 64 and bm.cpu_prefix_hits == 48
    assert again.outputs[0].token_ids == reference[2]


def test_preempted_requests_come_back_through_the_cpu_tier(checkpoints):
    prompts = _prompts()
    path = str(checkpoints["llama"])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=64, block_size=16).generate(
        prompts, params, use_tqdm=False)]
    # 8 blocks cannot hold the first two prompts as they grow: one is preempted, its freed blocks are evicted to the
    # CPU tier as the others need room, and come back from there rather than being recomputed.
    llm = LLM(path, num_kv_blocks=8, block_size=16, kv_offload_gb=0.01)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.cpu.loaded > 0


def test_kv_offload_gb_is_checked(checkpoints):
    with pytest.raises(ValueError, match="^kv_offload_gb: must be a number >= 0"):
        LLM(str(checkpoints["llama"]), kv_offload_gb=-1)


def test_the_cpu_tier_under_tensor_parallelism(checkpoints):
    """Each rank copies its own heads' blocks; the swaps travel with the step to rank 1."""
    path = str(checkpoints["llama"])
    first, _, long = _prompts()
    prompts = [first, long, first + [7]]
    reference = [_run(LLM(path, num_kv_blocks=64, block_size=16), [p])[0] for p in prompts]
    llm = LLM(path, num_kv_blocks=8, block_size=16, kv_offload_gb=0.01, tensor_parallel_size=2)
    try:
        assert [_run(llm, [p])[0] for p in prompts] == reference
        assert llm.engine.block_manager.cpu.loaded > 0
    finally:
        llm.shutdown()
