"""Mixture-of-experts models split over two gloo ranks on the CPU: every expert sliced (tensor parallel) or whole
experts per rank (expert parallel) generate what one rank does, through chunked prefill, prefix hits, preemption
and seeded n > 1 sampling; each rank's loader reads only its experts' share of the checkpoint."""


import pytest
import torch
from safetensors import safe_open
from safetensors_reads import RecordingFile

import nanoserve.model.loader as loader_module
from nanoserve import LLM, EngineArgs, SamplingParams
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.model.loader import load_model

VOCAB = 384
# Chunked prefill (32-token steps) and 10 blocks of 16: one long sequence fits, several don't (preemption).
SMALL_ENGINE = dict(max_num_batched_tokens=32, num_kv_blocks=10, block_size=16)


# On 2 cores, ranks each running torch's default thread count oversubscribe them (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompts() -> list[list[int]]:
    system = random_ids(48, seed=1)  # three blocks shared by the first three prompts
    return [system + random_ids(n, seed=10 + n) for n in (5, 21, 2)] + [random_ids(n, seed=100 + n)
                                                                         for n in (3, 60)]


def generate(llm: LLM) -> tuple[list, int, int]:
    """(token ids of a greedy run and a seeded n=2 run, preemptions, prefix-hit tokens)."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    seeded = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts(), greedy, use_tqdm=False) + llm.generate(prompts()[:3], seeded, use_tqdm=False)
    engine = llm.engine
    return ([[c.token_ids for c in o.outputs] for o in outs], engine.scheduler.num_preemptions,
            engine.block_manager.prefix_hits)


@pytest.mark.parametrize("arch, expert_parallel", [("qwen3_moe", False), ("qwen3_moe", True),
                                                   ("qwen2_moe", True), ("mixtral", False), ("gpt_oss", False),
                                                   ("gpt_oss", True)])
def test_two_ranks_equal_one(checkpoints, arch, expert_parallel):
    d = str(checkpoints[arch])
    want, _, _ = generate(LLM(d, **SMALL_ENGINE))
    llm = LLM(d, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **SMALL_ENGINE)
    try:
        experts = llm.engine.runner.model.model.layers[0].mlp.experts
        num_experts, inter = {"mixtral": (4, 64)}.get(arch, (8, 32))
        if expert_parallel:  # rank 0: the first half of the experts, whole
            assert (experts.expert_start, experts.w13.shape[0], experts.w2.shape[2]) == (0, num_experts // 2, inter)
        else:  # every expert, half of its intermediate size
            assert (experts.w13.shape[0], experts.w2.shape[2]) == (num_experts, inter // 2)
        got, preempted, hits = generate(llm)
        assert preempted > 0 and hits > 0
        assert got == want
    finally:
        llm.shutdown()


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_rank_reads_only_its_experts(checkpoints, monkeypatch, expert_parallel):
    d = checkpoints["qwen3_moe"]
    reads: dict = {}
    real = loader_module.safe_open
    monkeypatch.setattr(loader_module, "safe_open", lambda *a, **kw: RecordingFile(real(*a, **kw), reads, []))
    config = EngineArgs(model=str(d), tensor_parallel_size=2, enable_expert_parallel=expert_parallel).create_config()
    model = load_model(config, TensorParallelGroup(rank=1, size=2))
    experts = model.model.layers[0].mlp.experts
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if ".experts." in n]
        p = "model.layers.0.mlp.experts."
        gate, up, down = (f.get_tensor(f"{p}5.{proj}.weight") for proj in ("gate_proj", "up_proj", "down_proj"))
    read_experts = {int(n.split(".experts.")[1].split(".")[0]) for n in names if n in reads}
    if expert_parallel:
        assert read_experts == {4, 5, 6, 7}  # rank 1 of 2 holds experts 4-7 and reads no other
        assert torch.equal(experts.w13[1], torch.cat([gate, up]))
        assert torch.equal(experts.w2[1], down)
    else:
        assert read_experts == set(range(8))
        assert torch.equal(experts.w13[5], torch.cat([gate[16:], up[16:]]))  # the second half of I = 32
        assert torch.equal(experts.w2[5], down[:, 16:])


def test_random_weights_shard_like_a_checkpoint(checkpoints):
    """--load-format dummy under TP=2: rank 1's sinks and experts are slices of TP=1's random weights (every rank
    draws a checkpoint tensor whole and keeps its share), so TP=N on random weights gives TP=1's tokens."""
    d = str(checkpoints["gpt_oss"])
    whole = load_model(EngineArgs(model=d, load_format="dummy").create_config())
    config = EngineArgs(model=d, load_format="dummy", tensor_parallel_size=2).create_config()
    half = load_model(config, TensorParallelGroup(rank=1, size=2))
    attn, attn1 = whole.model.layers[0].self_attn.attn, half.model.layers[0].self_attn.attn
    assert attn1.sinks.dtype == torch.float32 and torch.equal(attn1.sinks, attn.sinks[2:])
    experts, experts1 = whole.model.layers[0].mlp.experts, half.model.layers[0].mlp.experts
    assert torch.equal(experts1.w2, experts.w2[:, :, 16:])
    assert torch.equal(experts1.w2_bias, torch.zeros_like(experts.w2_bias))  # added once, by rank 0
