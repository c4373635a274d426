"""4-bit weights under tensor parallelism on the CPU (gloo): each rank reads its share of the packed tensors (a
stacked shard's rows of q/k/v and gate/up, packed eight to an int32 in qzeros; o_proj's and down_proj's input
columns, packed eight to an int32 in qweight, with their groups and g_idx): a GPTQ checkpoint at TP=2 generates
TP=1's tokens, which are transformers' on its dequantized weights (test_w4_models.py). (AWQ and compressed-tensors
were checked the same way by hand; one TP engine is slow to start.) With act-order a rank's input columns fall in any
group: it keeps every group's scales, and its weight is still exactly its columns of the whole one."""

import pytest
import torch
from w4_checkpoints import W4Format, format_tensors, group_index, quantize, write_w4_checkpoint

from nanoserve import LLM, SamplingParams
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.kernels.w4a16_reference import dequantize_w4
from nanoserve.layers.linear import RowParallelLinear
from nanoserve.quantization.detect import detect_quantization
from nanoserve.quantization.w4_linear import W4LinearMethod

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


def _tokens(ckpt, tp: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 384, (n,), generator=g).tolist() for n in (3, 20, 45)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(ckpt), tensor_parallel_size=tp, num_kv_blocks=32)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_gptq_two_ranks_equal_one(tmp_path, checkpoints):
    """qwen3: 2 kv heads of 32 rows, one a rank; o_proj's 128 columns, 64 (two groups of 32) a rank."""
    ckpt, _, _ = write_w4_checkpoint(checkpoints["qwen3"], tmp_path, W4Format("gptq", 32, symmetric=False))
    assert _tokens(ckpt, 2) == _tokens(ckpt, 1)


def test_gptq_act_order_two_ranks_equal_one(tmp_path, checkpoints):
    """llama, desc_act with each module's columns in a random order (every group 32 of them): a rank's 32 columns of
    o_proj and 64 of down_proj fall in all their groups, a few in each."""
    ckpt, _, _ = write_w4_checkpoint(checkpoints["llama"], tmp_path, W4Format("gptq", 32, symmetric=False,
                                                                             act_order=True))
    assert _tokens(ckpt, 2) == _tokens(ckpt, 1)


class _Slice:
    """A tensor as a safetensors slice looks to a weight_loader."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def _row_parallel(fmt: W4Format, tensors: dict, k: int, n: int, rank: int, ranks: int = 2) -> RowParallelLinear:
    layer = RowParallelLinear(k, n, bias=False, tp=TensorParallelGroup(rank=rank, size=ranks))
    method = W4LinearMethod(detect_quantization({"quantization_config": fmt.quantization_config()}, None))
    method.create_weights(layer, torch.device("cpu"))
    for name, t in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, _Slice(t))
    method.process_weights(layer, "o_proj")
    return layer


@pytest.mark.parametrize("fmt", [W4Format("gptq", 32, symmetric=False, act_order=True),
                                 W4Format("compressed-tensors", 16, act_order=True)])
def test_a_row_parallel_rank_holds_its_columns_of_the_act_order_weight(fmt):
    """K = 128 over 2 ranks, groups in a random column order: each rank's weight, dequantized and its rows put back
    in the checkpoint's column order (padded rows, perm K, dropped), is exactly its 64 columns of the whole weight;
    its forward (PyTorch's, and the kernels' under the Triton interpreter: GEMV and GEMM) multiplies x by them."""
    gen = torch.Generator().manual_seed(0)
    n, k = 16, 128
    g_idx = group_index(k, fmt, gen)
    q, z, s, whole = quantize(torch.randn(n, k, generator=gen), g_idx, fmt)
    tensors = format_tensors(q, z, s, g_idx, fmt)
    padded = False
    for rank in range(2):
        layer = _row_parallel(fmt, tensors, k, n, rank)
        w = dequantize_w4(layer.qweight, layer.scales, layer.zeros, layer.group_size)
        mine = torch.zeros(k // 2 + 1, n).index_add_(0, layer.perm.long(), w)[:k // 2]
        assert torch.equal(mine, whole[:, rank * k // 2:(rank + 1) * k // 2].t())
        padded |= w.shape[0] > k // 2
        for m in (1, 3):
            x = torch.randn(m, k // 2, generator=gen)
            torch.testing.assert_close(layer.quant_method.apply(layer, x), x @ mine, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer.quant_method.apply_kernel(layer, x), x @ mine, atol=1e-4, rtol=1e-4)
    assert padded  # the case this is for: a rank's columns of a group that fill no whole group of rows


def test_a_split_inside_a_packed_int32_is_refused():
    """48 input columns (groups of 16) at TP=4: a rank's 12 cut GPTQ's int32s of eight along them."""
    fmt = W4Format("gptq", 16, act_order=True)
    gen = torch.Generator().manual_seed(0)
    g_idx = group_index(48, fmt, gen)
    q, z, s, _ = quantize(torch.randn(16, 48, generator=gen), g_idx, fmt)
    with pytest.raises(ValueError, match=r"packs eight input columns an int32, which this rank's columns 12..23 of "
                                         "48 cut"):
        _row_parallel(fmt, format_tensors(q, z, s, g_idx, fmt), 48, 16, rank=1, ranks=4)
