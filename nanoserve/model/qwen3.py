"""Qwen3: the Llama layout plus an RMSNorm on each query and key head before rotary."""

from nanoserve.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
