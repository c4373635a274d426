"""The fused MoE kernels against kernels/moe_reference.py, and the block layout of moe_align_block_size."""

import json

import pytest
import torch
from moe_cases import MOE_TOL, routing

from nanoserve.kernels import fused_moe as fm
from nanoserve.kernels import moe_align
from nanoserve.kernels.fused_moe import GemmConfig, MoeConfig, fused_moe, fused_moe_with_config
from nanoserve.kernels.moe_align import moe_align_block_size, moe_align_block_size_ref
from nanoserve.kernels.moe_reference import fused_moe_ref

HIDDEN, INTER = 48, 40  # neither a multiple of the tiles, so the tails are exercised




def _weights(num_experts, dtype, device, gen, bias=False):
    # Scaled like trained layers, so that outputs stay near 1 where the tolerances are meant to apply.
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) * INTER**-0.5
    biases = (torch.randn(num_experts, 2 * INTER, generator=gen), torch.randn(num_experts, HIDDEN, generator=gen))
    out = [w13.to(device, dtype), w2.to(device, dtype)]
    return out + ([b.to(device, dtype) for b in biases] if bias else [None, None])


def _check(x, w13, w2, weights, ids, **kw):
    """Against the reference in fp32 on the same (rounded) inputs: fp16's reference rounds where the kernel does not
    (gate and up before the activation), so each would only be compared with the other's rounding."""
    out = fused_moe(x, w13, w2, weights, ids, **kw)
    upcast = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, **upcast)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref, **MOE_TOL[x.dtype])
    return out


# Each T, top_k and E in several pairings (not all 24, for the interpreter's time); 16-row blocks up to 16 pairs an
# expert on average, 64-row ones beyond (default_config).
@pytest.mark.parametrize("num_tokens,top_k,num_experts,dtype,ids_dtype",
                         [(1, 1, 4, torch.float32, torch.int64), (1, 4, 8, torch.float16, torch.int32),
                          (3, 2, 8, torch.float32, torch.int32), (3, 1, 4, torch.float16, torch.int64),
                          (17, 4, 4, torch.float32, torch.int64), (17, 1, 8, torch.float16, torch.int32),
                          (40, 2, 4, torch.float16, torch.int64), (40, 4, 8, torch.float32, torch.int32)])
def test_fused_moe(device, gen, num_tokens, top_k, num_experts, dtype, ids_dtype):
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(device, dtype)
    w13, w2, _, _ = _weights(num_experts, dtype, device, gen)
    ids, weights = routing(num_tokens, top_k, num_experts, gen, device, ids_dtype)
    _check(x, w13, w2, weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("bias", [False, True])
def test_biases_and_activations(device, gen, dtype, activation, bias):
    # Inputs scaled up so that swigluoai's clamps (at +-7) cut into gate and up.
    x = (torch.randn(17, HIDDEN, generator=gen) * (4 if activation == "swigluoai" else 1)).to(device, dtype)
    w13, w2, b13, b2 = _weights(8, dtype, device, gen, bias=bias)
    ids, weights = routing(17, 2, 8, gen, device)
    _check(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, activation=activation)


@pytest.mark.parametrize("num_tokens", [3, 40])
def test_expert_parallel(device, gen, num_tokens):
    """The middle rank of three, with 4 of 12 experts: pairs of the other ranks contribute nothing, and a token
    routed only elsewhere gets zeros."""
    w13, w2, b13, b2 = _weights(4, torch.float32, device, gen, bias=True)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(device)
    ids, weights = routing(num_tokens, 2, 12, gen, device)
    ids[0] = torch.tensor([0, 11])
    ids[1] = torch.tensor([4, 9])  # one local pair and one remote
    out = _check(x, w13, w2, weights, ids, expert_start=4, w13_bias=b13, w2_bias=b2)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert out[1].abs().sum() > 0


def test_sum_skips_rows_of_other_ranks_pairs(device, gen):
    """The down GEMM never writes the rows of pairs routed to other ranks: the sum must not read them (NaN here)."""
    ids, _ = routing(9, 3, 12, gen, device)
    y = torch.randn(27, HIDDEN, generator=gen).to(device)
    local = ((ids >= 4) & (ids < 8)).reshape(-1)
    y[~local] = float("nan")
    want = torch.where(local[:, None], y, 0).view(9, 3, HIDDEN).sum(1)
    torch.testing.assert_close(fm.moe_sum(y, ids, 4, 4), want, **MOE_TOL[torch.float32])


def test_expert_no_token_chose_is_never_read(device, gen):
    """Expert 2's weights are NaN and no token picks it: a kernel that read them would return NaN."""
    w13, w2, b13, b2 = _weights(8, torch.float32, device, gen, bias=True)
    for t in (w13, w2, b13, b2):
        t[2] = float("nan")
    x = torch.randn(40, HIDDEN, generator=gen).to(device)
    ids, weights = routing(40, 4, 7, gen, device)
    ids[ids >= 2] += 1  # experts 0, 1, 3..7
    out = _check(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)
    assert torch.isfinite(out).all()


def test_given_config_and_no_tokens(device, gen):
    """A config as the tuner hands it (32-row blocks, tiles narrower than the dims, grouped ordering), and T = 0."""
    w13, w2, _, _ = _weights(4, torch.float32, device, gen)
    x = torch.randn(40, HIDDEN, generator=gen).to(device)
    ids, weights = routing(40, 2, 4, gen, device)
    config = MoeConfig(32, GemmConfig(16, 16, 4, 4, 2), GemmConfig(32, 32, 2, 4, 2))
    out = fused_moe_with_config(x, w13, w2, weights, ids, config)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), **MOE_TOL[torch.float32])
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, HIDDEN)


def test_bad_arguments_are_named(device, gen):
    w13, w2, _, _ = _weights(4, torch.float32, device, gen)
    x = torch.randn(3, HIDDEN, generator=gen).to(device)
    ids, weights = routing(3, 2, 4, gen, device)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, w13, w2, weights, ids, activation="gelu")
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, weights, ids.float())


def _check_layout(align, topk_ids, num_experts, block_m, expert_start):
    """Every local pair in exactly one row, each block one expert's, experts in order, each run its pairs then
    padding (marked num_pairs) up to a multiple of block_m, unused rows and blocks marked."""
    runs, rows_used = moe_align_block_size_ref(topk_ids, num_experts, block_m, expert_start)
    num_pairs = topk_ids.numel()
    sorted_ids, block_expert = align.sorted_ids.cpu(), align.block_expert.cpu()
    assert int(align.rows_used) == rows_used
    assert sorted_ids.numel() == moe_align.max_rows(num_pairs, num_experts, block_m)
    assert (sorted_ids[rows_used:] == num_pairs).all()
    assert (block_expert[rows_used // block_m :] == -1).all()
    row = 0
    for e, run in enumerate(runs):
        padded = -(-len(run) // block_m) * block_m
        assert (block_expert[row // block_m : (row + padded) // block_m] == e).all()
        assert sorted(sorted_ids[row : row + len(run)].tolist()) == run
        assert (sorted_ids[row + len(run) : row + padded] == num_pairs).all()
        row += padded
    assert row == rows_used


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m,expert_start,global_experts",
                         [(1, 1, 4, 16, 0, 4), (17, 2, 8, 16, 0, 8), (40, 4, 8, 32, 0, 8), (40, 4, 4, 16, 4, 12),
                          (33, 8, 16, 64, 0, 16), (50, 3, 4, 16, 0, 4)])
def test_align_layout(device, gen, monkeypatch, chunked, num_tokens, top_k, num_experts, block_m, expert_start,
                      global_experts):
    if chunked:  # the launches for many pairs, with programs of 16 pairs
        monkeypatch.setattr(moe_align, "ONE_PROGRAM_MAX_PAIRS", 0)
        monkeypatch.setattr(moe_align, "CHUNK", 16)
    ids, _ = routing(num_tokens, top_k, global_experts, gen, device)
    if num_tokens == 50:
        ids[ids == 2] = 1  # an expert nobody chose
    align = moe_align_block_size(ids, num_experts, block_m, expert_start)
    _check_layout(align, ids, num_experts, block_m, expert_start)


def test_config_table_picks_nearest_token_count(tmp_path):
    table = {"1": MoeConfig(16, GemmConfig(32, 128, 1, 4, 4), GemmConfig(64, 128, 1, 4, 4)),
             "64": MoeConfig(32, GemmConfig(64, 64, 1, 4, 3), GemmConfig(64, 64, 1, 4, 3)),
             "1024": MoeConfig(64, GemmConfig(128, 64, 8, 8, 3), GemmConfig(128, 64, 8, 8, 3))}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"configs": {m: c.to_json() for m, c in table.items()}}))
    loaded = fm._tuned_table(path)
    assert [fm.nearest_config(loaded, m).block_m for m in (1, 20, 40, 500, 600, 9000)] == [16, 16, 32, 32, 64, 64]
    assert fm._tuned_table(tmp_path / "missing.json") is None


def test_packaged_tables_parse():
    """The measured tables shipped with the package load, and are named as get_config looks them up."""
    for path in fm.CONFIG_DIR.glob("*.json"):
        table = fm._tuned_table(path)
        assert table, path
        e, h, i = (int(part.split("=")[1]) for part in path.name.split(",")[:3])
        device = path.stem.split("device=")[1]
        assert fm.config_file(e, h, i, device) == path


def test_tuner_search_space():
    """scripts/tune_fused_moe.py: decode sizes try only 16-row blocks, large M only wide ones, and every candidate
    fits in shared memory with tiles tl.dot takes (>= 16)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "scripts" / "tune_fused_moe.py"
    spec = importlib.util.spec_from_file_location("tune_fused_moe", path)
    tuner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tuner)
    qwen = tuner.Shape(**tuner.PRESETS["qwen3-30b-a3b"], ep_size=1)
    assert all(tuner.block_m_candidates(m, qwen) == [16] for m in (1, 8, 128))
    assert tuner.block_m_candidates(8192, qwen) == [64, 128]
    for m in tuner.TOKENS:
        for bm in tuner.block_m_candidates(m, qwen):
            for n, k, tiles in ((qwen.inter, qwen.hidden, 2), (qwen.hidden, qwen.inter, 1)):
                cfgs = tuner.gemm_candidates(bm, n, k, tiles)
                assert cfgs and len(set(cfgs)) == len(cfgs)
                for c in cfgs:
                    assert min(c.block_n, c.block_k) >= 16
                    assert c.num_stages * (bm * c.block_k + tiles * c.block_n * c.block_k) * 2 <= tuner.SHARED_MEMORY
