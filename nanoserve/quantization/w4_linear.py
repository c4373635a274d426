"""W4LinearMethod: a 4-bit scheme's parameters on a layers.linear.Linear, their loaders, and its forward.

Before loading, the layer's `weight` gives way to its format's checkpoint tensors (w4_formats.py), each a parameter
of this rank's share with a loader that reads that share from the file: a stacked shard's rows of a column-parallel
layer (q/k/v, gate/up; all input columns), a row-parallel layer's input columns (o_proj, down_proj; all rows), with
the groups and packed entries those cover. Per-shard tensors without a row dimension (g_idx, weight_shape) stack one
row per shard. Scales load as fp32, exactly.

After loading, `process_weights` converts them to the W4 layout (w4_packing.py) that the forward runs, whatever the
format: unpacked, rows of the weight sorted by group where g_idx says act-order (the permutation kept as `perm`),
packed GPTQ-style along the input columns; scales stored in the narrowest of the activation dtype, fp16 and bf16 that
holds them exactly. Checkpoint parameters are dropped.

The forward: on CUDA, kernels/w4a16_gemm.py's w4a16_linear (int4 unpacked in registers: one row by
kernels/w4a16_gemv.py, which streams the packed weight once and has the last of a K split's programs sum it, counting
arrivals in the layer's `split_counters`; a tensor-core GEMM above); elsewhere the weight dequantized to the
activation dtype and PyTorch's GEMM (the reference, fp32 on the CPU).
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kernels.w4a16_reference import dequantize_w4
from nanoserve.layers.linear import Linear
from nanoserve.quantization.w4_formats import G_IDX, SCALES, W4Weights, checkpoint_tensors, param_dtype, to_w4
from nanoserve.quantization.w4_packing import PACK, pack
from nanoserve.quantization.w4_scheme import W4Scheme

# --load-format dummy: random 4-bit values times this scale are uniform-ish in +-0.02 about the zero point, as an
# unquantized dummy model's weights.
DUMMY_SCALE = 0.02 / 8


class _Share:
    """What one checkpoint tensor of a layer gives this rank: rows [n0, n0 + n) of N, written at row n_dest of the
    parameter; input columns [k0, k0 + k) of K and their groups [g0, g0 + g) of G; `index`: the shard's row in
    per-shard parameters."""

    def __init__(self, layer: Linear, scheme: W4Scheme, shard: str | None) -> None:
        self.N, self.K = layer.out_features, layer.in_features
        self.n0, self.n, self.n_dest, self.k0, self.k, self.index = 0, self.N, 0, 0, self.K, 0
        if shard is not None:  # a stacked shard of a column-parallel layer
            start, size, total = layer.shards[shard]
            self.n_dest, _ = layer.shard_offsets[shard]
            self.N, self.n0, self.n = total, start, size
            self.index = list(layer.shards).index(shard)
        elif hasattr(layer, "load_columns"):  # row-parallel: this rank's input columns
            self.K = layer.in_features * layer.tp.size
            self.k0, _ = layer.tp.shard(self.K)
        self.G = scheme.groups(self.K)
        per_channel = scheme.group_size == -1
        self.g0 = 0 if per_channel else self.k0 // scheme.group_size
        self.g = 1 if per_channel else self.k // scheme.group_size

    def size(self, dim: str) -> int:
        return {"n": self.N, "n/8": self.N // PACK, "k": self.K, "k/8": self.K // PACK, "g": self.G, "2": 2}[dim]

    def source(self, dim: str) -> slice:
        start, length = {"n": (self.n0, self.n), "k": (self.k0, self.k), "g": (self.g0, self.g), "2": (0, 2)}[dim[0]]
        per = PACK if dim.endswith("/8") else 1
        return slice(start // per, (start + length) // per)

    def dest(self, dim: str) -> slice:
        per = PACK if dim.endswith("/8") else 1
        return slice(self.n_dest // per, (self.n_dest + self.n) // per) if dim[0] == "n" else slice(None)


def _loader(layer: Linear, scheme: W4Scheme, name: str, dims: tuple[str, ...]):
    def load(param: nn.Parameter, loaded, shard: str | None = None) -> None:
        share = _Share(layer, scheme, shard)
        want = tuple(share.size(d) for d in dims)
        if tuple(loaded.get_shape()) != want:
            raise ValueError(f"has shape {tuple(loaded.get_shape())}, expected {want}")
        piece = loaded[tuple(share.source(d) for d in dims)]
        if name in G_IDX:  # as groups of this rank's columns
            piece = piece - share.g0
        if "n" in {d[0] for d in dims}:
            param.data[tuple(share.dest(d) for d in dims)].copy_(piece)
        else:
            param.data[share.index].copy_(piece)
    return load


def _checkpoint_shapes(layer: Linear, scheme: W4Scheme, dims: tuple[str, ...]):
    """For dummy weights (model/loader.py): (shard, whole checkpoint shape) of each tensor this parameter reads."""
    def shapes() -> list[tuple[str | None, tuple[int, ...]]]:
        shards = list(getattr(layer, "shards", None) or [None])
        return [(shard, tuple(_Share(layer, scheme, shard).size(d) for d in dims)) for shard in shards]
    return shapes


def _per_rank_shape(layer: Linear, scheme: W4Scheme, dims: tuple[str, ...]) -> tuple[int, ...]:
    n, k = layer.out_features, layer.in_features
    sizes = {"n": n, "n/8": n // PACK, "k": k, "k/8": k // PACK, "g": scheme.groups(k), "2": 2}
    shape = tuple(sizes[d] for d in dims)
    return shape if "n" in {d[0] for d in dims} else (len(getattr(layer, "shards", ())) or 1, *shape)


class W4LinearMethod:
    """The layers.linear.LinearMethod of a W4Scheme."""

    def __init__(self, scheme: W4Scheme) -> None:
        self.scheme = scheme

    # -- before loading -------------------------------------------------------------------------------------------
    def create_weights(self, layer: Linear, device: torch.device) -> None:
        """The checkpoint's tensors in place of `weight` (which may be on the meta device), on `device`, each with its
        loader and its dummy initialization."""
        layer.act_dtype = layer.weight.dtype  # the model's: the scales' first choice (_narrowest)
        del layer.weight
        for name, dims in checkpoint_tensors(self.scheme).items():
            param = nn.Parameter(torch.empty(_per_rank_shape(layer, self.scheme, dims), dtype=param_dtype(name),
                                             device=device), requires_grad=False)
            param.weight_loader = _loader(layer, self.scheme, name, dims)
            param.checkpoint_shapes = _checkpoint_shapes(layer, self.scheme, dims)
            if name in SCALES:
                param.dummy_value = DUMMY_SCALE
            elif name in G_IDX or name == "weight_shape" or (name == "qzeros" and self.scheme.symmetric):
                param.dummy_fill = self._dummy_fill(layer, name)
            layer.register_parameter(name, param)

    def _dummy_fill(self, layer: Linear, name: str):
        """Random weights' tensors that must be what a checkpoint would hold: groups in order, the shape, zero
        points of 8."""
        s = self.scheme

        def fill(param: nn.Parameter) -> None:
            if name in G_IDX:
                k = torch.arange(param.shape[1], device=param.device)
                param.data.copy_(k // s.group_size if s.group_size > 0 else torch.zeros_like(k))
            elif name == "weight_shape":
                for shard in getattr(layer, "shards", None) or [None]:
                    share = _Share(layer, s, shard)
                    param.data[share.index] = torch.tensor([share.N, share.K])
            else:
                nibble = 8 - s.zero_offset
                param.data.fill_(sum(nibble << (4 * j) for j in range(PACK)) - (1 << 32 if nibble >= 8 else 0))
        return fill

    # -- after loading --------------------------------------------------------------------------------------------
    def process_weights(self, layer: Linear, module: str = "") -> None:
        """The loaded tensors in the W4 layout (module docstring), and the layer's quant_method."""
        s = self.scheme
        names = checkpoint_tensors(s)
        loaded = {name: getattr(layer, name).data for name in names}
        if "weight_shape" in loaded:
            self._check_shape(layer, loaded["weight_shape"], module)
        w = to_w4(loaded, s, module)
        for name in names:
            delattr(layer, name)
        perm = self._act_order(w, layer.in_features, module)
        if perm is not None:
            w.q = w.q[perm]
        dtype = layer.act_dtype
        layer.qweight = nn.Parameter(pack(w.q, 0).contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(_narrowest(w.scales, dtype), requires_grad=False)
        layer.zeros = None if w.zeros is None else nn.Parameter(w.zeros.contiguous(), requires_grad=False)
        layer.perm = None if perm is None else nn.Parameter(perm.to(torch.int32), requires_grad=False)
        layer.group_size = s.group_size
        layer.register_buffer("split_counters", self._split_counters(layer.qweight), persistent=False)
        layer.quant_method = self

    @staticmethod
    def _split_counters(qweight: torch.Tensor) -> torch.Tensor | None:
        """The one-row kernel's arrival counters, on CUDA (elsewhere the forward is PyTorch's, and Triton may be
        absent; the interpreter's tests pass none). Made here, not at a first forward, which may be inside a CUDA
        graph's capture (the allocation and its zeroing would be captured with it)."""
        if not qweight.is_cuda:
            return None
        from nanoserve.kernels.w4a16_gemv import split_counters

        return split_counters(qweight.shape[1], qweight.device)

    def _check_shape(self, layer: Linear, shapes: torch.Tensor, module: str) -> None:
        for shard in getattr(layer, "shards", None) or [None]:
            share = _Share(layer, self.scheme, shard)
            if shapes[share.index].tolist() != [share.N, share.K]:
                raise ValueError(f"model: {module}.weight_shape is {shapes[share.index].tolist()}, expected "
                                 f"{[share.N, share.K]}")

    def _act_order(self, w: W4Weights, k: int, module: str) -> torch.Tensor | None:
        """The rows' order sorted by group, or None where they are in order already. Sorted, row i must be in group
        i // group_size, as a quantizer that took the columns in another order writes them."""
        if w.g_idx is None:
            return None
        g_idx = w.g_idx.long()
        perm = torch.argsort(g_idx, stable=True)
        rows = torch.arange(k, device=g_idx.device)
        want = rows // self.scheme.group_size if self.scheme.group_size > 0 else torch.zeros_like(rows)
        if not torch.equal(g_idx[perm], want):
            raise ValueError(f"model: {module}'s g_idx does not give each group {self.scheme.group_size} input "
                             "columns")
        return None if torch.equal(perm, rows) else perm

    # -- forward --------------------------------------------------------------------------------------------------
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.apply_kernel(layer, x)
        perm = layer.perm.data if layer.perm is not None else None
        if perm is not None:
            x = x[..., perm]
        w = dequantize_w4(layer.qweight, layer.scales, layer.zeros, layer.group_size).to(x.dtype)
        # [N, K] contiguous, as an unquantized layer's weight: the same GEMM, so the same sums.
        return F.linear(x, w.t().contiguous(), layer.bias)

    def apply_kernel(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """The CUDA forward: kernels/w4a16_gemm.py (the CPU tests call it under the Triton interpreter)."""
        from nanoserve.kernels.w4a16_gemm import w4a16_linear

        zeros = layer.zeros.data if layer.zeros is not None else None
        perm = layer.perm.data if layer.perm is not None else None
        y = w4a16_linear(x.reshape(-1, x.shape[-1]), layer.qweight, layer.scales, zeros, perm, layer.group_size,
                         layer.bias, layer.split_counters)
        return y.view(*x.shape[:-1], -1)


def _narrowest(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scales in the first of dtype, fp16, bf16 that holds every one exactly, else fp32: the kernel reads them
    per group, and fewer bytes are less to stream."""
    for candidate in (dtype, torch.float16, torch.bfloat16):
        narrowed = scales.to(candidate)
        if torch.equal(narrowed.float(), scales.float()):
            return narrowed.contiguous()
    return scales.float().contiguous()
