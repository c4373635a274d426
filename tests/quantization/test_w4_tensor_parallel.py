"""4-bit weights under tensor parallelism on the CPU (gloo): each rank reads its share of the packed tensors (a
stacked shard's rows of q/k/v and gate/up, packed eight to an int32 in qzeros; o_proj's and down_proj's input
columns, packed eight to an int32 in qweight, with their groups and g_idx): a GPTQ checkpoint at TP=2 generates
TP=1's tokens, which are transformers' on its dequantized weights (test_w4_models.py). (AWQ and compressed-tensors
were checked the same way by hand; one TP engine is slow to start.)"""

import pytest
import torch
from w4_checkpoints import W4Format, write_w4_checkpoint

from nanoserve import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


def test_gptq_two_ranks_equal_one(tmp_path, checkpoints):
    """qwen3: 2 kv heads of 32 rows, one a rank; o_proj's 128 columns, 64 (two groups of 32) a rank."""
    ckpt, _, _ = write_w4_checkpoint(checkpoints["qwen3"], tmp_path, W4Format("gptq", 32, symmetric=False))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 384, (n,), generator=g).tolist() for n in (3, 20, 45)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(ckpt), num_kv_blocks=32).generate(prompts, params,
                                                                                        use_tqdm=False)]
    llm = LLM(str(ckpt), tensor_parallel_size=2, num_kv_blocks=32)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    finally:
        llm.shutdown()
