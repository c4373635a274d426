"""Which class runs which `architectures` entry of config.json.

Classes are named, not imported, here: the engine checks a checkpoint's architecture (engine/frontend.py's
engine_config) before config.py reads the rest of config.json, with no model module loaded yet.
"""

import importlib

from torch import nn

# architecture -> (module, class)
MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("nanoserve.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("nanoserve.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("nanoserve.model.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("nanoserve.model.qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("nanoserve.model.moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("nanoserve.model.moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("nanoserve.model.moe", "MixtralForCausalLM"),
    "GptOssForCausalLM": ("nanoserve.model.gpt_oss", "GptOssForCausalLM"),
    "Gemma2ForCausalLM": ("nanoserve.model.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("nanoserve.model.gemma", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("nanoserve.model.gemma", "Gemma3ForConditionalGeneration"),
    "Phi3ForCausalLM": ("nanoserve.model.phi3", "Phi3ForCausalLM"),
}
# Draft heads: loaded only as a speculative_config's model (worker/eagle3.py), never served on their own.
DRAFT_HEADS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLMEagle3": ("nanoserve.model.llama_eagle3", "Eagle3LlamaForCausalLM"),
}


def check_architecture(architecture: str) -> None:
    if architecture not in MODELS:
        raise ValueError(f"model: architecture {architecture!r} is not supported; supported: {', '.join(MODELS)}")


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in DRAFT_HEADS:
        check_architecture(architecture)
    module, name = (MODELS | DRAFT_HEADS)[architecture]
    return getattr(importlib.import_module(module), name)
