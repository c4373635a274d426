"""On a GPU: the Triton kernels with CUDA graphs give the same greedy tokens as the eager PyTorch path,
for 64 mixed-length prompts with prefix-cache hits and preemption (with async scheduling, the default there)."""

import pytest
import torch
from call_counts import count_calls
from checkpoints import write_checkpoint
from prompts import mixed_prompts

from nanoserve import LLM, SamplingParams
from nanoserve.layers.attention import TorchBackend, TritonBackend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def prompts() -> list[list[int]]:
    return mixed_prompts(384, 48, 200)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # head_dim 64: the kernels take 64 and 128.
    return write_checkpoint(tmp_path_factory.mktemp("gpu") / "qwen3", "qwen3", hidden_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=3)


def run(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


def eager_torch(ckpt) -> LLM:
    """The reference engine: eager, PyTorch attention, fp32."""
    llm = LLM(str(ckpt), device="cuda", dtype="float32", enforce_eager=True, num_kv_blocks=4096)
    for layer in llm.engine.runner.attn_layers:
        layer.backend = TorchBackend
    return llm


def test_triton_and_graphs_match_eager_torch(ckpt):
    reference = run(eager_torch(ckpt))
    # A pool of 60 blocks holds a fraction of the batch: preemption must happen; prompts share a prefix.
    fast = LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=60, max_num_batched_tokens=512)
    runner = fast.engine.runner
    assert runner.graphs is not None and runner.prefill_graphs is not None and fast.engine.async_scheduling
    replays = {"decode": 0, "prefill": 0}
    count_calls(runner.graphs, "run", replays, "decode")
    count_calls(runner.prefill_graphs, "run", replays, "prefill")
    assert all(layer.backend is TritonBackend for layer in fast.engine.runner.attn_layers)
    assert run(fast) == reference
    assert fast.engine.scheduler.num_preemptions > 0
    assert fast.engine.block_manager.prefix_hits > 0
    assert replays["decode"] > 0 and replays["prefill"] > 0
    del fast
    # Eager Triton (no graphs): prefill steps get their tile map built on the host once per step.
    eager_triton = LLM(str(ckpt), device="cuda", dtype="float32", enforce_eager=True, num_kv_blocks=60,
                       max_num_batched_tokens=512)
    assert run(eager_triton) == reference


def test_large_decode_graphs_sort_their_sequences(ckpt):
    """160 sequences decode together: their graph sorts them longest first for decode attention's dispatch order
    (step_plan.DECODE_ORDER_MIN_BATCH), and the tokens stay those of the eager PyTorch path."""
    from nanoserve.layers.step_plan import DECODE_ORDER_MIN_BATCH

    g = torch.Generator().manual_seed(1)
    many = [torch.randint(2, 384, (n,), generator=g).tolist() for n in torch.randint(1, 300, (160,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(many, params, use_tqdm=False)]

    reference = tokens(eager_torch(ckpt))
    fast = LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=4096, max_num_seqs=256)
    batches = []
    original = fast.engine.runner.graphs.run
    fast.engine.runner.graphs.run = lambda ids, *a: batches.append(ids.shape[0]) or original(ids, *a)
    assert tokens(fast) == reference
    assert max(batches) >= DECODE_ORDER_MIN_BATCH


def test_bf16_runs_and_mostly_agrees(ckpt):
    # bf16 rounding differs between kernels, so only the first tokens must agree.
    a = LLM(str(ckpt), device="cuda", dtype="bfloat16", num_kv_blocks=2048)
    b = LLM(str(ckpt), device="cuda", dtype="bfloat16", enforce_eager=True, num_kv_blocks=2048)
    for layer in b.engine.runner.attn_layers:
        layer.backend = TorchBackend
    ra, rb = run(a), run(b)
    assert sum(x[0] == y[0] for x, y in zip(ra, rb, strict=True)) >= 60


def test_graph_capture_survives_garbage_collection(ckpt, monkeypatch):
    """Every capture starts with a dead reference cycle holding pinned memory that a copy used, and the collector
    set to run at nearly every allocation: a collection inside the capture would free it there, which broke
    captures in tests that built one engine after another (see cuda_graphs.no_garbage_collection)."""
    import gc

    original_begin = torch.cuda.CUDAGraph.capture_begin
    planted = []

    def begin_with_garbage(self, *args, **kwargs):
        host = torch.empty(1 << 12, pin_memory=True)
        torch.empty(1 << 12, device="cuda").copy_(host, non_blocking=True)
        cycle = {"host": host}
        cycle["self"] = cycle
        del host, cycle  # garbage now; the collector's next run (at the next allocation) would free it
        planted.append(1)
        original_begin(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", begin_with_garbage)
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        llm = LLM(str(ckpt), device="cuda", num_kv_blocks=512)
    finally:
        gc.set_threshold(*threshold)
    assert planted and llm.engine.runner.graphs is not None
    monkeypatch.undo()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
