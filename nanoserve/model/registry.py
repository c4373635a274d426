"""Which class runs which `architectures` entry of config.json."""

from torch import nn

from nanoserve.model.llama import LlamaForCausalLM
from nanoserve.model.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODELS:
        raise ValueError(f"architectures: {architecture!r} is not supported; supported: {', '.join(MODELS)}")
    return MODELS[architecture]
