"""Tensor parallelism on the CPU (gloo): a model split over 2 or 4 ranks generates what the whole model does, on
every architecture and engine path (chunked prefill, prefix cache, preemption, n > 1 forks, logprobs, async
scheduling); each rank's loader reads only its share of the checkpoint; uneven shapes are refused up front; a lost
rank fails the engine instead of hanging it; and a second "node" (`nanoserve worker`) joins rank 0's engine.

Starting a TP engine spawns processes that import torch (seconds each), so each engine serves many prompts. Only
one TP engine may live in a process at a time (torch.distributed's default group is per process): the per-arch
engines live in a class, torn down at its end, and the other tests build and shut down their own."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from safetensors_reads import RecordingFile

import nanoserve.model.loader as loader_module
from nanoserve import LLM, EngineArgs, SamplingParams
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.model.loader import load_model

ARCH_NAMES = ["llama", "mistral", "qwen2", "qwen3", "phi3"]
VOCAB = 384
BLOCK = 16
# Chunked prefill (32-token steps) and a pool of 10 blocks (160 tokens): one long sequence fits, several don't.
SMALL_ENGINE = dict(max_num_batched_tokens=32, num_kv_blocks=10, block_size=BLOCK)
LOGPROB_TOL = 1e-4


# On 2 cores, ranks each running torch's default thread count oversubscribe them (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()  # no bos (0) / eos (1)


PROMPTS = [random_ids(n, seed=500 + n) for n in (5, 17, 40)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def mixed_prompts() -> list[list[int]]:
    """Prompts of different lengths; four share a 48-token (3-block) prefix, so later ones hit the prefix cache."""
    system = random_ids(48, seed=1)
    shared = [system + random_ids(n, seed=10 + n) for n in (5, 21, 37, 2)]
    alone = [random_ids(n, seed=100 + n) for n in (3, 9, 60, 1)]
    return [shared[0], alone[0], shared[1], alone[1], shared[2], alone[2], shared[3], alone[3]]


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def engine_counters(llm: LLM) -> tuple[int, int]:
    """(preemptions, prefix-cache hit tokens) so far."""
    engine = llm.engine
    return engine.scheduler.num_preemptions, engine.block_manager.prefix_hits


def run_mixed(llm: LLM, max_tokens: int = 24):
    """The mixed batch, greedy; returns (outputs, preemptions, prefix-hit tokens) of this call."""
    before = engine_counters(llm)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(mixed_prompts(), params, use_tqdm=False)
    after = engine_counters(llm)
    assert all(len(c.token_ids) == max_tokens and c.finish_reason == "length" for o in outputs for c in o.outputs)
    return outputs, after[0] - before[0], after[1] - before[1]


def assert_logprobs_close(got: dict | None, want: dict | None) -> None:
    if want is None:
        assert got is None
        return
    assert got.keys() == want.keys()
    for token, lp in want.items():
        assert got[token].logprob == pytest.approx(lp.logprob, abs=LOGPROB_TOL)
        assert got[token].rank == lp.rank


def assert_engine_stopped(processes) -> None:
    for p in processes:
        p.join(timeout=10)
        assert not p.is_alive() and p.exitcode == 0, f"{p.name} exit code {p.exitcode}"


def run_in_thread(fn, timeout: float) -> dict:
    """fn() in a daemon thread, joined within `timeout`: {'finished': whether it returned in time, and 'result'
    or 'error' once it has}."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: B036 - reported to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    box["finished"] = not t.is_alive()
    return box


# -- 1. every architecture: TP=2 equals TP=1 -------------------------------------------------------------------
@pytest.fixture(scope="class", params=ARCH_NAMES)
def arch(request):
    return request.param


@pytest.fixture(scope="class")
def tp1(arch, checkpoints):
    llm = LLM(str(checkpoints[arch]), **SMALL_ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="class")
def tp2(arch, checkpoints):
    llm = LLM(str(checkpoints[arch]), tensor_parallel_size=2, **SMALL_ENGINE)
    yield llm
    llm.shutdown()


class TestTwoRanksEqualOne:
    def test_engine_is_split(self, tp1, tp2):
        assert tp1.engine.runner.workers is None
        workers = tp2.engine.runner.workers
        assert workers is not None and len(workers.processes) == 1
        assert all(p.is_alive() for p in workers.processes)
        assert tp2.engine.runner.tp.size == 2 and tp2.engine.runner.tp.rank == 0
        assert tp2.engine.runner.num_kv_blocks == tp1.engine.runner.num_kv_blocks == SMALL_ENGINE["num_kv_blocks"]
        # Half of the vocabulary's rows, half of the heads on rank 0.
        model = tp2.engine.runner.model
        assert model.lm_head.weight.shape[0] == VOCAB // 2
        whole = tp1.engine.runner.model
        assert model.model.layers[0].self_attn.num_heads == whole.model.layers[0].self_attn.num_heads // 2

    def test_greedy_mixed_batch_with_prefix_hits_chunks_and_preemption(self, tp1, tp2):
        want, preempted1, hits1 = run_mixed(tp1)
        got, preempted2, hits2 = run_mixed(tp2)
        # The engine paths this batch is meant to exercise did run, in both engines.
        assert preempted1 > 0 and preempted2 > 0
        assert hits1 > 0 and hits2 > 0
        assert token_ids(got) == token_ids(want)
        assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want]
        assert any(o.num_cached_tokens for o in got)
        for engine in (tp1.engine, tp2.engine):
            assert not engine.has_unfinished_requests()
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    def test_seeded_n2_sampling(self, tp1, tp2):
        prompts = [random_ids(n, seed=200 + n) for n in (7, 19, 33)]  # not whole blocks: copy-on-write forks
        params = SamplingParams(n=2, temperature=0.8, seed=1234, max_tokens=10, ignore_eos=True)
        want = tp1.generate(prompts, params, use_tqdm=False)
        got = tp2.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs) == 2 for o in got)
        assert token_ids(got) == token_ids(want)

    def test_mixed_sampling_params(self, tp1, tp2):
        """The sampler runs on rank 0 over the gathered full-vocabulary logits: every option sees the same."""
        prompts = [random_ids(n, seed=300 + n) for n in (4, 12, 26, 40, 8)]
        params = [
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.5),
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={VOCAB - 1: 5.0}),
            SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0.7, min_p=0.05, seed=8, max_tokens=8, min_tokens=4,
                           stop_token_ids=list(range(2, VOCAB, 5))),
            SamplingParams(n=3, temperature=1.2, seed=9, max_tokens=6, ignore_eos=True),
        ]
        want = tp1.generate(prompts, params, use_tqdm=False)
        got = tp2.generate(prompts, params, use_tqdm=False)
        assert token_ids(got) == token_ids(want)
        assert [[c.finish_reason for c in o.outputs] for o in got] == [[c.finish_reason for c in o.outputs]
                                                                        for o in want]

    def test_logprobs_and_prompt_logprobs(self, tp1, tp2):
        prompts = [random_ids(n, seed=400 + n) for n in (6, 45, 70)]  # 45 and 70: prefilled in several chunks
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
        want = tp1.generate(prompts, params, use_tqdm=False)
        got = tp2.generate(prompts, params, use_tqdm=False)
        assert token_ids(got) == token_ids(want)
        for g, w in zip(got, want, strict=True):
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(w.prompt_token_ids)
            for gp, wp in zip(g.prompt_logprobs, w.prompt_logprobs, strict=True):
                assert_logprobs_close(gp, wp)
            gc, wc = g.outputs[0], w.outputs[0]
            assert len(gc.logprobs) == len(wc.logprobs) == 6
            for gp, wp in zip(gc.logprobs, wc.logprobs, strict=True):
                assert_logprobs_close(gp, wp)
            assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=10 * LOGPROB_TOL)


def test_async_scheduling_equals_sync(checkpoints, monkeypatch):
    """With async scheduling a decode's input token is the previous step's sample, still on the device: the workers
    draw greedy steps' samples themselves from the same logits (no collective), and take seeded ones from rank 0's
    broadcast."""
    broadcasts = []
    real_broadcast = TensorParallelGroup.broadcast
    monkeypatch.setattr(TensorParallelGroup, "broadcast",
                        lambda self, x: broadcasts.append(1) or real_broadcast(self, x))
    d = str(checkpoints["llama"])
    sync = LLM(d, async_scheduling=False, **SMALL_ENGINE)
    want, _, _ = run_mixed(sync)
    seeded = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=9, ignore_eos=True)
    want_seeded = sync.generate(mixed_prompts()[:3], seeded, use_tqdm=False)
    llm = LLM(d, tensor_parallel_size=2, async_scheduling=True, **SMALL_ENGINE)
    try:
        assert llm.engine.async_scheduling
        got, preempted, hits = run_mixed(llm)
        assert preempted > 0 and hits > 0
        assert token_ids(got) == token_ids(want)
        assert not broadcasts  # greedy: every rank drew the samples itself
        assert token_ids(llm.generate(mixed_prompts()[:3], seeded, use_tqdm=False)) == token_ids(want_seeded)
        assert broadcasts  # a request's own seed: rank 0's generator only
        assert llm.engine.in_flight is None and not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


# -- 2. four ranks: fewer kv heads (2) than ranks, each replicated on two ------------------------------------------
def test_four_ranks_replicate_kv_heads(checkpoints):
    d = str(checkpoints["qwen3"])
    want, _, _ = run_mixed(LLM(d, **SMALL_ENGINE))
    llm = LLM(d, tensor_parallel_size=4, **SMALL_ENGINE)
    try:
        processes = list(llm.engine.runner.workers.processes)
        assert len(processes) == 3
        attn = llm.engine.runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        assert llm.engine.runner.kv_cache[0][0].shape[2] == 1  # one (replicated) kv head in rank 0's pool
        got, preempted, hits = run_mixed(llm)
        assert preempted > 0 and hits > 0
        assert token_ids(got) == token_ids(want)
    finally:
        llm.shutdown()
    assert_engine_stopped(processes)  # stopped by rank 0's message, not killed
    llm.shutdown()  # idempotent


# -- 3. the sharded loader --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_bias_dir(tmp_path_factory) -> Path:
    """Llama with attention_bias: q/k/v biases (column-parallel) and an o_proj bias (row-parallel), made nonzero
    (transformers initializes biases to zeros)."""
    d = write_checkpoint(tmp_path_factory.mktemp("tp_llama_bias") / "m", "llama", attention_bias=True)
    tensors = load_file(d / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.5
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


def read_checkpoint(d: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(d / "model.safetensors"), framework="pt", device="cpu") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def elements_read(shape: tuple[int, ...], indexes: list) -> tuple[set[int], set[int]]:
    """The rows (and for a matrix the columns) that the indexes read of a tensor of `shape`."""
    rows, cols = set(), set()
    if len(shape) == 1:
        for index in indexes:
            rows.update(torch.arange(shape[0])[index].reshape(-1).tolist())
        return rows, cols
    r, c = torch.meshgrid(torch.arange(shape[0]), torch.arange(shape[1]), indexing="ij")
    for index in indexes:
        rows.update(r[index].reshape(-1).tolist())
        cols.update(c[index].reshape(-1).tolist())
    return rows, cols


def expected_share(name: str, shape: tuple[int, ...], rank: int, size: int, head_dim: int, num_kv_heads: int):
    """(rows, columns) of checkpoint tensor `name` that rank `rank` of `size` holds; None: it reads nothing."""
    all_rows, all_cols = set(range(shape[0])), set(range(shape[1])) if len(shape) == 2 else set()

    def part(n: int) -> set[int]:
        return set(range(rank * n // size, (rank + 1) * n // size))

    if any(f".{p}." in name for p in ("q_proj", "gate_proj", "up_proj")) or "embed_tokens" in name \
            or "lm_head" in name:
        return part(shape[0]), all_cols
    if ".k_proj." in name or ".v_proj." in name:
        if num_kv_heads >= size:
            return part(shape[0]), all_cols
        head = rank * num_kv_heads // size  # replicated: one whole kv head
        return set(range(head * head_dim, (head + 1) * head_dim)), all_cols
    if ".o_proj.bias" in name:
        return (all_rows, all_cols) if rank == 0 else None  # rank 0 alone adds the bias
    if ".o_proj." in name or ".down_proj." in name:
        return all_rows, part(shape[1])
    return all_rows, all_cols  # norms: whole on every rank


def load_shard(d: Path, rank: int, size: int, monkeypatch) -> tuple[torch.nn.Module, dict, list]:
    """Rank `rank` of `size`'s model, loaded in this process (loading runs no collective), with the reads of
    the checkpoint recorded."""
    reads: dict = {}
    whole: list = []
    real = loader_module.safe_open
    monkeypatch.setattr(loader_module, "safe_open",
                        lambda *a, **kw: RecordingFile(real(*a, **kw), reads, whole))
    config = EngineArgs(model=str(d), tensor_parallel_size=size).create_config()
    model = load_model(config, TensorParallelGroup(rank=rank, size=size))
    monkeypatch.setattr(loader_module, "safe_open", real)
    return model, reads, whole


@pytest.mark.parametrize("rank,size", [(0, 2), (1, 2), (3, 4)])
def test_loader_reads_only_the_ranks_share(llama_bias_dir, monkeypatch, rank, size):
    model, reads, whole = load_shard(llama_bias_dir, rank, size, monkeypatch)
    full = read_checkpoint(llama_bias_dir)
    cfg = json.loads((llama_bias_dir / "config.json").read_text())
    hd, heads, kv_heads = 64 // 4, cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert (heads, kv_heads, cfg["vocab_size"], cfg["intermediate_size"]) == (4, 2, VOCAB, 128)
    assert whole == []  # no get_tensor: every tensor is read through a slice
    for name, tensor in full.items():
        want = expected_share(name, tuple(tensor.shape), rank, size, hd, kv_heads)
        if want is None:
            assert name not in reads, f"{name} should not be read at rank {rank}"
            continue
        got = elements_read(tuple(tensor.shape), reads.get(name, []))
        assert got == want, (f"{name}: rank {rank} of {size} read {len(got[0])} rows from "
                             f"{min(got[0], default=None)} and {len(got[1])} columns, expected {len(want[0])} "
                             f"rows from {min(want[0], default=None)} and {len(want[1])} columns")

    # Shapes: this rank's share.
    q_heads, local_kv = heads // size, max(1, kv_heads // size)
    inter, vocab = cfg["intermediate_size"] // size, VOCAB // size
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.qkv_proj.weight.shape == ((q_heads + 2 * local_kv) * hd, 64)
    assert attn.qkv_proj.bias.shape == ((q_heads + 2 * local_kv) * hd,)
    assert attn.o_proj.weight.shape == (64, heads * hd // size)
    assert attn.o_proj.bias.shape == (64,)
    assert mlp.gate_up_proj.weight.shape == (2 * inter, 64)
    assert mlp.down_proj.weight.shape == (64, inter)
    assert model.model.embed_tokens.weight.shape == (vocab, 64)
    assert model.lm_head.weight.shape == (vocab, 64)  # llama: not tied

    # Values: the corresponding slices of the whole checkpoint tensors.
    p = "model.layers.1."
    q = slice(rank * q_heads * hd, (rank + 1) * q_heads * hd)
    kv_head = rank * kv_heads // size if kv_heads < size else rank
    kv = slice(kv_head * local_kv * hd, (kv_head + 1) * local_kv * hd)
    want_qkv = torch.cat([full[p + "self_attn.q_proj.weight"][q], full[p + "self_attn.k_proj.weight"][kv],
                          full[p + "self_attn.v_proj.weight"][kv]])
    assert torch.equal(attn.qkv_proj.weight, want_qkv)
    want_qkv_bias = torch.cat([full[p + "self_attn.q_proj.bias"][q], full[p + "self_attn.k_proj.bias"][kv],
                               full[p + "self_attn.v_proj.bias"][kv]])
    assert torch.equal(attn.qkv_proj.bias, want_qkv_bias)
    heads_cols = slice(rank * heads * hd // size, (rank + 1) * heads * hd // size)
    assert torch.equal(attn.o_proj.weight, full[p + "self_attn.o_proj.weight"][:, heads_cols])
    # The row-parallel bias: rank 0 holds it, the others zeros (the all-reduce adds it once).
    if rank == 0:
        assert torch.equal(attn.o_proj.bias, full[p + "self_attn.o_proj.bias"])
    else:
        assert torch.equal(attn.o_proj.bias, torch.zeros(64))
    assert full[p + "self_attn.o_proj.bias"].abs().sum() > 0  # so that zeros are not what the checkpoint has
    i = slice(rank * inter, (rank + 1) * inter)
    want_gate_up = torch.cat([full[p + "mlp.gate_proj.weight"][i], full[p + "mlp.up_proj.weight"][i]])
    assert torch.equal(mlp.gate_up_proj.weight, want_gate_up)
    assert torch.equal(mlp.down_proj.weight, full[p + "mlp.down_proj.weight"][:, i])
    v = slice(rank * vocab, (rank + 1) * vocab)
    assert torch.equal(model.model.embed_tokens.weight, full["model.embed_tokens.weight"][v])
    assert torch.equal(model.lm_head.weight, full["lm_head.weight"][v])
    assert torch.equal(model.model.norm.weight, full["model.norm.weight"])


def test_row_parallel_bias_is_added_once(llama_bias_dir):
    """o_proj's bias at TP=2: held by rank 0 alone, so the all-reduce adds it once (twice would change tokens)."""
    d = str(llama_bias_dir)
    want = token_ids(LLM(d, num_kv_blocks=64).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM(d, tensor_parallel_size=2, num_kv_blocks=64)
    try:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    finally:
        llm.shutdown()


def test_loader_shard_of_tied_qk_norm_model(checkpoints, monkeypatch):
    """qwen3: head_dim 32 (not hidden / heads), q/k norms whole on every rank, lm_head tied to the embedding."""
    d = checkpoints["qwen3"]
    model, reads, whole = load_shard(d, 1, 2, monkeypatch)
    full = read_checkpoint(d)
    assert whole == [] and "lm_head.weight" not in reads
    attn = model.model.layers[0].self_attn
    hd = 32
    assert attn.qkv_proj.weight.shape == ((2 + 2 * 1) * hd, 64)
    p = "model.layers.0.self_attn."
    want = torch.cat([full[p + "q_proj.weight"][2 * hd:4 * hd], full[p + "k_proj.weight"][hd:2 * hd],
                      full[p + "v_proj.weight"][hd:2 * hd]])
    assert torch.equal(attn.qkv_proj.weight, want)
    assert torch.equal(attn.o_proj.weight, full[p + "o_proj.weight"][:, 2 * hd:4 * hd])
    assert torch.equal(attn.q_norm.weight, full[p + "q_norm.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, full["model.embed_tokens.weight"][VOCAB // 2:])
    assert elements_read((VOCAB, 64), reads["model.embed_tokens.weight"])[0] == set(range(VOCAB // 2, VOCAB))


def test_loader_shard_of_packed_phi3(tmp_path, monkeypatch):
    """Phi-3's packed qkv_proj ("q+k+v") and gate_up_proj ("gate+up"): rank 1 of 2 holds its q heads, its kv head
    and its share of gate and of up, read as row ranges of the packed tensors."""
    d = write_checkpoint(tmp_path / "phi3", "phi3", num_attention_heads=4, num_key_value_heads=2, rope_scaling=None)
    model, reads, whole = load_shard(d, 1, 2, monkeypatch)
    full = read_checkpoint(d)
    assert whole == []
    hd, p = 32, "model.layers.0."
    qkv, gate_up = full[p + "self_attn.qkv_proj.weight"], full[p + "mlp.gate_up_proj.weight"]
    assert qkv.shape == ((4 + 2 * 2) * hd, 128) and gate_up.shape == (2 * 128, 128)
    want = torch.cat([qkv[2 * hd:4 * hd], qkv[(4 + 1) * hd:(4 + 2) * hd], qkv[(6 + 1) * hd:(6 + 2) * hd]])
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight, want)
    assert elements_read(tuple(qkv.shape), reads[p + "self_attn.qkv_proj.weight"])[0] == (
        set(range(2 * hd, 4 * hd)) | set(range(5 * hd, 6 * hd)) | set(range(7 * hd, 8 * hd)))
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight, torch.cat([gate_up[64:128], gate_up[192:]]))
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, full[p + "self_attn.o_proj.weight"][:, 64:])


# -- 4. uneven shapes and node layouts are refused before anything starts ----------------------------------------
def config_only(tmp_path: Path, base: Path, **overrides) -> Path:
    d = tmp_path / "cfg"
    d.mkdir()
    cfg = json.loads((base / "config.json").read_text()) | overrides
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def create_config(model: Path, **kwargs):
    return EngineArgs(model=str(model), **kwargs).create_config()


def test_heads_not_divisible_are_refused(checkpoints):
    with pytest.raises(ValueError, match="tensor_parallel_size: 3") as e:
        create_config(checkpoints["llama"], tensor_parallel_size=3)
    assert "num_attention_heads 4" in str(e.value)
    assert "intermediate_size 128" in str(e.value)
    assert "vocab_size" not in str(e.value)  # 384 divides by 3


def test_vocab_not_divisible_is_refused(tmp_path, checkpoints):
    d = config_only(tmp_path, checkpoints["qwen3"], vocab_size=385)
    create_config(d, load_format="dummy")  # fine without tensor parallelism
    with pytest.raises(ValueError, match="vocab_size 385"):
        create_config(d, load_format="dummy", tensor_parallel_size=2)


def test_kv_heads_neither_divisible_nor_dividing_are_refused(tmp_path, checkpoints):
    d = config_only(tmp_path, checkpoints["llama"], num_attention_heads=12, num_key_value_heads=3, hidden_size=96)
    with pytest.raises(ValueError, match="num_key_value_heads 3"):
        create_config(d, load_format="dummy", tensor_parallel_size=2)
    # 6 ranks: each of the 3 kv heads replicated on 2 of them (but 128 intermediate does not split in 6).
    with pytest.raises(ValueError, match="intermediate_size 128") as e:
        create_config(d, load_format="dummy", tensor_parallel_size=6)
    assert "num_key_value_heads" not in str(e.value)


def test_node_layouts_are_refused(checkpoints):
    d = checkpoints["qwen3"]
    with pytest.raises(ValueError, match="nnodes") as e:
        create_config(d, tensor_parallel_size=2, nnodes=3, distributed_init_method="tcp://127.0.0.1:1")
    assert "2" in str(e.value) and "3" in str(e.value)
    with pytest.raises(ValueError, match="distributed_init_method"):
        create_config(d, tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        create_config(d, tensor_parallel_size=2, nnodes=2, node_rank=2, distributed_init_method="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="nnodes"):
        create_config(d, tensor_parallel_size=2, nnodes=0)
    # What is allowed: two nodes of one rank each.
    create_config(d, tensor_parallel_size=2, nnodes=2, node_rank=1, distributed_init_method="tcp://127.0.0.1:1")


def test_llm_refuses_before_spawning(checkpoints):
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="num_attention_heads 4"):
        LLM(str(checkpoints["mistral"]), tensor_parallel_size=3)
    assert set(multiprocessing.active_children()) == before


# -- 5. a lost rank ends the engine instead of hanging it -------------------------------------------------------
def test_killed_rank_fails_the_next_step(checkpoints):
    llm = LLM(str(checkpoints["qwen3"]), tensor_parallel_size=2)
    try:
        assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 3
        workers = llm.engine.runner.workers
        process = workers.processes[0]
        process.kill()
        # The engine notices within seconds: its watcher thread reaps the rank (the one thread that does: two
        # threads joining one process race for its exit status) and names it with its exit code.
        deadline = time.monotonic() + 10
        while workers.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers.lost == "tensor-parallel rank 1 exited (-9)"
        box = run_in_thread(lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False), timeout=30)
        assert box["finished"], "generate hung after a rank was killed"
        assert isinstance(box.get("error"), RuntimeError), box
        assert "rank 1" in str(box["error"])
        # And again: the engine stays failed, it does not wait.
        box = run_in_thread(lambda: llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False), timeout=30)
        assert box["finished"] and isinstance(box.get("error"), RuntimeError) and "rank 1" in str(box["error"])
    finally:
        box = run_in_thread(llm.shutdown, timeout=30)
    assert box["finished"] and "error" not in box, box


def test_rank_killed_mid_generate_fails_it(checkpoints):
    """A step already waiting on the lost rank in a collective fails (gloo's connection closes)."""
    llm = LLM(str(checkpoints["llama"]), tensor_parallel_size=2)
    try:
        process = llm.engine.runner.workers.processes[0]
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        started = time.monotonic()
        box: dict = {}

        def generate():
            try:
                box["result"] = llm.generate(PROMPTS * 4, long, use_tqdm=False)
            except BaseException as e:  # noqa: B036 - reported to the test
                box["error"] = e

        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        time.sleep(0.5)  # well into the decode steps
        process.kill()
        thread.join(60)
        assert not thread.is_alive(), "generate hung after a rank was killed mid-run"
        assert "result" not in box, f"generate ran to its end in {time.monotonic() - started:.1f} s: kill earlier"
        assert isinstance(box.get("error"), RuntimeError), box
        box = run_in_thread(lambda: llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False), timeout=30)
        assert box["finished"] and isinstance(box.get("error"), RuntimeError), box
    finally:
        box = run_in_thread(llm.shutdown, timeout=30)
    assert box["finished"] and "error" not in box, box


# -- 6. two "nodes" on this machine: rank 1 from `nanoserve worker` ----------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("size", "arch"), [(2, "mistral"), (4, "qwen3")])
def test_second_node_from_worker_command(checkpoints, tmp_path, size, arch):
    """Two "nodes": rank 0 alone on node 0 (its step messages all go through gloo), or with rank 1 beside it (the
    shared-memory ring for rank 1, gloo for ranks 2 and 3 on node 1)."""
    d = str(checkpoints[arch])
    want = token_ids(LLM(d, num_kv_blocks=64).generate(PROMPTS, GREEDY, use_tqdm=False))
    init = f"tcp://127.0.0.1:{free_port()}"
    node = ["--tensor-parallel-size", str(size), "--nnodes", "2", "--distributed-init-method", init,
            "--num-kv-blocks", "64"]
    log_path = tmp_path / "worker.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_path, "w") as log:
        # The worker first: LLM's constructor waits in the rendezvous until every rank has joined.
        worker = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "worker", "--model", d,
                                   "--node-rank", "1", *node], stdout=log, stderr=subprocess.STDOUT, env=env)
    llm = None
    try:
        llm = LLM(d, tensor_parallel_size=size, nnodes=2, node_rank=0, distributed_init_method=init,
                  num_kv_blocks=64)
        tp = llm.engine.runner.tp
        assert len(llm.engine.runner.workers.processes) == size // 2 - 1  # the rest are the other node's
        assert tp.size == size
        assert (tp.host_ring is not None) == (size > 2) and tp.host_group is not None
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        assert worker.poll() is None
        llm.shutdown()
        assert worker.wait(timeout=30) == 0, log_path.read_text()[-3000:]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        if llm is not None:
            llm.shutdown()
