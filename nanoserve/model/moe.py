"""Mixture-of-experts models of the Llama layout: Qwen3-MoE (q/k norms), Qwen2-MoE (a gated shared expert beside the
routed ones) and Mixtral. Attention, norms and embeddings are Llama's (llama.py); the MLP of each sparse layer is
an MoE block (layers/moe.py), of the others (Qwen's mlp_only_layers, decoder_sparse_step) the dense MLP.
"""

import re

from torch import nn

from nanoserve.config import ModelConfig
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.layers.moe import FusedMoE, SparseMoeBlock
from nanoserve.model.llama import LlamaForCausalLM, LlamaMLP

# An expert projection's weight, or one of its quantized tensors (qweight, ...: quantization/moe_experts.py)
_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(\w+)$")


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True
    # checkpoint name of an expert's projection -> FusedMoE's shard
    expert_projections = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    # a checkpoint module name part -> ours
    renamed_modules: dict[str, str] = {}
    has_shared_expert = False

    def __init__(self, config: ModelConfig, max_model_len: int, tp: TensorParallelGroup | None = None,
                 expert_parallel: bool = False) -> None:
        self.expert_parallel = expert_parallel
        super().__init__(config, max_model_len, tp)

    def make_mlp(self, config: ModelConfig, layer: int, tp: TensorParallelGroup) -> nn.Module:
        moe = config.moe
        if not moe.sparse_layers[layer]:
            return LlamaMLP(config, tp)
        shared = (LlamaMLP(config, tp, moe.shared_expert_intermediate_size, reduce_results=False)
                  if self.has_shared_expert else None)
        experts = FusedMoE(moe.num_experts, config.hidden_size, moe.intermediate_size, tp, self.expert_parallel,
                           moe.top_k)
        return SparseMoeBlock(experts, moe.norm_topk_prob, shared)

    def map_checkpoint_name(self, ckpt_name: str) -> tuple[str, str | None]:
        for part, ours in self.renamed_modules.items():
            ckpt_name = ckpt_name.replace(f".{part}.", f".{ours}.")
        expert = _EXPERT_TENSOR.match(ckpt_name)
        if expert is None or expert[3] not in self.expert_projections:
            return super().map_checkpoint_name(ckpt_name)
        prefix, index, shard = expert[1], expert[2], self.expert_projections[expert[3]]
        part = "" if expert[4] == "weight" else f"#{expert[4]}"
        return f"{prefix}.{'w2' if shard == 'down' else 'w13'}", f"{shard}:{index}{part}"


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    qk_norm = False
    has_shared_expert = True


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    qk_norm = False
    expert_projections = {"w1": "gate", "w3": "up", "w2": "down"}
    renamed_modules = {"block_sparse_moe": "mlp"}
