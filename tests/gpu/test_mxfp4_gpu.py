"""On a GPU: a gpt-oss checkpoint in MXFP4 keeps its experts packed (uint8 bytes and scales, no bf16 copy), and the
MXFP4 MoE kernels (grouped GEMMs, decode GEMVs, in CUDA graphs) give the greedy tokens of the eager PyTorch path on
the dequantized weights, fp32, for mixed-length prompts with prefix hits and preemption."""

import pytest
import torch
from moe_reference_engine import check_kept_experts
from mxfp4_layout import write_mxfp4_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# head_dim 64: the attention kernels take 64 and 128; hidden and intermediate sizes whole 32-value blocks.
SHAPE = dict(hidden_size=128, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_mxfp4_checkpoint(tmp_path_factory.mktemp("gpu-mxfp4") / "gpt_oss", **SHAPE)


def test_packed_kernels_match_eager_torch(ckpt, monkeypatch):
    experts, _ = check_kept_experts(ckpt, monkeypatch)
    assert (experts.w13.dtype, tuple(experts.w13.shape), tuple(experts.w2_scale.shape)) == (
        torch.uint8, (8, 128, 64), (8, 128, 2))
