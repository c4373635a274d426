"""On a GPU: structured output with async scheduling, CUDA graphs and the mask thread live (each constrained step's
sampling deferred until its masks are filled, ModelRunner.launch). Every constrained sample is valid, and the
unconstrained requests beside them give the tokens they give alone."""

import json

import pytest
import torch
from checkpoints import VOCAB, write_checkpoint
from prompts import mixed_prompts

from nanoserve import LLM, SamplingParams
from nanoserve.structured.params import StructuredOutputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# With a check of their own: jsonschema is not on the GPU machine.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                "minItems": 1, "maxItems": 4},
                                      "ok": {"type": "boolean"}},
     "required": ["items", "ok"], "additionalProperties": False},
]
CHECKS = [
    lambda v: v.keys() == {"name", "age"} and isinstance(v["name"], str) and len(v["name"]) <= 12
    and type(v["age"]) is int and 0 <= v["age"] <= 120,
    lambda v: v.keys() == {"items", "ok"} and 1 <= len(v["items"]) <= 4 and set(v["items"]) <= {"a", "b", "c"}
    and type(v["ok"]) is bool,
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    # head_dim 64 for the Triton kernels; fp32, so that batch composition does not flip a greedy token.
    ckpt = write_checkpoint(tmp_path_factory.mktemp("gpu") / "qwen3", "qwen3", hidden_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=3)
    return LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=2048, seed=0)


def test_constrained_and_plain_requests_in_one_batch(llm):
    prompts = mixed_prompts(VOCAB, 8, 64, num=48)
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    constrained = [SamplingParams(temperature=t, n=n, seed=3, max_tokens=160,
                                  structured_outputs=StructuredOutputs(json=schema))
                   for schema in SCHEMAS for t, n in ((0.0, 1), (1.0, 2))]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:16], plain, use_tqdm=False)]
    params = [plain] * 16 + [constrained[i % len(constrained)] for i in range(32)]
    outs = llm.generate(prompts[:16] + prompts[16:], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:16]] == alone
    for i, out in enumerate(outs[16:]):
        check = CHECKS[(i % len(constrained)) // 2]
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            assert check(json.loads(c.text)), c.text
    assert llm.engine.structured.stats.steps > 0
