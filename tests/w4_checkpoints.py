"""4-bit checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) written from the small random checkpoints of
tests/checkpoints.py, and beside each a dense fp32 checkpoint of the very weights the 4-bit one stores: each
projection's weight quantized round-to-nearest per group of input columns, packed as each format defines it.

Written from the formats' definitions, independently of nanoserve/quantization/, so that the engine is checked
against the formats rather than against itself:
- GPTQ: qweight int32 [K / 8, N], input rows 8i..8i+7 of the unsigned values at bits 0, 4, .., 28 of entry i;
  qzeros int32 [G, N / 8] packed the same way along the output columns, holding each zero point minus one in the
  original format ("gptq") and as it is in "gptq_v2"; scales fp16 [G, N]; g_idx int32 [K], each input column's
  group (act-order: the quantizer took the columns in another order, g_idx[perm[i]] = i // group_size);
- AWQ (GEMM): qweight int32 [K, N / 8] and qzeros [G, N / 8] packed along the output columns, the value at bits 4j
  of entry c being column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[j]; scales fp16 [G, N];
- compressed-tensors: weight_packed int32 [N, K / 8], the signed values (-8..7) plus 8 packed along the input
  columns; weight_scale [N, G] (bf16 here); weight_zero_point int32 [N / 8, G], signed zero points plus 8 packed
  along the output rows (asymmetric only); weight_shape [N, K]; weight_g_idx [K] (actorder "group").
W = (q - z) * s for unsigned q and z (compressed-tensors: signed q - signed z, the same numbers).
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class W4Format:
    """method: gptq | awq | compressed-tensors; group_size -1: one group per row; gptq_format: gptq | gptq_v2;
    ignore: module name parts left unquantized (compressed-tensors' ignore, the others' modules_to_not_convert)."""

    method: str
    group_size: int = 32
    symmetric: bool = True
    act_order: bool = False
    gptq_format: str = "gptq"
    ignore: tuple[str, ...] = ()

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.method == "compressed-tensors" else torch.float16

    def quantization_config(self) -> dict:
        if self.method == "gptq":
            return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "desc_act": self.act_order,
                    "sym": self.symmetric, "checkpoint_format": self.gptq_format, "damp_percent": 0.01,
                    "static_groups": False, "true_sequential": True,
                    "modules_to_not_convert": list(self.ignore) or None}
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "version": "gemm",
                    "zero_point": True, "modules_to_not_convert": list(self.ignore) or None}
        weights = {"num_bits": 4, "type": "int", "symmetric": self.symmetric, "dynamic": False,
                   "strategy": "channel" if self.group_size == -1 else "group",
                   "group_size": None if self.group_size == -1 else self.group_size,
                   "actorder": "group" if self.act_order else None, "observer": "minmax", "block_structure": None}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None, "format": "pack-quantized"}},
                "ignore": ["lm_head", *self.ignore], "kv_cache_scheme": None}


def _pack(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Values 0..15 [..., 8m] -> int32 [..., m]: value 8c + order[j] of each eight at bits 4j of entry c."""
    v = values.to(torch.int64).unflatten(-1, (-1, 8))[..., list(order)]
    word = sum(v[..., j] << (4 * j) for j in range(8))
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def group_index(k: int, fmt: W4Format, gen: torch.Generator) -> torch.Tensor:
    """Each input column's group: in order, or (act-order) in a random order of the columns."""
    if fmt.group_size == -1:
        return torch.zeros(k, dtype=torch.int64)
    if not fmt.act_order:
        return torch.arange(k) // fmt.group_size
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // fmt.group_size
    return g_idx


def quantize(w: torch.Tensor, g_idx: torch.Tensor, fmt: W4Format) -> tuple[torch.Tensor, ...]:
    """w [N, K] -> unsigned q [N, K], zero points z [N, G], scales s [N, G] (fmt.scale_dtype) and the dequantized
    weight (q - z) * s in fp32, by min/max round to nearest per group."""
    groups = int(g_idx.max()) + 1
    n, k = w.shape
    grouped = w[:, torch.argsort(g_idx, stable=True)].view(n, groups, k // groups)
    lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    if fmt.symmetric:
        s, z = 2 * torch.maximum(-lo, hi) / 15, torch.full((n, groups), 8)
    else:
        s = (hi - lo) / 15
        # GPTQ's original format stores z - 1, so its zero points are 1..15.
        z = (-lo / s).round().clamp(1 if fmt.gptq_format == "gptq" else 0, 15).to(torch.int64)
    s = s.to(fmt.scale_dtype)
    se, ze = s.float()[:, g_idx], z[:, g_idx]
    q = ((w / se).round() + ze).clamp(0, 15).to(torch.int64)
    return q, z, s, (q - ze).float() * se


def format_tensors(q, z, s, g_idx, fmt: W4Format) -> dict[str, torch.Tensor]:
    """One module's checkpoint tensors (quantize's q, z, s and the g_idx it took), as the format stores them."""
    n, k = q.shape
    if fmt.method == "gptq":
        zeros = z.t() - (1 if fmt.gptq_format == "gptq" else 0)
        return {"qweight": _pack_rows(q.t()), "qzeros": _pack(zeros), "scales": s.t().contiguous(),
                "g_idx": g_idx.to(torch.int32)}
    if fmt.method == "awq":
        return {"qweight": _pack(q.t(), AWQ_ORDER), "qzeros": _pack(z.t(), AWQ_ORDER), "scales": s.t().contiguous()}
    out = {"weight_packed": _pack(q), "weight_scale": s.contiguous(), "weight_shape": torch.tensor([n, k])}
    if not fmt.symmetric:
        out["weight_zero_point"] = _pack_rows(z)
    if fmt.act_order:
        out["weight_g_idx"] = g_idx.to(torch.int32)
    return out


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """Packed along the first dimension: rows 8i..8i+7 into row i."""
    return _pack(values.t()).t().contiguous()


def _quantized_module(key: str, fmt: W4Format) -> str | None:
    module = key.removesuffix(".weight")
    ignored = any(f".{entry}." in f".{module}." for entry in fmt.ignore)
    if key.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS and not ignored:
        return module
    return None


def write_w4_checkpoint(src: Path, dst: Path, fmt: W4Format, seed: int = 0) -> tuple[Path, Path, dict]:
    """(the 4-bit checkpoint, the dense fp32 one of its dequantized weights, module -> dequantized weight)."""
    gen = torch.Generator().manual_seed(seed)
    quantized, dense = dst / "w4", dst / "dense"
    for d in (quantized, dense):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, d / f.name)
    tensors, dense_tensors, weights, orders = {}, {}, {}, {}
    for key, t in load_file(src / "model.safetensors").items():
        module = _quantized_module(key, fmt)
        if module is None:
            tensors[key] = dense_tensors[key] = t
            continue
        # Modules that read one input (q/k/v, gate/up) share its Hessian, so act-order gives them one column order.
        shared = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        g_idx = orders.setdefault(shared, group_index(t.shape[1], fmt, gen))
        q, z, s, w = quantize(t.float(), g_idx, fmt)
        tensors.update({f"{module}.{name}": v.contiguous() for name, v in format_tensors(q, z, s, g_idx, fmt).items()})
        dense_tensors[key] = weights[module] = w
    save_file(tensors, quantized / "model.safetensors")
    save_file(dense_tensors, dense / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = fmt.quantization_config()
    (quantized / "config.json").write_text(json.dumps(config, indent=1))
    return quantized, dense, weights
