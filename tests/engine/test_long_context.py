"""Long-context mode (--kv-offload-gb): a request longer than the GPU KV pool runs with its older blocks in the CPU
pool, streamed back layer by layer and merged by log-sum-exp, and gives the tokens of a run whose pool holds it."""

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.request import Request, Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
POOL = dict(num_kv_blocks=6, block_size=16)  # 96 tokens of GPU KV


def _prompt(n: int, seed: int = 3) -> list[int]:
    return torch.randint(2, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_prompt_four_times_the_gpu_pool_gives_the_same_tokens(checkpoints, arch):
    path = str(checkpoints[arch])
    prompt = _prompt(400)
    reference = _tokens(LLM(path, num_kv_blocks=64, block_size=16), [prompt])
    llm = LLM(path, kv_offload_gb=0.01, **POOL)
    assert _tokens(llm, [prompt]) == reference
    cpu = llm.engine.block_manager.cpu
    assert cpu.allocated >= 400 // 16 - POOL["num_kv_blocks"] and cpu.held == 0  # used, then given back


def test_long_context_beside_short_requests_and_without_prefix_caching(checkpoints, monkeypatch):
    """A long request shares its steps with short ones; a short one may wait for room, nothing changes their tokens.
    Ring slots of two blocks: the older keys come back in several chunks, through both slots in turn."""
    from nanoserve.worker import kv_ring

    monkeypatch.setattr(kv_ring, "RING_SLOT_TOKENS", 32)
    path = str(checkpoints["llama"])
    prompts = [_prompt(20, 1), _prompt(300, 2), _prompt(35, 4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = _tokens(LLM(path, num_kv_blocks=64, block_size=16), prompts, params)
    for caching in (True, False):
        llm = LLM(path, kv_offload_gb=0.01, enable_prefix_caching=caching, **POOL)
        assert _tokens(llm, prompts, params) == reference
        assert llm.engine.block_manager.cpu.allocated > 0


def test_long_context_under_tensor_parallelism(checkpoints):
    """The long-context rows travel with the step to rank 1, which streams its own heads' blocks."""
    path = str(checkpoints["llama"])
    prompt = _prompt(300)
    reference = _tokens(LLM(path, num_kv_blocks=64, block_size=16), [prompt])
    llm = LLM(path, kv_offload_gb=0.01, tensor_parallel_size=2, **POOL)
    try:
        assert _tokens(llm, [prompt]) == reference
    finally:
        llm.shutdown()


def test_without_a_cpu_pool_the_prompt_is_refused(checkpoints):
    llm = LLM(str(checkpoints["llama"]), **POOL)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([_prompt(400)], GREEDY, use_tqdm=False)


def test_n_above_one_is_refused_in_long_context_mode(checkpoints):
    llm = LLM(str(checkpoints["llama"]), kv_offload_gb=0.01, **POOL)
    with pytest.raises(ValueError, match="^n: a request longer than the GPU KV pool"):
        llm.generate([_prompt(400)], SamplingParams(n=2, max_tokens=4), use_tqdm=False)


def test_block_moves_follow_the_next_token():
    """Blocks wholly before the next token move to CPU blocks the sequence holds; the chunk is what the GPU allows."""
    bm = BlockManager(4, 4, enable_prefix_caching=True, num_cpu_blocks=10)
    tokens = list(range(1, 31))
    seq = Sequence(Request("r", None, tokens, SamplingParams(max_tokens=1), max_tokens=1), 0, tokens, 30, None)
    assert bm.needs_long_context(seq)
    seq.cpu_blocks = []
    assert bm.long_context_room(seq) == 16  # the whole pool
    bm.allocate(seq, 16)
    seq.num_computed_tokens = 16
    assert bm.take_swaps() == ([], []) and len(seq.block_table) == 4
    # Next token 16: blocks 0-3 move, and the pool is free again.
    assert bm.long_context_room(seq) == 16
    window = list(seq.block_table)
    bm.allocate(seq, 14)
    out, _ = bm.take_swaps()
    assert [g for g, _ in out] == window and [c for _, c in out] == seq.cpu_blocks and len(seq.block_table) == 4
    seq.num_computed_tokens = 30
    # Next token 30 sits in block 7: blocks 4-6 move; room is block 7's two free slots and the pool's 3 blocks.
    assert bm.long_context_room(seq) == 2 + 3 * 4
    bm.free_seq(seq)
    assert bm.num_free_blocks == 4 and bm.cpu.held == 0 and seq.cpu_blocks is None


def test_a_request_that_outgrows_the_gpu_pool_goes_on_in_long_context_mode(checkpoints):
    """80 prompt tokens and 40 more generated through a 96-token pool: at the pool's end it is preempted and comes back
    in long-context mode, with the tokens of a big pool (and so does the short request beside it)."""
    path = str(checkpoints["llama"])
    prompts = [_prompt(80, 5), _prompt(8, 6)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    reference = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=64, block_size=16).generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(path, kv_offload_gb=0.01, **POOL)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    assert llm.engine.scheduler.num_preemptions >= 1 and llm.engine.block_manager.cpu.allocated > 0


def test_released_cpu_blocks_come_back_in_order():
    """A sequence's CPU blocks, released, are handed to the next one in ascending order: one copy per run."""
    bm = BlockManager(2, 4, enable_prefix_caching=False, num_cpu_blocks=8)
    ids = [bm.cpu.allocate() for _ in range(5)]
    seq = Sequence(Request("r", None, [1], SamplingParams(max_tokens=1), max_tokens=1), 0, [1], 1, None)
    seq.cpu_blocks = ids
    bm.free_seq(seq)
    assert [bm.cpu.allocate() for _ in range(5)] == sorted(ids)


def test_long_context_rows_pack_and_unpack():
    """What rank 0 sends the other ranks of a step's long-context rows comes back whole, row by row."""
    from nanoserve.worker.step_inputs import LongContextRow

    rows = [LongContextRow(0, 1, 300, [7, 8, 9], [2]), LongContextRow(1, 64, 1000, [], [4, 5, 6, 1])]
    assert LongContextRow.unpack_all([v for row in rows for v in row.pack()]) == rows


def test_a_preempted_long_context_request_is_swapped_out_and_resumes(checkpoints):
    """Two short requests that grow fill the 96-token pool; the long one, last to arrive, is the one preempted: its GPU
    blocks join its CPU blocks and it resumes where it was, with the tokens of a big pool."""
    path = str(checkpoints["llama"])
    prompts = [_prompt(30, 7), _prompt(30, 8), _prompt(300, 9)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = _tokens(LLM(path, num_kv_blocks=64, block_size=16), prompts, params)
    llm = LLM(path, kv_offload_gb=0.01, **POOL)
    assert _tokens(llm, prompts, params) == reference
    scheduler, cpu = llm.engine.scheduler, llm.engine.block_manager.cpu
    assert scheduler.num_swapped > 0 and cpu.held == 0
