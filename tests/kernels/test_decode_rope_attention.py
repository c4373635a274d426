"""decode_rope_attention (q/k norm, rotary, KV store and decode attention in one launch) against the unfused
references (qkv_rope_store_ref, then decode_attention_ref) and the unfused kernels, on random inputs."""

import pytest
import torch

from nanoserve.kernels.decode_attention import decode_attention
from nanoserve.kernels.decode_rope_attention import decode_rope_attention, decode_rope_attention_ref
from nanoserve.kernels.qkv_rope_store import qkv_rope_store

# (dtype, head_dim, num_q_heads, num_kv_heads, block_size, seq_lens, num_splits, norm, fused merge): GQA ratios
# 1/2/4/7/8, head_dim 64/128, block sizes 8/16/32, odd lengths off the block size and the 64-key tile, one split
# and many (more than a short sequence fills), the shape-derived default, length-0 padding rows, and the new
# key in its split's first tile (loaded before the PDL wait when prefetching) or a later one (300 keys over 2
# splits: keys 192-299, the new one in the second tile).
CASES = [
    (torch.float32, 64, 2, 2, 16, [1, 17, 100], 1, True, False),
    (torch.float16, 128, 14, 2, 8, [9, 70, 130], 3, False, True),
    (torch.float16, 64, 8, 1, 32, [33, 200], 8, True, False),
    (torch.float32, 128, 4, 2, 16, [5, 0, 150], None, True, True),
    (torch.float32, 64, 16, 8, 16, [131], 16, True, True),  # Qwen3-0.6B's heads at batch 1 (head_dim 64 here)
    (torch.float16, 64, 4, 1, 16, [300, 77, 65], 2, True, True),
    (torch.float32, 64, 7, 1, 16, [300, 1, 64], 2, False, False),
]


def _rope_inputs(case, make_paged_kv, gen, device, slot_minus_one=(), spare_slot_for_empty=False, rotary_dim=None):
    """Random qkv rows, norm weights and rotary tables (for the first rotary_dim dims of a head: partial rotary),
    NaN-poisoned paged caches holding each sequence's earlier keys, and the new token's position and slot (its cache
    entry NaN: it must come from qkv)."""
    dtype, head_dim, hq, hkv, block_size, seq_lens, num_splits, norm, fused = case
    k_cache, v_cache, block_tables = make_paged_kv(seq_lens, hkv, head_dim, block_size, dtype, gen, pad_value=0)
    batch = len(seq_lens)
    qkv = torch.randn(batch, (hq + 2 * hkv) * head_dim, generator=gen).to(device, dtype)
    freqs = torch.randn(max(seq_lens) + 1, (rotary_dim or head_dim) // 2, generator=gen)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    q_w = torch.randn(head_dim, generator=gen).to(device, dtype) if norm else None
    k_w = torch.randn(head_dim, generator=gen).to(device, dtype) if norm else None
    positions = torch.tensor([max(n - 1, 0) for n in seq_lens], device=device)
    slots = []
    for b, n in enumerate(seq_lens):
        if n == 0 or b in slot_minus_one:
            slots.append(-1)  # a padding row, or a token not stored: the cache's entry is read, as unfused
            continue
        slot = int(block_tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size
        k_cache.view(-1, hkv, head_dim)[slot] = float("nan")
        v_cache.view(-1, hkv, head_dim)[slot] = float("nan")
        slots.append(slot)
    if spare_slot_for_empty:
        # qkv_rope_store stores a length-0 row's K/V too, if it has a slot: so must the fused kernel.
        used = {int(x) for b, n in enumerate(seq_lens) for x in block_tables[b, : -(-n // block_size)]}
        spare = min(set(range(k_cache.shape[0])) - used)
        slots = [spare * block_size + 3 if n == 0 else s for n, s in zip(seq_lens, slots, strict=True)]
    rope = (qkv, hq, hkv, positions, cos, sin, q_w, k_w, 1e-6)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    counters = torch.zeros(batch * hkv, dtype=torch.int32, device=device) if fused else None
    return rope, k_cache, v_cache, torch.tensor(slots, device=device), seq, block_tables, num_splits, counters


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_matches_unfused_references(case, prefetch, make_paged_kv, gen, device, tol):
    rope, k_cache, v_cache, slots, seq, tables, splits, counters = _rope_inputs(
        case, make_paged_kv, gen, device, slot_minus_one=(1,))
    qkv = rope[0]
    scale = qkv.shape[1] ** -0.25
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = decode_rope_attention_ref(*rope, k_ref, v_ref, slots, seq, tables, scale)
    qkv_before = qkv.clone()
    out = torch.full_like(want, float("nan"))
    got = decode_rope_attention(*rope, k_cache, v_cache, slots, seq, tables, scale, num_splits=splits, out=out,
                                counters=counters, prefetch=prefetch)
    assert got is out
    assert torch.isfinite(got).all(), "every output written, and no NaN (the new token's stale slot) read"
    torch.testing.assert_close(got, want, **tol[qkv.dtype])
    # The new K/V stored where the reference stored them, every other entry (NaN ones included) untouched.
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, **tol[qkv.dtype])
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, atol=0, rtol=0)
    assert torch.equal(qkv, qkv_before), "qkv is read, not written"
    if counters is not None:
        assert (counters == 0).all(), "the merging programs must reset their counters"


@pytest.mark.parametrize("case", CASES[1:4], ids=range(1, 4))
def test_matches_unfused_kernels(case, make_paged_kv, gen, device, tol):
    """Against qkv_rope_store then decode_attention with the same splits and merge, as llama.py runs them
    with fused_rope_decode off; with a length-0 row that has a slot (stored by both)."""
    rope, k_cache, v_cache, slots, seq, tables, splits, counters = _rope_inputs(
        case, make_paged_kv, gen, device, spare_slot_for_empty=True)
    qkv, hq = rope[0], rope[1]
    scale = 0.3
    k_unfused, v_unfused, qkv_unfused = k_cache.clone(), v_cache.clone(), qkv.clone()
    qkv_rope_store(qkv_unfused, *rope[1:], k_unfused, v_unfused, slots)
    q = qkv_unfused[:, : hq * k_cache.shape[3]].view(qkv.shape[0], hq, -1)
    want = decode_attention(q, k_unfused, v_unfused, seq, tables, scale, num_splits=splits, counters=counters)
    got = decode_rope_attention(*rope, k_cache, v_cache, slots, seq, tables, scale, num_splits=splits,
                                counters=counters)
    torch.testing.assert_close(got, want, **tol[qkv.dtype])
    torch.testing.assert_close(k_cache, k_unfused, equal_nan=True, **tol[qkv.dtype])
    torch.testing.assert_close(v_cache, v_unfused, equal_nan=True, atol=0, rtol=0)
    if qkv.dtype == torch.float16:
        # The same rounding points give the same fp16 keys but where fp32 summation order flips a rounding
        # (rare); a rounding point missed or added changes about a third of them, by less than the tolerance.
        stored = slots[slots >= 0]
        new_k = k_cache.view(-1, *k_cache.shape[2:])[stored]
        assert (new_k != k_unfused.view(-1, *k_cache.shape[2:])[stored]).float().mean() < 0.01


@pytest.mark.parametrize("case,rotary_dim", [(CASES[3], 96), (CASES[0], 16)], ids=["96of128", "16of64-norm"])
def test_partial_rotary(case, rotary_dim, make_paged_kv, gen, device, tol):
    """Partial rotary (Phi-3's partial_rotary_factor; Phi-4-mini rotates 96 of 128 dims): against the references
    and against qkv_rope_store then decode_attention, the new keys stored alike."""
    rope, k_cache, v_cache, slots, seq, tables, splits, counters = _rope_inputs(
        case, make_paged_kv, gen, device, rotary_dim=rotary_dim)
    qkv, hq = rope[0], rope[1]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = decode_rope_attention_ref(*rope, k_ref, v_ref, slots, seq, tables, 0.2)
    k_unfused, v_unfused, qkv_unfused = k_cache.clone(), v_cache.clone(), qkv.clone()
    qkv_rope_store(qkv_unfused, *rope[1:], k_unfused, v_unfused, slots)
    q = qkv_unfused[:, : hq * k_cache.shape[3]].view(qkv.shape[0], hq, -1)
    unfused = decode_attention(q, k_unfused, v_unfused, seq, tables, 0.2, num_splits=splits)
    got = decode_rope_attention(*rope, k_cache, v_cache, slots, seq, tables, 0.2, num_splits=splits,
                                counters=counters)
    torch.testing.assert_close(got, want, **tol[qkv.dtype])
    torch.testing.assert_close(got, unfused, **tol[qkv.dtype])
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, **tol[qkv.dtype])
    torch.testing.assert_close(k_cache, k_unfused, equal_nan=True, **tol[qkv.dtype])


def test_strided_rows_and_repeated_calls(make_paged_kv, gen, device, tol):
    """qkv the leading columns of a padded buffer and out the first rows of a larger one, as in a CUDA graph;
    called twice with one counter buffer (sized for more sequences): same output, counters back at zero."""
    case = (torch.float32, 64, 4, 2, 16, [37, 0, 150], 4, True, True)
    rope, k_cache, v_cache, slots, seq, tables, splits, _ = _rope_inputs(case, make_paged_kv, gen, device)
    qkv = rope[0]
    buf = torch.randn(qkv.shape[0], qkv.shape[1] + 32, generator=gen).to(device)
    buf[:, : qkv.shape[1]] = qkv
    strided = (buf[:, : qkv.shape[1]],) + rope[1:]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = decode_rope_attention_ref(*rope, k_ref, v_ref, slots, seq, tables, 0.125)
    counters = torch.zeros(64, dtype=torch.int32, device=device)
    outs = []
    for _ in range(2):
        out_all = torch.full((5, 4, 64), float("nan"), device=device)
        decode_rope_attention(*strided, k_cache, v_cache, slots, seq, tables, 0.125, num_splits=splits,
                              out=out_all[:3], counters=counters)
        torch.testing.assert_close(out_all[:3], want, **tol[torch.float32])
        assert out_all[3:].isnan().all() and (counters == 0).all()
        outs.append(out_all[:3])
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, **tol[torch.float32])


def test_empty_batch(device):
    d, hq, hkv = 64, 2, 1
    qkv = torch.empty(0, (hq + 2 * hkv) * d, device=device)
    cache = torch.zeros(2, 16, hkv, d, device=device)
    cos = torch.ones(8, d // 2, device=device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    out = decode_rope_attention(qkv, hq, hkv, empty, cos, cos, None, None, 1e-6, cache, cache.clone(), empty,
                                empty.int(), torch.zeros(0, 4, dtype=torch.int32, device=device), 0.1)
    assert out.shape == (0, hq, d)


@pytest.mark.parametrize("qk_norm,fused_rows", [(False, {1, 2, 3, 4}), (True, {1})])
def test_auto_rule(qk_norm, fused_rows):
    """fused_rope_decode="auto": decode steps of up to FUSED_ROPE_DECODE_MAX_BATCH sequences of a model without q/k
    norms, one sequence of a model with them (whose qkv GEMV then starts attention late); never a step with a
    prefill or without the Triton attention kernels (the CPU's default). "on" fuses every decode step, "off" none."""
    from nanoserve.layers.step_plan import FUSED_ROPE_DECODE_MAX_BATCH, KernelPlanner

    assert FUSED_ROPE_DECODE_MAX_BATCH == 4
    for mode, want in (("auto", fused_rows), ("on", set(range(1, 9))), ("off", set())):
        planner = KernelPlanner(mode, qk_norm=qk_norm)

        def plan(rows, num_decodes=None, triton=True, planner=planner):
            return planner.plan(rows, rows if num_decodes is None else num_decodes, rows, triton=triton)

        assert {rows for rows in range(1, 9) if plan(rows).fused_rope_decode} == want
        assert {rows for rows in range(1, 9) if plan(rows).late_qkv_start} == (want if qk_norm else set())
        assert not plan(1, num_decodes=0).fused_rope_decode
        assert not plan(1, triton=False).fused_rope_decode
        assert not planner.plan(1, 1, 1).fused_rope_decode  # a CPU planner: the PyTorch backend
    with pytest.raises(ValueError, match="^fused_rope_decode: must be auto, on or off"):
        KernelPlanner("1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts Python calls, which graph replays skip; on a GPU "
                    "tests/gpu/test_decode_rope_gpu.py checks the model's tokens")
@pytest.mark.parametrize("arch", ["qwen3", "llama", "phi3"])  # phi3: partial rotary, 48 of 64 dims
def test_model_fuses_where_planned(tmp_path, monkeypatch, arch):
    """A model on the CPU whose one-sequence decode steps are planned as if on the Triton kernels, so that they take
    the fused launch (run by the interpreter over the PyTorch backend's caches): it runs exactly there, in every
    layer, the plan asks the qkv GEMV for the late start there only for a model with q/k norms, and the greedy
    tokens are the unfused model's."""
    from checkpoints import write_checkpoint  # tests/checkpoints.py

    from nanoserve import LLM, SamplingParams
    from nanoserve.kernels import decode_rope_attention as module
    from nanoserve.layers.linear import QKVLinear
    from nanoserve.layers.step_plan import KernelPlanner

    path = write_checkpoint(tmp_path / arch, arch, head_dim=64)  # decode attention takes head_dim 64 or 128
    prompts = [[5, 17, 300, 42, 9], [8, 1, 2]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def generate():
        llm = LLM(str(path), num_kv_blocks=16, max_num_seqs=2)
        tokens = [[o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
                  for batch in (prompts[:1], prompts)]
        return tokens, len(llm.engine.runner.model.model.layers)

    reference, num_layers = generate()
    plans, calls = [], []
    plan = KernelPlanner.plan

    def planned(self, num_seqs, num_decodes, num_tokens, graph=False, triton=None, long_context=False):
        one = num_decodes == num_tokens == 1
        plans.append((one, plan(self, num_seqs, num_decodes, num_tokens, graph=graph, triton=one or triton,
                                long_context=long_context)))
        return plans[-1][1]

    monkeypatch.setattr(KernelPlanner, "plan", planned)
    original = module.decode_rope_attention
    monkeypatch.setattr(module, "decode_rope_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    assert generate()[0] == reference
    assert [p.fused_rope_decode for _, p in plans] == [one for one, _ in plans]
    assert [p.late_qkv_start for _, p in plans] == [one and arch == "qwen3" for one, _ in plans]
    assert any(one for one, _ in plans) and len(calls) == num_layers * sum(one for one, _ in plans)
    qkv_proj = QKVLinear(64, 2, 1, 32, bias=False)
    assert [qkv_proj.starts_next_late(p) for _, p in plans] == [p.late_qkv_start for _, p in plans]


@pytest.mark.parametrize("window,sinks", [(5, False), (70, True)])
@pytest.mark.parametrize("case", [CASES[1], CASES[5]], ids=range(2))
def test_window_and_sinks_match_unfused_references(case, window, sinks, make_paged_kv, gen, device, tol):
    """A sliding window (splits start at it; the new key, the last, always inside) and attention sinks."""
    rope, k_cache, v_cache, slots, seq, tables, splits, counters = _rope_inputs(case, make_paged_kv, gen, device)
    scale = rope[0].shape[1] ** -0.25
    sink = (torch.randn(rope[1], generator=gen) * 2).to(device) if sinks else None
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = decode_rope_attention_ref(*rope, k_ref, v_ref, slots, seq, tables, scale, window=window, sinks=sink)
    got = decode_rope_attention(*rope, k_cache, v_cache, slots, seq, tables, scale, num_splits=splits,
                                counters=counters, window=window, sinks=sink)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **tol[rope[0].dtype])
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, **tol[rope[0].dtype])
