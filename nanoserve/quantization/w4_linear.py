"""W4LinearMethod: a 4-bit scheme's parameters on a layers.linear.Linear, their loaders, and its forward.

Before loading, the layer's `weight` gives way to its format's checkpoint tensors (w4_formats.py), each a parameter
of this rank's share with a loader that reads that share from the file: a stacked shard's rows of a column-parallel
layer (q/k/v, gate/up; all input columns), a row-parallel layer's input columns (o_proj, down_proj; all rows), with
the groups and packed entries those cover (with act-order, whose g_idx puts those columns in any group, every
group's scales and zero points, as vLLM does). Per-shard tensors without a row dimension (g_idx, weight_shape) stack
one row per shard. Scales load as fp32, exactly.

After loading, `process_weights` converts them to the W4 layout (w4_packing.py) that the forward runs, whatever the
format: unpacked, rows of the weight sorted by group where g_idx says act-order (the permutation kept as `perm`;
under tensor parallelism a rank's rows of a group padded to whole groups, _sort_by_group), packed GPTQ-style along the
input columns; scales stored in the narrowest of the activation dtype, fp16 and bf16 that holds them exactly.
Checkpoint parameters are dropped.

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
        if scheme.group_size == -1 or scheme.act_order:
            # g_idx may put a rank's input columns in any group: every rank keeps them all (vLLM repeats them too).
            self.g0, self.g = 0, self.G
        else:
            self.g0, self.g = self.k0 // scheme.group_size, self.k // scheme.group_size

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
        if "k/8" in dims and (share.k0 % PACK or share.k % PACK):
            raise ValueError(f"packs eight input columns an int32, which this rank's columns {share.k0}.."
                             f"{share.k0 + share.k - 1} of {share.K} cut (tensor parallelism)")
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
    groups = _Share(layer, scheme, next(iter(getattr(layer, "shards", None) or [None]))).g
    sizes = {"n": n, "n/8": n // PACK, "k": k, "k/8": k // PACK, "g": groups, "2": 2}
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
            if name in G_IDX:  # as the loader gives them: groups of the rank's scales (_Share.g0)
                share = _Share(layer, s, None)
                k = share.k0 + torch.arange(param.shape[1], device=param.device)
                param.data.copy_(k // s.group_size - share.g0 if s.group_size > 0 else torch.zeros_like(k))
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
        perm, group_size = _sort_by_group(w, s.group_size, module) if w.g_idx is not None else (None, s.group_size)
        dtype = layer.act_dtype
        layer.qweight = nn.Parameter(pack(w.q, 0).contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(_narrowest(w.scales, dtype), requires_grad=False)
        layer.zeros = None if w.zeros is None else nn.Parameter(w.zeros.contiguous(), requires_grad=False)
        layer.perm = None if perm is None else nn.Parameter(perm.to(torch.int32), requires_grad=False)
        layer.group_size = group_size
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

    # -- forward --------------------------------------------------------------------------------------------------
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.apply_kernel(layer, x)
        perm = layer.perm.data if layer.perm is not None else None
        if perm is not None:
            x = _permuted(x, perm)
        w = dequantize_w4(layer.qweight, layer.scales, layer.zeros, layer.group_size).to(x.dtype)
        # [N, K] contiguous, as an unquantized layer's weight: the same GEMM, so the same sums.
        return F.linear(x, w.t().contiguous(), layer.bias)

    def apply_kernel(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """The CUDA forward: kernels/w4a16_gemm.py (the CPU tests call it under the Triton interpreter)."""
        from nanoserve.kernels.w4a16_gemm import w4a16_linear

        zeros = layer.zeros.data if layer.zeros is not None else None
        perm = layer.perm.data if layer.perm is not None else None
        if perm is not None and perm.numel() != x.shape[-1]:  # padded rows: the kernels read K columns of x
            x, perm = _permuted(x, perm).contiguous(), None
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


def _sort_by_group(w: W4Weights, group_size: int, module: str) -> tuple[torch.Tensor | None, int]:
    """w's rows (with its scales and zero points) reordered so that row k is in group k // size, as the W4 layout
    wants (w4_packing.py): (perm, size), perm None where the rows were in order already.

    A whole layer's g_idx gives each group group_size input columns, which sorted by group fill the groups exactly.
    A rank's share of a row-parallel layer's columns (tensor parallelism) falls in any of its groups, a few columns in
    each: then each group's rows fill groups of `size` rows, its scales and zero points repeated in each, the last
    padded with rows of q = z (zero weight) whose perm is K, a column of zeros _permuted appends to x. Of group_size
    and the powers of two from 16 below it, size is the one that keeps the fewest bytes: for columns in a random
    order (groups of 128, K 14336), 1.2 to 1.4 times a rank's share of rows at 2 to 8 ranks."""
    g_idx, groups = w.g_idx.long(), w.scales.shape[0]
    if group_size == -1:
        if bool(g_idx.any()):
            raise ValueError(f"model: {module}'s g_idx puts input columns in groups other than 0, but there is one")
        return None, group_size
    if bool(((g_idx < 0) | (g_idx >= groups)).any()):
        raise ValueError(f"model: {module}'s g_idx holds groups outside 0..{groups - 1}")
    counts = torch.bincount(g_idx, minlength=groups)
    if bool((counts > group_size).any()):
        raise ValueError(f"model: {module}'s g_idx gives a group more than {group_size} input columns")
    sizes = [group_size, *(1 << b for b in range(group_size.bit_length() - 1, 3, -1) if 1 << b < group_size)]
    zero_bytes = 0 if w.zeros is None else 1
    # Per output column: half a byte a row, two a group's scale (in 16 bits), one its zero point.
    size = min(sizes, key=lambda u: int((-(-counts // u)).sum()) * (u / 2 + 2 + zero_bytes))
    slots = -(-counts // size)  # the size-row groups each group fills
    owner = torch.repeat_interleave(torch.arange(groups, device=g_idx.device), slots)
    order = torch.argsort(g_idx, stable=True)
    sorted_groups = g_idx[order]
    rank_in_group = torch.arange(len(order), device=g_idx.device) - (torch.cumsum(counts, 0) - counts)[sorted_groups]
    dest = (torch.cumsum(slots, 0) - slots)[sorted_groups] * size + rank_in_group
    w.scales, w.zeros = w.scales[owner], None if w.zeros is None else w.zeros[owner]
    rows = owner.numel() * size
    if rows == len(order):  # no padding: dest is 0..K-1
        w.q = w.q[order]
        return (None if torch.equal(order, dest) else order), size
    # Zero points of 16 (GPTQ's original format) have no q = z: the padded rows' x is the zero column _permuted adds.
    fill = torch.full_like(w.scales, 8, dtype=torch.uint8) if w.zeros is None else w.zeros.clamp(max=15)
    q = fill.repeat_interleave(size, dim=0)
    q[dest] = w.q[order]
    perm = torch.full((rows,), len(order), dtype=torch.long, device=g_idx.device)
    perm[dest] = order
    w.q = q
    return perm, size


def _permuted(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x's columns in perm's order; a perm with padded rows (longer than x is wide: _sort_by_group) also takes the
    column of zeros it appends."""
    if perm.numel() != x.shape[-1]:
        x = F.pad(x, (0, 1))
    return x[..., perm]
