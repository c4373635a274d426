"""Mixture-of-experts models against transformers through the engine's hard paths, and their loading rules."""

import json

import pytest
import torch
from checkpoints import write_checkpoint
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineArgs, MoEConfig
from nanoserve.layers.moe import SparseMoeBlock

MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def prompts() -> list[list[int]]:
    """A shared 40-token prefix (two full blocks of 16) and suffixes of mixed lengths."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(2, 384, (40,), generator=g).tolist()
    return [system + torch.randint(2, 384, (n,), generator=g).tolist() for n in (1, 9, 30, 61)]


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_case(request, checkpoints):
    path = checkpoints[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = []
    for p in prompts():
        out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        reference.append(out[0, len(p):].tolist())
    return path, reference


def run(llm: LLM, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


def test_layers_are_sparse_where_the_config_says(checkpoints):
    llm = LLM(str(checkpoints["qwen3_moe"]), num_kv_blocks=32)
    mlps = [layer.mlp for layer in llm.engine.runner.model.model.layers]
    assert [isinstance(m, SparseMoeBlock) for m in mlps] == [True, False]  # mlp_only_layers=[1]
    assert mlps[0].experts.w13.shape == (8, 64, 64)


def test_prefix_hits_and_preemption_match_transformers(moe_case):
    path, reference = moe_case
    llm = LLM(str(path), num_kv_blocks=12, max_num_batched_tokens=512)
    assert run(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert run(llm) == reference  # again, from the prefix cache
    assert llm.engine.block_manager.prefix_hits > 0


def test_chunked_prefill_and_async_scheduling_match_transformers(moe_case):
    path, reference = moe_case
    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=13, async_scheduling=True)
    assert run(llm) == reference


def test_n_samples_fork_from_one_prefill(moe_case):
    path, reference = moe_case
    llm = LLM(str(path), num_kv_blocks=128)
    params = SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    assert [[s.token_ids for s in o.outputs] for o in outs] == [[r, r] for r in reference]


def test_random_weights_route_every_expert(tmp_path, checkpoints):
    """--load-format dummy fills every expert (none left as torch.empty's garbage) and routes over all of them."""
    llm = LLM(str(checkpoints["mixtral"]), load_format="dummy", num_kv_blocks=32)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert torch.isfinite(experts.w13).all() and torch.isfinite(experts.w2).all()
    assert all(experts.w13[e].abs().sum() > 0 and experts.w2[e].abs().sum() > 0 for e in range(4))


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_checkpoint(tmp_path / "m", "mixtral")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.w13 \(up:3\)"):
        LLM(str(path), num_kv_blocks=32)


def test_moe_config_fields():
    raw = {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
           "intermediate_size": 6144, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3],
           "norm_topk_prob": True}
    moe = MoEConfig.from_raw(raw)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob) == (128, 8, 768, True)
    assert moe.sparse_layers == [False, True, False, False, False, True]
    mixtral = MoEConfig.from_raw({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
                                  "intermediate_size": 14336, "num_hidden_layers": 2})
    assert (mixtral.intermediate_size, mixtral.norm_topk_prob, mixtral.sparse_layers) == (14336, True, [True, True])
    assert MoEConfig.from_raw({"num_hidden_layers": 2}) is None


def test_expert_parallel_needs_experts(checkpoints):
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM has no experts"):
        EngineArgs(model=str(checkpoints["llama"]), enable_expert_parallel=True).create_config()


@pytest.mark.parametrize("expert_parallel, field", [(False, "moe_intermediate_size 32"), (True, "num_experts 8")])
def test_uneven_expert_splits_are_refused(tmp_path, checkpoints, expert_parallel, field):
    path = tmp_path / "odd"
    path.mkdir()
    raw = json.loads((checkpoints["qwen3_moe"] / "config.json").read_text())
    raw["num_attention_heads"], raw["num_key_value_heads"], raw["vocab_size"] = 3, 3, 384 * 3
    (path / "config.json").write_text(json.dumps(raw))
    args = EngineArgs(model=str(path), tensor_parallel_size=3, enable_expert_parallel=expert_parallel)
    with pytest.raises(ValueError, match=f"tensor_parallel_size: 3 does not divide the model's .*{field}"):
        args.create_config()
