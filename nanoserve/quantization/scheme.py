"""FP8Scheme: how a model's linear weights are stored in float8_e4m3fn and how their inputs are quantized.

A weight W [out, in] is stored as q (float8_e4m3fn) and fp32 scales, W = q * scale, with one scale for the whole
tensor ("tensor"), one per output row ("channel"), or one per block of block[0] rows x block[1] columns ("block").
The activations x [tokens, in] that meet it are, before the product:
- "token": quantized per row at run time, scale = max|row| / 448 (dynamic per token);
- "tensor": quantized with the checkpoint's fixed input_scale (static per tensor);
- "group": quantized per row and per group of block[1] columns at run time (dynamic per token group, the
  block-wise checkpoints' scheme: DeepSeek-V3, Qwen3-FP8);
- None: not quantized (weight-only, W8A16).
"""

import re
from dataclasses import dataclass, field

import torch

WEIGHT_STRATEGIES = ("tensor", "channel", "block")
ACTIVATION_STRATEGIES = ("token", "tensor", "group", None)


def ignored(ignore: tuple[str, ...], name: str) -> bool:
    """Whether an ignore list names the checkpoint module `name`: by its name, a "re:"-prefixed regular expression,
    or dotted name parts ("lm_head", "mlp.down_proj")."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif f".{entry}." in f".{name}.":
            return True
    return False


@dataclass(frozen=True)
class FP8Scheme:
    """method: the quant_method it came from ("compressed-tensors", "fp8"); weights, activations: as in the
    module docstring; block: (rows, columns) of a weight-scale block; serialized: the checkpoint holds the fp8
    weights and scales (False: a bf16/fp16/fp32 checkpoint quantized while loading, `--quantization fp8`);
    scale_name: the checkpoint tensor of weight scales beside each `weight` (quant_method "fp8" with blocks calls
    it weight_scale_inv, though it multiplies as well); ignore: layers left unquantized, by checkpoint module name,
    "re:"-prefixed regular expressions, or dotted name parts ("lm_head", "mlp.down_proj")."""

    method: str
    weights: str
    activations: str | None
    block: tuple[int, int] | None = None
    serialized: bool = True
    scale_name: str = "weight_scale"
    ignore: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        assert self.weights in WEIGHT_STRATEGIES and self.activations in ACTIVATION_STRATEGIES
        assert (self.weights == "block") == (self.block is not None)
        assert self.activations != "group" or self.weights == "block"

    def describe(self) -> str:
        """For the start-up line and /v1/models, e.g. "fp8 (compressed-tensors): weights per channel, activations
        dynamic per token"."""
        weights = {"tensor": "per tensor", "channel": "per channel",
                   "block": f"per {self.block[0]}x{self.block[1]} block" if self.block else ""}[self.weights]
        acts = {"token": "dynamic per token", "tensor": "static per tensor",
                "group": f"dynamic per token group of {self.block[1] if self.block else 0}",
                None: "unquantized (weight-only)"}[self.activations]
        source = self.method if self.serialized else "quantized at load"
        return f"fp8 ({source}): weights {weights}, activations {acts}"

    def ignores(self, name: str) -> bool:
        """Whether the checkpoint module `name` (e.g. model.layers.0.mlp.down_proj) stays unquantized."""
        return ignored(self.ignore, name)

    @property
    def block_field(self) -> str:
        """The config.json field that set `block`."""
        if self.method == "fp8":
            return "quantization_config.weight_block_size"
        return "quantization_config.config_groups.*.weights.block_structure"


def runs_fp8(device: torch.device) -> bool:
    """Whether FP8 experts on `device` stay FP8 for the MoE kernels (else they are dequantized while loading): on
    CUDA, as mxfp4.runs_packed decides, where Triton converts e4m3 (compute capability 8.9 on: Ada, Hopper; an A100
    dequantizes them, as fp8_linear's skinny path leaves its fp8 weights there)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_experts_fit(block: tuple[int, int] | None, start: int, size: int, total: int) -> bool:
    """Whether a rank's share [start, start + size) of the experts' intermediate size `total` keeps whole blocks of
    scales (always, per row): gate's and up's rows of it, down's columns, start on a block and end on one or at
    `total`; and the blocks' columns are whole tiles of 16 (kernels/fp8_experts.py). Else that rank's FP8 experts are
    dequantized while loading (quantization/model.py)."""
    if block is None:
        return True
    return block[1] % 16 == 0 and all(start % b == 0 and (size % b == 0 or start + size == total) for b in block)
