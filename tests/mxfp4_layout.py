"""Random MXFP4 expert weights: in the kernels' layout (nanoserve/kernels/mxfp4_unpack.py), and a gpt-oss checkpoint
with its experts in MXFP4 as OpenAI ships them, for the MXFP4 tests."""

import json
from pathlib import Path

import torch
from checkpoints import write_checkpoint
from safetensors.torch import load_file, save_file

from nanoserve.quantization.mxfp4 import dequantize_mxfp4


def random_mxfp4(num_experts: int, n: int, k: int, gen: torch.Generator, scales: tuple[int, int] = (120, 130)):
    """(w [E, N, K / 2] uint8 of random bits, scale [E, N, K / 32] uint8 in scales' range, inclusive, and the
    values they hold, fp32 [E, N, K])."""
    w = torch.randint(0, 256, (num_experts, n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(scales[0], scales[1] + 1, (num_experts, n, k // 32), dtype=torch.uint8, generator=gen)
    values = dequantize_mxfp4(w.view(num_experts, n, k // 32, 16), scale, torch.float32)
    return w, scale, values


def write_mxfp4_checkpoint(path: Path, **overrides) -> Path:
    """tests/checkpoints.py's gpt-oss with every expert projection replaced by random MXFP4 blocks and scales."""
    path = write_checkpoint(path, "gpt_oss", **overrides)
    (file,) = path.glob("*.safetensors")
    tensors, g = load_file(file), torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors.pop(name).shape  # the bf16 form is [E, in, out]; MXFP4 rows are out, blocks along in
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=g)
        # Scales near 2^-3 keep activations in range through the layers.
        tensors[f"{name}_scales"] = torch.randint(120, 126, (e, n, k // 32), dtype=torch.uint8, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return path
