"""The same greedy tokens through every engine path: prefix caching, chunked prefill, preemption, n > 1."""

import pytest
import torch

from nanoserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts_with_shared_prefix() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    system = torch.randint(2, 384, (40,), generator=g).tolist()
    return [system + torch.randint(2, 384, (n,), generator=g).tolist() for n in (3, 11, 29, 50)]


def run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(str(llama_dir), enable_prefix_caching=False, num_kv_blocks=128)
    return run(llm, prompts_with_shared_prefix())


def test_prefix_cache_hits_give_same_tokens(llama_dir, reference):
    llm = LLM(str(llama_dir), enable_prefix_caching=True, num_kv_blocks=128)
    prompts = prompts_with_shared_prefix()
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate(prompts[1:2], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 32  # the 40-token shared prefix holds two full blocks
    assert llm.engine.block_manager.prefix_hits >= 32
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == reference[:2]
    assert run(llm, prompts) == reference  # all four again: every one hits the cache


def test_chunked_prefill_gives_same_tokens(llama_dir, reference):
    llm = LLM(str(llama_dir), max_num_batched_tokens=7, num_kv_blocks=128)
    steps = []
    step = llm.engine.step
    llm.engine.step = lambda **kw: steps.append(1) or step(**kw)
    assert run(llm, prompts_with_shared_prefix()) == reference
    longest = max(len(p) for p in prompts_with_shared_prefix())
    assert len(steps) > longest // 7  # the longest prompt alone needed that many chunks


def test_preemption_gives_same_tokens(llama_dir, reference):
    # 12 blocks of 16 hold about two of these sequences at once, so the others are preempted.
    llm = LLM(str(llama_dir), num_kv_blocks=12, enable_prefix_caching=False)
    assert run(llm, prompts_with_shared_prefix()) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 12


def test_preemption_with_prefix_cache_and_chunks(llama_dir, reference):
    llm = LLM(str(llama_dir), num_kv_blocks=12, max_num_batched_tokens=24)
    assert run(llm, prompts_with_shared_prefix()) == reference
    assert llm.engine.scheduler.num_preemptions > 0


def test_n_samples_share_prompt_blocks(llama_dir, reference):
    llm = LLM(str(llama_dir), num_kv_blocks=128, enable_prefix_caching=False)
    prompt = prompts_with_shared_prefix()[3]  # 90 tokens: 5 full blocks and a partial one
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(n=4, temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()  # prefill once, fork into 4 samples
    seqs = engine.requests["r"].seqs
    assert len(seqs) == 4
    assert all(s.block_table[:5] == seqs[0].block_table[:5] for s in seqs)  # full blocks shared
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks == 6
    engine.step()  # each sample writes its own copy of the partial block
    assert len({s.block_table[5] for s in seqs}) == 4
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [c.token_ids for c in outs[0].outputs] == [reference[3]] * 4


def test_n_samples_differ_at_temperature(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=128)
    out = llm.generate([[5, 6, 7]], SamplingParams(n=8, temperature=1.0, max_tokens=5, seed=1),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == list(range(8))
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_abort_frees_blocks(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=32)
    engine = llm.engine
    engine.add_request("a", list(range(2, 50)), SamplingParams(max_tokens=100, n=2))
    engine.step()
    engine.step()
    out = engine.abort_request("a")
    assert out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 32


def test_priority_runs_first(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=64, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("low", [5, 6, 7], SamplingParams(max_tokens=3), priority=5)
    engine.add_request("high", [5, 6, 8], SamplingParams(max_tokens=3), priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "low"]


def test_context_length_ends_with_length(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=20, num_kv_blocks=8)
    out = llm.generate([list(range(2, 17))], SamplingParams(max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 5


def test_seeded_sampling_independent_of_batch(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=128)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=123, ignore_eos=True)
    alone = llm.generate([[9, 10, 11]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    batch = llm.generate([[40, 41], [9, 10, 11], list(range(2, 60))], [others, params, others],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"), ({"top_k": -3}, "top_k"), ({"min_p": 2}, "min_p"),
    ({"logprobs": 50}, "logprobs"), ({"presence_penalty": 5}, "presence_penalty"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_bad_prompts_name_the_field(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=64, max_model_len=64)
    for prompt, match in [([], "prompt: must not be empty"), ("", "prompt: must not be empty"),
                          ([1, 384], "prompt: token id 384"), ([-1], "prompt: token id -1"),
                          ([1, 2**70], f"prompt: token id {2**70}"), ([1, 2.5], "prompt: token id 2.5"),
                          ([1, [2]], r"prompt: token id \[2\]"),
                          (list(range(2, 70)), "prompt: 68 tokens")]:
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_every_out_of_vocabulary_id_is_named(llama_dir):
    """Prompts, stop_token_ids and logit_bias name all their bad ids, through LLM as through the server."""
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    cases = [([[5, 400, 6, -3, 999]], SamplingParams(), r"prompt: token ids -3, 400, 999 are outside"),
             ([[5, 6]], SamplingParams(stop_token_ids=[2, 384, 7, 500]), r"stop_token_ids: token ids 384, 500 are"),
             ([[5, 6]], SamplingParams(logit_bias={1000: 1.0, 3: 1.0, 384: -1.0}), r"logit_bias: token ids 384, 1000")]
    for prompts, params, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_engine_args_name_the_field(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="^block_size"):
        LLM(str(llama_dir), block_size=12)
    with pytest.raises(ValueError, match="^model"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="^dtype"):
        LLM(str(llama_dir), dtype="float8")
    with pytest.raises(ValueError, match="^bogus"):
        LLM(str(llama_dir), bogus=1)


def test_logprobs_and_prompt_logprobs_match_transformers(llama_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(llama_dir), num_kv_blocks=64, max_num_batched_tokens=16)  # the prompt comes in chunks
    prompt = list(range(5, 45))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2,
                                                prompt_logprobs=1), use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    full = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0], -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p][prompt[p]]
        assert abs(entry.logprob - ref[p - 1, prompt[p]].item()) < 1e-4
        assert entry.rank == int((ref[p - 1] > ref[p - 1, prompt[p]]).sum()) + 1
    for j, (tok, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)):
        row = ref[len(prompt) - 1 + j]
        assert entry[tok].rank == 1 and abs(entry[tok].logprob - row.max().item()) < 1e-4
        assert len(entry) == 2 and set(entry) == set(row.topk(2).indices.tolist())
    assert abs(out.outputs[0].cumulative_logprob - sum(e[t].logprob for t, e in
                                                       zip(out.outputs[0].token_ids, out.outputs[0].logprobs,
                                                           strict=True))) < 1e-5


def test_prefix_stats_count_each_admitted_prompt_once(llama_dir):
    # Four blocks: the second prompt waits for the first to finish, looking the cache up at each step.
    llm = LLM(str(llama_dir), num_kv_blocks=4)
    prompts = prompts_with_shared_prefix()[:2]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.prefix_queries == sum(len(p) for p in prompts)
    assert bm.prefix_hits == 32


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_request_finishing_in_its_prefill_step_fills_the_cache(llama_dir, async_scheduling):
    # max_tokens=1 ends the request in the step that computed its prompt, which frees its blocks: they
    # must be named in the cache before that (the prefix benchmark's requests are all like this).
    llm = LLM(str(llama_dir), num_kv_blocks=128, async_scheduling=async_scheduling)
    prompts = prompts_with_shared_prefix()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:1], one, use_tqdm=False)
    assert llm.generate(prompts[1:2], one, use_tqdm=False)[0].num_cached_tokens == 32
