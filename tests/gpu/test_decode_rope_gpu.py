"""decode_rope_attention on the GPU in bf16: against the unfused kernels (qkv_rope_store, then decode_attention)
eagerly and replayed from CUDA graphs with new lengths, positions and slots, and whole models' greedy tokens
with EngineArgs.fused_rope_decode on and off."""

import pytest
import torch
from checkpoints import write_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16_TOL = dict(atol=2e-2, rtol=2e-2)
BLOCK_SIZE = 16


class DecodeStep:
    """One layer's decode step at static addresses (as a CUDA graph needs): qkv rows, norm weights, rotary
    tables, a paged cache of random bf16 K/V and the step's metadata, refilled in place by `fill`."""

    def __init__(self, hq: int, hkv: int, head_dim: int, norm: bool, batch: int, max_len: int,
                 gen: torch.Generator, block_size: int = BLOCK_SIZE):
        self.hq, self.hkv, self.head_dim, self.batch, self.block_size = hq, hkv, head_dim, batch, block_size
        self.gen = gen
        width = -(-max_len // block_size)
        self.num_blocks = batch * width + 1
        cache_shape = (self.num_blocks, block_size, hkv, head_dim)
        # Generated on the GPU (batch 64 at 3,000 keys is 400 MB a cache): not reproducible run to run.
        self.k_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda")
        self.v_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda")
        self.qkv = torch.empty(batch, (hq + 2 * hkv) * head_dim, dtype=torch.bfloat16, device="cuda")
        freqs = torch.rand(max_len, head_dim // 2, generator=gen) * 50
        self.cos, self.sin = freqs.cos().cuda(), freqs.sin().cuda()
        weights = [torch.randn(head_dim, generator=gen).bfloat16().cuda() for _ in range(2)]
        self.weights = weights if norm else [None, None]
        self.positions = torch.empty(batch, dtype=torch.int64, device="cuda")
        self.slots = torch.empty(batch, dtype=torch.int64, device="cuda")
        self.seq_lens = torch.empty(batch, dtype=torch.int32, device="cuda")
        self.block_tables = torch.empty(batch, width, dtype=torch.int32, device="cuda")
        self.counters = torch.zeros(batch * hkv, dtype=torch.int32, device="cuda")

    def fill(self, lens: list[int], not_stored: tuple[int, ...] = ()) -> None:
        """New qkv rows and tables; sequence b at lens[b] keys (0: a padding row), its new token's slot where the
        table puts position lens[b] - 1 (-1 for padding rows and the rows in not_stored)."""
        perm = torch.randperm(self.num_blocks - 1, generator=self.gen).view(self.batch, -1)
        self.block_tables.copy_(perm[:, : self.block_tables.shape[1]])
        self.qkv.copy_(torch.randn(self.qkv.shape, generator=self.gen).bfloat16())
        bs = self.block_size
        slots = [-1 if n == 0 or b in not_stored else int(perm[b, (n - 1) // bs]) * bs + (n - 1) % bs
                 for b, n in enumerate(lens)]
        self.slots.copy_(torch.tensor(slots))
        self.positions.copy_(torch.tensor([max(n - 1, 0) for n in lens]))
        self.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))

    def rope_args(self, caches: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        return (self.qkv, self.hq, self.hkv, self.positions, self.cos, self.sin, *self.weights, 1e-6, *caches,
                self.slots)

    def fused(self, out: torch.Tensor, counters: bool, prefetch: bool | None = None) -> None:
        from nanoserve.kernels.decode_rope_attention import decode_rope_attention

        decode_rope_attention(*self.rope_args((self.k_cache, self.v_cache)), self.seq_lens, self.block_tables,
                              self.head_dim**-0.5, out=out, counters=self.counters if counters else None,
                              prefetch=prefetch)

    def unfused(self, counters: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv_rope_store then decode_attention on copies of qkv and the caches: (output, k cache, v cache)."""
        from nanoserve.kernels.decode_attention import decode_attention
        from nanoserve.kernels.qkv_rope_store import qkv_rope_store

        caches = (self.k_cache.clone(), self.v_cache.clone())
        args = self.rope_args(caches)
        qkv = args[0].clone()
        qkv_rope_store(qkv, *args[1:])
        q = qkv[:, : self.hq * self.head_dim].view(self.batch, self.hq, self.head_dim)
        out = decode_attention(q, *caches, self.seq_lens, self.block_tables, self.head_dim**-0.5,
                               counters=self.counters if counters else None)
        return out, *caches


def _check(step: DecodeStep, out: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want[0], **BF16_TOL)
    torch.testing.assert_close(step.k_cache, want[1], **BF16_TOL)
    assert torch.equal(step.v_cache, want[2])
    assert (step.counters == 0).all()


# Qwen3-0.6B, Llama-3.1-8B, and GQA 7 / 1 at head_dim 64 (the 7 with 32-token pages).
SHAPES = [(16, 8, 128, True, 16), (32, 8, 128, False, 16), (14, 2, 64, True, 32), (4, 4, 64, False, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=["qwen3-0.6b", "llama-3.1-8b", "gqa7", "gqa1"])
@pytest.mark.parametrize("batch", [1, 4, 64])
@pytest.mark.parametrize("prefetch", [None, True, False])
def test_fused_matches_unfused_gpu(shape, batch, prefetch):
    hq, hkv, d, norm, block_size = shape
    gen = torch.Generator().manual_seed(batch)
    step = DecodeStep(hq, hkv, d, norm, batch, 3000, gen, block_size)
    lens = torch.randint(1, 3001, (batch,), generator=gen).tolist()
    if batch > 1:
        lens[1] = 0  # a padding row
    step.fill(lens, not_stored=(batch - 1,) if batch > 2 else ())
    counters = batch <= 4  # as the decode graphs use them
    want = step.unfused(counters)
    out = torch.full((batch, hq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    step.fused(out, counters, prefetch)
    _check(step, out, want)
    if batch <= 4:
        from nanoserve.kernels.decode_rope_attention import decode_rope_attention_ref

        caches = (want[1].clone(), want[2].clone())  # already hold the new K/V: storing them again changes nothing
        ref = decode_rope_attention_ref(*step.rope_args(caches), step.seq_lens, step.block_tables, d**-0.5)
        torch.testing.assert_close(out, ref, **BF16_TOL)


@pytest.mark.parametrize("batch,counters", [(1, True), (3, True), (64, False)])
def test_fused_cuda_graph_replay(batch, counters):
    """Two layers captured as a decode graph does (one counter buffer), replayed with new lengths, positions,
    slots and qkv rows: each replay's outputs and stored K/V must match the unfused kernels run eagerly."""
    gen = torch.Generator().manual_seed(0)
    layers = [DecodeStep(16, 8, 128, True, batch, 2048, gen) for _ in range(2)]
    layers[1].counters = layers[0].counters
    outs = [torch.empty(batch, 16, 128, dtype=torch.bfloat16, device="cuda") for _ in layers]
    for layer in layers:
        layer.fill([2048] * batch)
        layer.fused(outs[0], counters)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer, out in zip(layers, outs, strict=True):
            layer.fused(out, counters)
    for replay in range(4):
        lens = torch.randint(1, 2049, (batch,), generator=gen).tolist()
        if batch > 1:
            lens[replay % batch] = 1 + replay  # a sequence's first keys
        if batch > 2:
            lens[(replay + 1) % batch] = 0  # a padding row
        for layer in layers:
            layer.fill(lens, not_stored=(2,) if batch > 3 else ())
        wants = [layer.unfused(counters) for layer in layers]
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for layer, out, want in zip(layers, outs, wants, strict=True):
            _check(layer, out, want)


def _count_fused_calls(monkeypatch) -> list[int]:
    """The batch size of every call of decode_rope_attention from here on, in a list that fills as they come."""
    import nanoserve.kernels.decode_rope_attention as module

    calls = []
    original = module.decode_rope_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    # llama.py imports it at each call, so it finds this one (eager steps and graph captures alike).
    monkeypatch.setattr(module, "decode_rope_attention", counted)
    return calls


def _greedy_tokens(ckpt, fused: str) -> list[list[int]]:
    """Greedy tokens of 6 prompts: decode graphs at batch 1-6, counters up to 4."""
    from nanoserve import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 384, (n,), generator=g).tolist() for n in (5, 40, 77, 130, 9, 300)]
    llm = LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=512, fused_rope_decode=fused)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    return tokens


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
    ("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1)),
    ("phi3", {}),  # partial rotary: 48 of 64 dims (24 a half, padded in the kernels)
])
def test_model_tokens_with_switch_on_and_off(arch, overrides, tmp_path, monkeypatch):
    calls = _count_fused_calls(monkeypatch)
    ckpt = write_checkpoint(tmp_path / arch, arch, num_hidden_layers=3, **overrides)
    fused = _greedy_tokens(ckpt, "on")
    assert calls, "the fused kernel was never called"
    calls.clear()
    unfused = _greedy_tokens(ckpt, "off")
    assert not calls
    assert fused == unfused


@pytest.mark.parametrize("arch,overrides,qk_norm", [
    ("qwen3", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64), True),
    ("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1), False),
    ("phi3", {}, False),
])
def test_auto_fuses_small_batches(arch, overrides, qk_norm, tmp_path, monkeypatch):
    """The default ("auto"): decode steps of up to FUSED_ROPE_DECODE_MAX_BATCH sequences of a model without q/k
    norms take the fused launch, of Qwen3's only one sequence (its qkv GEMV then starts attention late), larger
    ones never; the tokens are the unfused path's either way."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.layers.step_plan import FUSED_ROPE_DECODE_MAX_BATCH

    calls = _count_fused_calls(monkeypatch)
    ckpt = write_checkpoint(tmp_path / arch, arch, num_hidden_layers=3, **overrides)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 384, (n,), generator=g).tolist() for n in (5, 40, 77, 130, 9, 300)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tokens = {}
    for mode in ("auto", "off"):
        calls.clear()
        # Decode graphs choose their path when captured, here: the batch sizes that called the fused launch.
        llm = LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=512, fused_rope_decode=mode)
        captured = set(calls)
        # Three sequences decode in the batch-4 graph, then six in the batch-8 one.
        tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)]
        tokens[mode] += [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
        if mode == "auto" and qk_norm:
            assert captured == {1}
        elif mode == "auto":
            assert captured == {b for b in (1, 2, 4) if b <= FUSED_ROPE_DECODE_MAX_BATCH} and 4 in captured
        else:
            assert not captured
    assert tokens["auto"] == tokens["off"]
