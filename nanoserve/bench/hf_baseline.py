"""Hugging Face transformers generate on the same architecture and workload, for side-by-side ratios."""

import time

import torch


def hf_model(model_dir: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    # Random weights of the same shapes: the speed of generate does not depend on their values.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


@torch.inference_mode()
def hf_generate_seconds(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int = 0) -> float:
    """One left-padded batch through generate, no early stop; returns wall seconds."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                   min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
