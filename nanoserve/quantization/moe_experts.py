"""Quantized routed experts (Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints in FP8 or 4-bit): kept in FP8, or packed in
4 bits, on CUDA; dequantized while loading elsewhere.

A quantized mixture-of-experts checkpoint stores each expert's gate, up and down projection as the scheme stores a
linear layer (FP8: `weight` and its scales; GPTQ, AWQ, compressed-tensors: the packed tensors of w4_formats.py). The
loader names them by FusedMoE's shards, a part after '#' ('gate:3#weight_scale').

FP8 on CUDA (runs_fp8): keep_fp8 makes FusedMoE's w13 and w2 float8_e4m3fn and gives them fp32 scales, w13_scale and
w2_scale, in kernels/fp8_experts.py's layout: per row (a checkpoint's per-tensor scales expanded to its rows, its
per-channel ones as they are) or per block (quant_method fp8's weight_scale_inv, e.g. 128 x 128), stacked per local
expert as w13 and w2 are (gate's rows, or rows of blocks, then up's). Fp8ExpertLoader copies each rank's share of
the checkpoint's fp8 values and scales into them: under tensor parallelism its rows of I (w13) and columns (w2),
which with block scales must fall on whole blocks (fits_fp8; a split that cuts one dequantizes that rank's experts
while loading instead, as gpt-oss's MXFP4 does, prepare_model warning once); under expert parallelism its whole
experts. The MoE kernels (fused_moe, moe_gemv) convert the fp8 tiles to the activations' dtype in registers and scale
the products: weight-only. Random weights (--load-format dummy) are random fp8 values with scales of
fp8_linear.DUMMY_SCALE. So the experts take a byte a weight, plus 4 bytes a row or a block of scales.

4 bits on CUDA (runs_w4): keep_w4 makes w13 and w2 int32, eight 4-bit values along K an int32, with fp32 scales
w13_scale and w2_scale per group of columns (or per row) and, for an asymmetric checkpoint, uint8 zero points
w13_zeros and w2_zeros: kernels/w4_experts.py's layout, the one that GPTQ's, AWQ's and compressed-tensors' tensors
are all converted to. W4ExpertLoader gathers an expert projection's tensors, converts them (w4_formats.to_w4) and
copies this rank's share: its rows of I (w13), its columns and groups of I (w2), which must be whole groups and whole
int32s (fits_w4; a split that cuts one dequantizes instead, prepare_model warning once). Act-order experts (g_idx:
a column's group is not k // group_size) have no kernel and are dequantized too, with the same warning. Random
weights are random int32s (every nibble a valid value), scales of w4_linear.DUMMY_SCALE and zero points of 8. So the
experts take half a byte a weight, plus 4 bytes a group of scales (and a byte of zero point).

Elsewhere (the CPU: the PyTorch reference path), and where the kernels cannot take them, ExpertDequantizer gathers an
expert projection's tensors as the loader reads them and, once the last has come, turns them into the weight they
define (fp8_math.dequantize_weight; W = (q - z) * s for 4 bits), rounded to the model's dtype, and hands it to
FusedMoE.load_expert like an unquantized checkpoint's tensor (which takes this rank's share). That costs the
format's memory: 2x the FP8 bytes, about 3.8x the 4-bit ones.

All compute with exactly the checkpoint's weights (dequantized: up to the model dtype's rounding, exact for FP8
values times a power-of-two scale in bf16, and on the CPU's fp32). Neither quantizes the experts' inputs: an FP8 W8A8
checkpoint's activation scheme (static input_scale, read and dropped; dynamic per token or per token group) is not
applied to the experts, which run W8A16: more exact than the format, not bit-equal to it. The router stays
unquantized, as the published checkpoints keep it (SparseMoeBlock marks it); the attention and a shared expert are
linear layers, quantized as in a dense model.
"""

import torch
from torch import nn

from nanoserve.kernels.fp8_experts import scale_shape, stacked_scale_shape
from nanoserve.kernels.w4_experts import w4_shapes, weight_block
from nanoserve.layers.moe import FusedMoE
from nanoserve.quantization.fp8_linear import DUMMY_SCALE
from nanoserve.quantization.fp8_math import FP8, dequantize_weight
from nanoserve.quantization.scheme import FP8Scheme, fp8_experts_fit, runs_fp8  # noqa: F401 (runs_fp8: read as moe_experts.runs_fp8)
from nanoserve.quantization.w4_formats import W4Weights, checkpoint_tensors, param_dtype, to_w4
from nanoserve.quantization.w4_linear import DUMMY_SCALE as W4_DUMMY_SCALE
from nanoserve.quantization.w4_packing import PACK, pack
from nanoserve.quantization.w4_scheme import W4Scheme, runs_w4, w4_experts_fit  # noqa: F401 (runs_w4: read here)

# Read, and not used: experts run their inputs unquantized (module docstring).
_DROPPED = ("input_scale",)


class _Whole:
    """A dequantized tensor as a checkpoint slice looks to a weight_loader (get_shape, indexing)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def dequantize_w4(w: W4Weights, scheme: W4Scheme) -> torch.Tensor:
    """The fp32 weight [N, K] that a layer's W4Weights stand for."""
    k = w.q.shape[0]
    if w.g_idx is not None:
        groups = w.g_idx.long()
    elif scheme.group_size == -1:
        groups = torch.zeros(k, dtype=torch.long)
    else:
        groups = torch.arange(k) // scheme.group_size
    zeros = 8.0 if w.zeros is None else w.zeros.float()[groups]
    return ((w.q.float() - zeros) * w.scales.float()[groups]).t()


class ExpertDequantizer:
    """Installed on a FusedMoE as its parameters' weight_loader: takes an expert projection's quantized tensors
    (shards 'gate:3#qweight', or 'gate:3' for an FP8 `weight`) and loads the weight they define once all are in."""

    def __init__(self, experts: nn.Module, scheme: FP8Scheme | W4Scheme, name: str) -> None:
        self.experts, self.scheme, self.name = experts, scheme, name
        self.load_expert = experts.load_expert
        if isinstance(scheme, W4Scheme):
            self.parts = set(checkpoint_tensors(scheme))
        else:
            self.parts = {"weight", scheme.scale_name}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # shard ('gate:3') -> its tensors so far
        # Shards loaded whole. The loader counts a shard as read at any of its tensors (an input_scale included), so
        # check_complete looks for every one of this rank's here.
        self._done: set[str] = set()

    def __call__(self, param: nn.Parameter, loaded, shard: str) -> None:
        shard, _, part = shard.partition("#")
        part = part or "weight"
        proj, expert = shard.split(":")
        if part in _DROPPED or int(expert) not in self.experts.local_experts:
            return  # unused, or another rank's expert: left unread
        if part not in self.parts:
            raise ValueError(f"is not a tensor of a {self._format()} expert (expected {sorted(self.parts)})")
        self._take(param, loaded, shard, part)

    def _take(self, param: nn.Parameter, loaded, shard: str, part: str) -> None:
        tensor = loaded[...]
        if isinstance(self.scheme, FP8Scheme) and part == "weight" and tensor.dtype != FP8:
            raise ValueError(f"is {tensor.dtype}, expected float8_e4m3fn (the quantization_config's fp8 weights)")
        tensors = self._pending.setdefault(shard, {})
        tensors[part] = tensor
        if tensors.keys() == self.parts:
            del self._pending[shard]
            self._done.add(shard)
            self.load_expert(param, _Whole(self._dequantize(tensors, shard).to(param.dtype)), shard)

    def _dequantize(self, tensors: dict[str, torch.Tensor], shard: str) -> torch.Tensor:
        if isinstance(self.scheme, FP8Scheme):
            return dequantize_weight(tensors["weight"], tensors[self.scheme.scale_name], self.scheme.block)
        # to_w4 reads a fused layer's g_idx per stacked module; an expert projection is one module.
        tensors = {k: (v[None] if k.endswith("g_idx") else v).to(param_dtype(k)) for k, v in tensors.items()}
        return dequantize_w4(to_w4(tensors, self.scheme, f"{self.name}:{shard}"), self.scheme)

    def check_complete(self) -> None:
        """Raises ValueError naming an expert projection whose tensors the checkpoint did not all hold."""
        expected = [shard for shards in self.experts.expected_shards().values() for shard in shards]
        for shard in expected:
            if shard not in self._done:
                missing = sorted(self.parts - self._pending.get(shard, {}).keys())
                raise ValueError(f"model: {self.name} expert projection {shard} lacks {', '.join(missing)} in the "
                                 f"checkpoint (a {self._format()} expert needs {sorted(self.parts)})")

    def _format(self) -> str:
        return self.scheme.method if isinstance(self.scheme, W4Scheme) else f"fp8 ({self.scheme.method})"


def fits_fp8(experts: FusedMoE, scheme: FP8Scheme) -> bool:
    """Whether this rank's share of the experts keeps whole blocks of scales (always, per row): its rows of I (gate's
    and up's) and its columns of I (down's) start on a block and end on one or at I; and the blocks' columns are
    whole tiles of 16 (kernels/fp8_experts.py)."""
    return fp8_experts_fit(scheme.block, experts.inter_start, experts.local_inter, experts.intermediate_size)


def keep_fp8(experts: FusedMoE, scheme: FP8Scheme, name: str, device: torch.device, dummy: bool) -> None:
    """Makes the experts' w13 and w2 float8_e4m3fn and w13_scale, w2_scale their fp32 scales (per row, or per
    scheme.block), on `device`; loaded from the checkpoint by an Fp8ExpertLoader, or random (their own loader takes
    each rank's share of random fp8 values; the scales are DUMMY_SCALE)."""
    num_experts, hidden, inter = experts.w13.shape[0], experts.hidden_size, experts.local_inter
    shapes = {"w13": (num_experts, 2 * inter, hidden), "w2": (num_experts, hidden, inter),
              "w13_scale": stacked_scale_shape(num_experts, inter, hidden, scheme.block),
              "w2_scale": scale_shape(num_experts, hidden, inter, scheme.block)}
    for param_name, shape in shapes.items():
        scale = param_name.endswith("_scale")
        param = nn.Parameter(torch.empty(shape, dtype=torch.float32 if scale else FP8, device=device),
                             requires_grad=False)
        if scale:
            param.dummy_value = DUMMY_SCALE
        setattr(experts, param_name, param)
    experts.weight_block = scheme.block
    experts.w13.weight_loader = experts.w2.weight_loader = (
        experts.load_expert if dummy else Fp8ExpertLoader(experts, scheme, name))


class Fp8ExpertLoader(ExpertDequantizer):
    """w13's and w2's weight_loader where keep_fp8 kept the experts in FP8: an expert projection's fp8 weight goes
    to this rank's share of w13 or w2 as it is (FusedMoE.load_expert), its scales to the same share of w13_scale or
    w2_scale; check_complete names a projection whose weight or scales did not come."""

    def _take(self, param: nn.Parameter, loaded, shard: str, part: str) -> None:
        if part == "weight":
            dtype = loaded.get_dtype() if hasattr(loaded, "get_dtype") else str(loaded[...].dtype)
            if dtype not in ("F8_E4M3", str(FP8)):
                raise ValueError(f"is {dtype}, expected float8_e4m3fn (the quantization_config's fp8 weights)")
            self.load_expert(param, loaded, shard)
        else:
            self._load_scale(loaded[...].float(), shard)
        parts = self._pending.setdefault(shard, {})
        parts[part] = None  # (copied already: only which parts came is kept)
        if parts.keys() == self.parts:
            del self._pending[shard]
            self._done.add(shard)

    def _load_scale(self, scale: torch.Tensor, shard: str) -> None:
        """This rank's rows (or rows of blocks) of gate's or up's scales, or columns of blocks of down's."""
        experts, block = self.experts, self.scheme.block
        proj, expert = shard.split(":")
        e = int(expert) - experts.expert_start
        h, i, start, size = experts.hidden_size, experts.intermediate_size, experts.inter_start, experts.local_inter
        rows, cols = (h, i) if proj == "down" else (i, h)
        if block is None:
            if scale.numel() not in (1, rows):
                raise ValueError(f"has shape {tuple(scale.shape)}, expected one number or ({rows}, 1): one per "
                                 "output row")
            scale = scale.reshape(-1).expand(rows)
            if proj == "down":
                experts.w2_scale.data[e].copy_(scale)
            else:
                offset = 0 if proj == "gate" else size
                experts.w13_scale.data[e, offset:offset + size].copy_(scale[start:start + size])
            return
        expected = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != expected:
            raise ValueError(f"has shape {tuple(scale.shape)}, expected {expected} (blocks of {block[0]}x{block[1]})")
        if proj == "down":  # fits_fp8 made this rank's columns whole blocks
            first = start // block[1]
            experts.w2_scale.data[e].copy_(scale[:, first:first + experts.w2_scale.shape[2]])
        else:
            first, count = start // block[0], experts.w13_scale.shape[1] // 2
            offset = 0 if proj == "gate" else count
            experts.w13_scale.data[e, offset:offset + count].copy_(scale[first:first + count])


def fits_w4(experts: FusedMoE, scheme: W4Scheme) -> bool:
    """Whether the MoE kernels take this rank's share of the 4-bit experts packed (w4_experts_fit): not act-order,
    groups of whole tiles of 16 columns (or one a row), and down's columns of this rank whole groups and int32s."""
    return w4_experts_fit(scheme, experts.inter_start, experts.local_inter, experts.intermediate_size)


def keep_w4(experts: FusedMoE, scheme: W4Scheme, name: str, device: torch.device, dummy: bool) -> None:
    """Makes the experts' w13 and w2 int32 (eight 4-bit values along K), w13_scale and w2_scale their fp32 group
    scales and, asymmetric, w13_zeros and w2_zeros their zero points (kernels/w4_experts.py's layout), on `device`;
    loaded from the checkpoint by a W4ExpertLoader, or random (random bits are valid 4-bit values; their own loader
    takes each rank's share of them; scales DUMMY_SCALE and zero points 8, as w4_linear's random layers have)."""
    num_experts, hidden, inter = experts.w13.shape[0], experts.hidden_size, experts.local_inter
    group = scheme.group_size
    w13_shape, w13_scales = w4_shapes(num_experts, 2 * inter, hidden, group)
    w2_shape, w2_scales = w4_shapes(num_experts, hidden, inter, group)
    shapes = {"w13": (w13_shape, torch.int32), "w2": (w2_shape, torch.int32),
              "w13_scale": (w13_scales, torch.float32), "w2_scale": (w2_scales, torch.float32)}
    if not scheme.symmetric:
        shapes |= {"w13_zeros": (w13_scales, torch.uint8), "w2_zeros": (w2_scales, torch.uint8)}
    for param_name, (shape, dtype) in shapes.items():
        param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        if param_name.endswith("_scale"):
            param.dummy_value = W4_DUMMY_SCALE
        elif param_name.endswith("_zeros"):
            param.dummy_value = 8
        setattr(experts, param_name, param)
    experts.weight_block, experts.group_size = weight_block(group), group
    if dummy:
        experts.w13.weight_loader = experts.w2.weight_loader = _load_random_packed(experts)
        experts.w13.checkpoint_shapes = lambda: [(f"{p}:{e}", (experts.intermediate_size, hidden // PACK))
                                                 for e in experts.local_experts for p in ("gate", "up")]
        experts.w2.checkpoint_shapes = lambda: [(f"down:{e}", (hidden, experts.intermediate_size // PACK))
                                                for e in experts.local_experts]
    else:
        experts.w13.weight_loader = experts.w2.weight_loader = W4ExpertLoader(experts, scheme, name)


def _load_random_packed(experts: FusedMoE):
    """Random int32s (whole checkpoint tensors of packed values, as keep_w4's checkpoint_shapes give them) into this
    rank's share of w13 or w2: its rows of I, or its packed columns of I (w4_experts_fit made them whole int32s)."""
    def load(param: nn.Parameter, loaded, shard: str) -> None:
        proj, expert = shard.split(":")
        e, start, size = int(expert) - experts.expert_start, experts.inter_start, experts.local_inter
        if proj == "down":
            param.data[e].copy_(loaded[:, start // PACK:(start + size) // PACK])
        else:
            offset = 0 if proj == "gate" else size
            param.data[e, offset:offset + size].copy_(loaded[start:start + size])
    return load


class W4ExpertLoader(ExpertDequantizer):
    """w13's and w2's weight_loader where keep_w4 kept the experts packed: once an expert projection's tensors have
    all come, converts them to the W4 layout (w4_formats.to_w4, then packed along K) and copies this rank's share
    (its rows of I for gate and up, its columns and groups of I for down) into w13 or w2, w13_scale or w2_scale and
    w13_zeros or w2_zeros; check_complete (ExpertDequantizer's) names a projection whose tensors did not all come."""

    def _take(self, param: nn.Parameter, loaded, shard: str, part: str) -> None:
        tensors = self._pending.setdefault(shard, {})
        tensors[part] = loaded[...]
        if tensors.keys() != self.parts:
            return
        del self._pending[shard]
        self._done.add(shard)
        experts, scheme = self.experts, self.scheme
        # to_w4 reads a fused layer's g_idx per stacked module; an expert projection is one module.
        tensors = {k: (v[None] if k.endswith("g_idx") else v).to(param_dtype(k)) for k, v in tensors.items()}
        w = to_w4(tensors, scheme, f"{self.name}:{shard}")
        proj, expert = shard.split(":")
        h, i = experts.hidden_size, experts.intermediate_size
        n, k = (h, i) if proj == "down" else (i, h)
        if tuple(w.q.shape) != (k, n):
            raise ValueError(f"holds a weight of {tuple(w.q.shape[::-1])}, expected {(n, k)}")
        in_order = torch.zeros(k, dtype=torch.long) if scheme.group_size == -1 else torch.arange(k) // scheme.group_size
        if w.g_idx is not None and not torch.equal(w.g_idx.long(), in_order):
            raise ValueError("has a g_idx out of order (act-order), but the quantization_config says none")
        e, start, size = int(expert) - experts.expert_start, experts.inter_start, experts.local_inter
        q, scales = w.q.t(), w.scales.t()  # [N, K], [N, G]: rows along K, as the layout has them
        zeros = None if w.zeros is None else w.zeros.t()
        per_row = scheme.group_size == -1
        if proj == "down":  # this rank's columns of I: whole groups and int32s (w4_experts_fit)
            groups = slice(0, 1) if per_row else slice(start // scheme.group_size,
                                                       start // scheme.group_size + experts.w2_scale.shape[2])
            target = (experts.w2.data[e], experts.w2_scale.data[e], experts.w2_zeros)
            q, scales = q[:, start:start + size], scales[:, groups]
            zeros = None if zeros is None else zeros[:, groups]
            index = slice(None)
        else:
            offset = 0 if proj == "gate" else size
            target = (experts.w13.data[e], experts.w13_scale.data[e], experts.w13_zeros)
            q, scales = q[start:start + size], scales[start:start + size]
            zeros = None if zeros is None else zeros[start:start + size]
            index = slice(offset, offset + size)
        packed, scale_param, zeros_param = target
        packed[index].copy_(pack(q, 1))
        scale_param[index].copy_(scales[:, 0] if per_row else scales)
        if zeros_param is not None:
            zeros_param.data[e, index].copy_(zeros[:, 0] if per_row else zeros)
