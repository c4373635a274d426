"""gpt-oss: the Llama layout with attention sinks (a learned logit per head in the softmax's denominator), sliding-
window attention on the layers config.json's layer_types marks "sliding_attention", biases on q/k/v/o, YaRN rope, and
an MoE MLP in every layer: a router with a bias, top-k then softmax over the chosen logits (the renormalized softmax),
and experts with biases and a clamped SwiGLU (kernels/moe_reference.py's "swigluoai").

Checkpoints as transformers writes them in bf16: each layer's experts stacked in one tensor per projection,
gate_up_proj [E, H, 2I] with gate and up in alternate columns, down_proj [E, I, H], and their biases. Or as OpenAI
ships them, the experts in MXFP4 (`gate_up_proj_blocks` [E, 2I, H/32, 16], `gate_up_proj_scales` [E, 2I, H/32],
`down_proj_blocks` [E, H, I/32, 16], ...: rows are output features, gate and up in alternate rows). On CUDA these stay
packed (quantization/mxfp4.py's runs_packed): w13 [E, 2I, H/2] and w2 [E, H, I/2] uint8 with w13_scale [E, 2I, H/32]
and w2_scale [E, H, I/32] (kernels/mxfp4_unpack.py's layout), each rank's share sliced from the bytes; on the CPU
they are dequantized while loading.
"""

import torch
from torch import nn

from nanoserve.config import ModelConfig
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.kernels.moe_reference import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from nanoserve.layers.moe import FusedMoE, SparseMoeBlock
from nanoserve.model.llama import LlamaForCausalLM
from nanoserve.quantization.mxfp4 import BLOCK, dequantize_mxfp4

# checkpoint name -> (GptOssExperts' parameter, shard)
_EXPERT_TENSORS = {"gate_up_proj_bias": ("w13_bias", "gate_up"), "down_proj_bias": ("w2_bias", "down"),
                   "gate_up_proj": ("w13", "gate_up"), "down_proj": ("w2", "down")}
_MXFP4_TENSORS = {f"{theirs}_{part}": (ours, f"{shard}_{part}") for theirs, (ours, shard) in _EXPERT_TENSORS.items()
                  if not theirs.endswith("_bias") for part in ("blocks", "scales")}
# Random scales for dummy weights: 2^-8 puts MXFP4's random values (up to 6) about where the bf16 dummy weights are.
DUMMY_SCALE = 119


class GptOssExperts(FusedMoE):
    """FusedMoE loaded from gpt-oss's stacked tensors: shard "gate_up" of w13 and w13_bias (columns 2i and 2i + 1 of
    the checkpoint are gate row i and up row i), shard "down" of w2 and w2_bias (transposed); or the MXFP4 shards
    "gate_up_blocks", "gate_up_scales" of w13 and "down_blocks", "down_scales" of w2, packed or dequantized."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallelGroup,
                 expert_parallel: bool, top_k: int) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, tp, expert_parallel, top_k, "swigluoai")
        # A bias per expert on gate/up and on down; the down bias is held by the rank with the first slice of I (or,
        # under expert parallelism, by each expert's rank), so that the all-reduce adds it once.
        local_experts, local_inter = self.w2.shape[0], self.local_inter
        self.w13_bias = nn.Parameter(torch.empty(local_experts, 2 * local_inter), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(local_experts, hidden_size), requires_grad=False)
        for param in (self.w13, self.w13_bias, self.w2, self.w2_bias):
            param.weight_loader = self.load_stacked
        self.mxfp4 = False
        self._mxfp4_parts: dict[str, torch.Tensor] = {}  # a projection's blocks or scales until both are read

    def expect_mxfp4(self, packed: bool, device: torch.device) -> None:
        """The checkpoint holds w13 and w2 in MXFP4 (blocks and scales, quantization/mxfp4.py). packed: keep them so,
        w13 and w2 (uint8) and w13_scale and w2_scale allocated on `device`; else dequantize them while loading."""
        self.mxfp4 = True
        if not packed:
            return
        h, local_i = self.hidden_size, self.local_inter
        if h % BLOCK or local_i % BLOCK:
            # gpt-oss-120b's I = 2880 at TP=4 is 720 a rank: w2's blocks of 32 columns would be cut. Such a rank
            # dequantizes its share while loading, as on the CPU (4x the bytes, exact), rather than refuse
            # (prepare_model says so).
            return
        local_experts = self.w13.shape[0]
        shapes = {"w13": (local_experts, 2 * local_i, h // 2), "w13_scale": (local_experts, 2 * local_i, h // BLOCK),
                  "w2": (local_experts, h, local_i // 2), "w2_scale": (local_experts, h, local_i // BLOCK)}
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=device), requires_grad=False)
            if name.endswith("_scale"):
                param.dummy_value = DUMMY_SCALE  # random bytes would be scales up to 2^128
            else:
                param.weight_loader = self.load_stacked
            setattr(self, name, param)

    @property
    def packed(self) -> bool:
        return self.w13_scale is not None

    def expected_shards(self) -> dict[str, list[str]]:
        if self.mxfp4:  # the scales are loaded through w13 and w2 (the checkpoint names map there)
            return {"w13": ["gate_up_blocks", "gate_up_scales"], "w13_bias": ["gate_up"],
                    "w2": ["down_blocks", "down_scales"], "w2_bias": ["down"]} | (
                        {"w13_scale": [], "w2_scale": []} if self.packed else {})
        return {"w13": ["gate_up"], "w13_bias": ["gate_up"], "w2": ["down"], "w2_bias": ["down"]}

    def checkpoint_shapes(self, param: nn.Parameter) -> list[tuple[str, tuple[int, ...]]]:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        shapes = {"w13": ("gate_up", (e, h, 2 * i)), "w13_bias": ("gate_up", (e, 2 * i)), "w2": ("down", (e, i, h)),
                  "w2_bias": ("down", (e, h))}
        if self.packed:  # random blocks (their scales are a constant, DUMMY_SCALE)
            shapes |= {"w13": ("gate_up_blocks", (e, 2 * i, h // BLOCK, BLOCK // 2)),
                       "w2": ("down_blocks", (e, h, i // BLOCK, BLOCK // 2))}
        return [next(shapes[name] for name, p in self.named_parameters(recurse=False) if p is param)]

    def reference_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.packed:
            return self.w13, self.w2
        return tuple(dequantize_mxfp4(w.unflatten(-1, (-1, BLOCK // 2)), s, dtype)
                     for w, s in ((self.w13, self.w13_scale), (self.w2, self.w2_scale)))

    def load_stacked(self, param: nn.Parameter, loaded, shard: str) -> None:
        experts = slice(self.expert_start, self.expert_start + param.shape[0])
        if shard.endswith(("_blocks", "_scales")):
            return self._load_mxfp4(param, loaded, shard, experts)
        (_, shape), = self.checkpoint_shapes(param)
        if tuple(loaded.get_shape()) != shape:
            raise ValueError(f"has shape {tuple(loaded.get_shape())}, expected {shape}")
        self._copy_stacked(param, loaded[experts], experts)

    def _load_mxfp4(self, param: nn.Parameter, loaded, shard: str, experts: slice) -> None:
        """Keep this rank's experts of blocks or scales: packed, their rows and blocks of this rank's share; else,
        with both, dequantize them into the bf16 layout."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        rows, cols = (2 * i, h) if param is self.w13 else (h, i)
        proj, _, part = shard.rpartition("_")
        shape = (e, rows, cols // BLOCK, BLOCK // 2) if part == "blocks" else (e, rows, cols // BLOCK)
        if tuple(loaded.get_shape()) != shape:
            raise ValueError(f"has shape {tuple(loaded.get_shape())}, expected {shape}")
        if self.packed:
            return self._copy_packed(param, loaded[experts], part)
        self._mxfp4_parts[shard] = loaded[experts]
        blocks, scales = (self._mxfp4_parts.get(f"{proj}_{p}") for p in ("blocks", "scales"))
        if blocks is None or scales is None:
            return
        del self._mxfp4_parts[f"{proj}_blocks"], self._mxfp4_parts[f"{proj}_scales"]
        # Dequantized on the parameter's device (a quarter of the bytes cross), [e, rows, cols] -> the bf16 form's
        # [e, cols, rows].
        values = dequantize_mxfp4(blocks.to(param.device), scales.to(param.device), param.dtype)
        self._copy_stacked(param, values.transpose(1, 2), experts)

    def _copy_packed(self, param: nn.Parameter, loaded: torch.Tensor, part: str) -> None:
        """loaded: this rank's experts of blocks [e, rows, G, 16] or scales [e, rows, G] (rows: output features).
        Kept as they are but for which rows (w13: this rank's rows i of gate then of up, the checkpoint's rows 2i and
        2i + 1) or which blocks along I (w2: this rank's share, whole blocks as expect_mxfp4 checked)."""
        start, local_i = self.inter_start, self.local_inter
        if param is self.w13:
            target = self.w13 if part == "blocks" else self.w13_scale
            rows = loaded[:, 2 * start:2 * (start + local_i)]
            loaded = torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1)
        else:
            target = self.w2 if part == "blocks" else self.w2_scale
            loaded = loaded[:, :, start // BLOCK:(start + local_i) // BLOCK]
        target.data.copy_(loaded.reshape(target.shape))

    def _copy_stacked(self, param: nn.Parameter, loaded: torch.Tensor, experts: slice) -> None:
        """loaded: this rank's experts of a checkpoint tensor in the bf16 form."""
        local_i, start = self.local_inter, self.inter_start
        if param is self.w2_bias:
            # Added once by the all-reduce: by every rank for its own experts, or by the first slice of I.
            param.data.copy_(loaded if start == 0 else torch.zeros_like(param))
        elif param is self.w2:
            param.data.copy_(loaded[:, start:start + local_i, :].transpose(1, 2))
        elif param is self.w13:  # this rank's rows i of gate and of up: checkpoint columns 2i and 2i + 1
            cols = loaded[:, :, 2 * start:2 * (start + local_i)]
            param.data.copy_(torch.cat([cols[..., 0::2], cols[..., 1::2]], dim=-1).transpose(1, 2))
        else:
            cols = loaded[:, 2 * start:2 * (start + local_i)]
            param.data.copy_(torch.cat([cols[..., 0::2], cols[..., 1::2]], dim=-1))


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_model_len: int, tp: TensorParallelGroup | None = None,
                 expert_parallel: bool = False) -> None:
        raw = config.raw
        if (raw.get("swiglu_alpha", SWIGLU_OAI_ALPHA), raw.get("swiglu_limit", SWIGLU_OAI_LIMIT)) != (
                SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT):
            raise ValueError(f"swiglu_alpha, swiglu_limit: only gpt-oss's {SWIGLU_OAI_ALPHA}, {SWIGLU_OAI_LIMIT} "
                             f"are supported, got {raw.get('swiglu_alpha')}, {raw.get('swiglu_limit')}")
        self.expert_parallel = expert_parallel
        super().__init__(config, max_model_len, tp)

    def attention_options(self, config: ModelConfig, layer: int) -> dict:
        return super().attention_options(config, layer) | {"sinks": True}

    def make_mlp(self, config: ModelConfig, layer: int, tp: TensorParallelGroup) -> nn.Module:
        moe = config.moe
        experts = GptOssExperts(moe.num_experts, config.hidden_size, moe.intermediate_size, tp, self.expert_parallel,
                                moe.top_k)
        return SparseMoeBlock(experts, renormalize=True, router_bias=True)

    def map_checkpoint_name(self, ckpt_name: str) -> tuple[str, str | None]:
        if ckpt_name.endswith(".self_attn.sinks"):
            return ckpt_name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        if ".mlp.router." in ckpt_name:
            return ckpt_name.replace(".mlp.router.", ".mlp.gate."), None
        for theirs, (ours, shard) in (_EXPERT_TENSORS | _MXFP4_TENSORS).items():
            if ckpt_name.endswith(f".mlp.experts.{theirs}"):
                return ckpt_name.replace(f".mlp.experts.{theirs}", f".mlp.experts.{ours}"), shard
        return super().map_checkpoint_name(ckpt_name)
