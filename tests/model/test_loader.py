"""Checkpoint loading: sharded safetensors, clear errors for what is missing or unsupported."""

import json

import pytest
import torch
from checkpoints import write_checkpoint
from safetensors.torch import load_file, save_file

from nanoserve import LLM, SamplingParams


def test_sharded_checkpoint_loads(tmp_path, llama_dir):
    shard_dir = tmp_path / "sharded"
    write_checkpoint(shard_dir, "llama")
    tensors = load_file(shard_dir / "model.safetensors")
    (shard_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, shard_dir / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [[3, 4, 5, 6]]
    sharded = LLM(str(shard_dir), num_kv_blocks=16).generate(prompt, params, use_tqdm=False)
    whole = LLM(str(llama_dir), num_kv_blocks=16).generate(prompt, params, use_tqdm=False)
    assert sharded[0].outputs[0].token_ids == whole[0].outputs[0].token_ids


def test_missing_weights_and_files_are_named(tmp_path):
    d = write_checkpoint(tmp_path / "m", "qwen3")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj.weight \\(k\\)"):
        LLM(str(d))
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(d))


def test_unknown_architecture_is_named(tmp_path):
    d = write_checkpoint(tmp_path / "m", "llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model: architecture 'GPTBigCodeForCausalLM' is not supported"):
        LLM(str(d))


def test_dummy_weights_and_dtypes(llama_dir):
    llm = LLM(str(llama_dir), load_format="dummy", dtype="bfloat16", num_kv_blocks=16)
    assert llm.engine.runner.model.lm_head.weight.dtype == torch.bfloat16
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_chat_and_string_prompts(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "Hello world!"}], params, use_tqdm=False)[0]
    expected = llm.tokenizer.encode("<s>user: Hello world!</s><s>assistant:", add_special_tokens=False)
    assert out.prompt_token_ids == expected
    text_out = llm.generate("Hello world!", params, use_tqdm=False)[0]
    assert text_out.prompt == "Hello world!" and len(text_out.outputs[0].token_ids) == 5
    assert text_out.outputs[0].text == llm.tokenizer.decode(text_out.outputs[0].token_ids)
