"""FP8 on the GPU (skipped without CUDA): the kernels against their references in bf16, and the engine's bf16
CUDA path (torch._scaled_mm, the block GEMM, CUDA graphs) against the CPU reference path's tokens and logits on the
same checkpoints."""

import pytest
import torch
from checkpoints import write_checkpoint
from fp8_checkpoints import Format, calibrate_input_scales, write_fp8_checkpoint

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.fp8_block_gemm import fp8_block_linear, fp8_block_linear_ref
from nanoserve.kernels.fp8_quant import quantize_rows, quantize_rows_ref
from nanoserve.quantization import fp8_math

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m, k", [(1, 4096), (7, 14336), (300, 256)])
def test_quantize_rows_bytes(m, k, static):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    scale = torch.tensor([0.01], device="cuda") if static else None
    q, s = quantize_rows(x, scale)
    want_q, want_s = quantize_rows_ref(x, scale)
    torch.testing.assert_close(s, want_s, atol=0, rtol=0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("m", [1, 4, 32, 200, 1000])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (1000, 384)])
def test_block_gemm_bf16(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    q, scale = fp8_math.quantize_weight(w, "block", (128, 128))
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    got = fp8_block_linear(x, q, scale, (128, 128))
    want = fp8_block_linear_ref(x, q, scale, (128, 128))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fmt", [Format("channel", "token"), Format("tensor", "tensor"),
                                 Format("block", "group", (16, 32), layout="fp8"), Format("channel", None)],
                         ids=["channel-token", "tensor-static", "block", "weight-only"])
def test_engine_cuda_matches_cpu(fmt, tmp_path):
    """bf16 on CUDA (CUDA graphs on) against fp32 on the CPU: the first token of each prompt (bf16 activations part
    from fp32 ones after a few tokens of a random model)."""
    src = write_checkpoint(tmp_path / "src", "qwen3", head_dim=64)  # the CUDA attention kernels' head sizes
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 384, (n,), generator=g).tolist() for n in (1, 9, 40, 3, 17, 25, 60, 5)]
    scales = calibrate_input_scales(src, prompts) if fmt.activations == "tensor" else None
    ckpt = write_fp8_checkpoint(src, tmp_path / "q", fmt, scales)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cpu = LLM(str(ckpt), device="cpu", num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    gpu = LLM(str(ckpt), device="cuda", dtype="bfloat16", num_kv_blocks=64, gpu_memory_utilization=0.3)
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
    # bf16 activations quantize to other fp8 values than fp32 ones, and a random model's top two logits can be
    # close: on an H200 one prompt in three parted at its second token (channel-token), one at its first (block).
    # The kernels themselves are checked exactly above; here most first tokens must agree, as in the bf16 tests.
    assert sum(a[0] == b[0] for a, b in zip(got, want, strict=True)) >= 7
    gpu.shutdown()
