"""The nanochat-style Engine on the bundled model: the calculator tool loop, samples, seeds, shared KV."""

import json

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.chat_engine import Engine, ToolLoop, ToolTokens
from nanoserve.tools.calculator import calculator

# (question, the calculator's result the model must obtain), greedy. A table of easy cases; the
# training script's held-out eval measures the rate over 50 prompts (scripts/TRAINING.md).
TOOL_PROMPTS = [
    ("What is 123*456?", "56088"),
    ("What is 12*34?", "408"),
    ("What is 8*7?", "56"),
    ("What is 100-58?", "42"),
    ("What is 250 divided by 5?", "50"),
    ("How many r are in strawberry?", "3"),
    ("How many times does the letter a appear in banana?", "3"),
    ("How many l are in hello?", "2"),
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def llm():
    # One thread: on a small shared CPU, two OpenMP threads of this tiny model wait on each other
    # (measured: 140 ms per step with two threads against 5 ms with one while another process ran).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine(llm) -> Engine:
    return Engine(llm)


@pytest.fixture(scope="module")
def tokens(llm) -> ToolTokens:
    return ToolTokens.from_tokenizer(llm.tokenizer)


def chat(llm: LLM, question: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": question}])


def no_requests_left(llm: LLM) -> bool:
    return not llm.engine.requests and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("question,expected", TOOL_PROMPTS)
def test_answers_through_the_calculator(llm, engine, tokens, question, expected):
    prompt = chat(llm, question)
    results, masks = engine.generate_batch(prompt, temperature=0, max_tokens=MAX_TOKENS)
    out, mask = results[0][len(prompt):], masks[0][len(prompt):]
    assert masks[0][:len(prompt)] == [0] * len(prompt)
    text = llm.tokenizer.decode(out, skip_special_tokens=False)
    assert tokens.python_start in out and tokens.python_end in out, text
    call_start, call_end = out.index(tokens.python_start), out.index(tokens.python_end)
    expr = llm.tokenizer.decode(out[call_start + 1:call_end])
    assert calculator(expr) == expected, text  # the call itself, or an equivalent expression
    forced = [tokens.output_start, *llm.tokenizer.encode(expected, add_special_tokens=False), tokens.output_end]
    after = call_end + 1
    assert out[after:after + len(forced)] == forced, text
    # Exactly the forced tokens are masked out; everything else was sampled.
    assert mask == [0 if after <= i < after + len(forced) else 1 for i in range(len(out))]
    assert tokens.assistant_end not in out and tokens.bos not in out  # terminal tokens are dropped


def test_forced_answer_is_used(llm, engine):
    prompt = chat(llm, "What is 123*456?")
    results, _ = engine.generate_batch(prompt, temperature=0, max_tokens=MAX_TOKENS)
    text = llm.tokenizer.decode(results[0][len(prompt):], skip_special_tokens=False)
    assert "<|python_start|>123*456<|python_end|><|output_start|>56088<|output_end|>" in text
    assert "56088" in text.split("<|output_end|>")[1]  # the answer after the tool output


@pytest.mark.parametrize("question", ["Hello!", "What is 123*456?"])
def test_greedy_equals_llm_generate(llm, engine, tokens, question):
    prompt = chat(llm, question)
    results, masks = engine.generate_batch(prompt, temperature=0, max_tokens=MAX_TOKENS)
    ours = results[0][len(prompt):]
    theirs = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    theirs = [t for t in theirs[0].outputs[0].token_ids if t not in (tokens.assistant_end, tokens.bos)]
    if 0 in masks[0][len(prompt):]:  # a tool call: the same up to the first forced token
        first_forced = masks[0][len(prompt):].index(0)
        ours, theirs = ours[:first_forced], theirs[:first_forced]
    assert ours == theirs


def test_samples_differ_and_seed_reproduces(llm, engine):
    prompt = chat(llm, "Hello!")
    gen = engine.generate(prompt, num_samples=16, temperature=1.0, max_tokens=8, seed=3)
    first_column, first_masks = next(gen)
    gen.close()  # stopping early aborts the request
    assert no_requests_left(llm)
    assert len(first_column) == 16 and first_masks == [1] * 16
    assert len(set(first_column)) > 1  # every sample sampled its own first token
    a = engine.generate_batch(prompt, num_samples=4, temperature=1.0, max_tokens=12, seed=11)
    b = engine.generate_batch(prompt, num_samples=4, temperature=1.0, max_tokens=12, seed=11)
    assert a == b


def test_columns_after_a_sample_ends(llm, engine, tokens):
    prompt = chat(llm, "Hello!")
    columns = list(engine.generate(prompt, num_samples=6, temperature=1.0, max_tokens=20, seed=0))
    assert no_requests_left(llm)
    terminal = {tokens.assistant_end, tokens.bos}
    lengths = []
    for i in range(6):
        sample = [column[i] for column, _ in columns]
        masks = [column_masks[i] for _, column_masks in columns]
        length = sample.index(None) if None in sample else len(sample)
        # Tokens, ending at a terminal token or at max_tokens; then None with mask 0 to the last column.
        assert None not in sample[:length] and not (terminal & set(sample[:length - 1]))
        assert sample[length - 1] in terminal or length == 20
        assert sample[length:] == [None] * (len(sample) - length) and not any(masks[length:])
        lengths.append(length)
    assert len(columns) == max(lengths)


def test_prompt_blocks_shared_across_samples(llm, engine):
    prompt = chat(llm, "Please tell me, as a friendly and very helpful assistant, what is the sum of 12 and 34?")
    block_size = llm.engine.config.args.block_size
    full = len(prompt) // block_size
    assert full >= 2 and len(prompt) % block_size  # full blocks to share, and a partial one to copy
    gen = engine.generate(prompt, num_samples=4, temperature=1.0, max_tokens=8, seed=0)
    next(gen)
    next(gen)  # each sample has written its own token into the partial block by now
    (request,) = [r for r in llm.engine.requests.values() if r.request_id.startswith(engine._prefix)]
    tables = [seq.block_table for seq in request.seqs]
    assert len(tables) == 4
    assert all(t[:full] == tables[0][:full] for t in tables)  # one copy of the prompt's full blocks
    assert all(llm.engine.block_manager.blocks[b].ref_count >= 4 for b in tables[0][:full])
    assert len({t[full] for t in tables}) == 4  # the partial block was copied on write
    gen.close()
    assert no_requests_left(llm)


def test_force_tokens_touches_one_sample(llm, tokens):
    prompt = chat(llm, "Hello!")
    params = SamplingParams(n=2, temperature=0, max_tokens=12)
    solo = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    engine = llm.engine
    engine.add_request("force-test", prompt, params)
    while not engine.requests["force-test"].seqs or len(engine.requests["force-test"].seqs) < 2:
        engine.step()
    forced = [tokens.output_start, *llm.tokenizer.encode("42", add_special_tokens=False), tokens.output_end]
    engine.force_tokens("force-test", 1, forced)
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.request_id == "force-test" and o.finished), None)
    a, b = final.outputs
    assert a.token_ids == solo.token_ids  # the other sample is untouched
    assert b.token_ids[1:1 + len(forced)] == forced and len(b.token_ids) <= 12  # forced tokens count
    assert "42" in b.text


@pytest.fixture
def tool_loop(llm):
    """A tool loop for the "offline-" requests of LLM.generate, removed afterwards."""
    loop = ToolLoop.attach(llm.engine, "offline-")
    yield loop
    llm.engine.step_hooks.remove(loop)


def _expected_call(llm: LLM, tokens: ToolTokens, out: list[int]) -> tuple[int, list[int]]:
    """Where the first tool output must start in `out`, and its tokens (whatever the model computed)."""
    end = out.index(tokens.python_end)
    result = calculator(llm.tokenizer.decode(out[out.index(tokens.python_start) + 1:end]))
    assert result is not None
    return end + 1, [tokens.output_start, *llm.tokenizer.encode(result, add_special_tokens=False), tokens.output_end]


def test_tool_loop_under_llm_generate(llm, tokens, tool_loop):
    # LLM.generate steps with final_only: the loop still sees every token, and masks the final output.
    out = llm.generate(chat(llm, "What is 12*34?"), SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0].outputs[0]
    at, forced = _expected_call(llm, tokens, out.token_ids)
    assert out.token_ids[at:at + len(forced)] == forced
    assert out.token_masks == [0 if at <= i < at + len(forced) else 1 for i in range(len(out.token_ids))]


def test_forced_tokens_come_in_an_output_of_their_own(llm, tokens, tool_loop):
    engine = llm.engine
    engine.add_request("offline-stream", chat(llm, "What is 12*34?"), SamplingParams(temperature=0, max_tokens=32))
    deltas, seen, done = [], 0, False
    while not done:
        for out in engine.step():
            c = out.outputs[0]
            deltas.append((c.token_ids[seen:], c.token_masks[seen:]))
            seen, done = len(c.token_ids), out.finished
    at, forced = _expected_call(llm, tokens, [t for ids, _ in deltas for t in ids])
    assert (forced, [0] * len(forced)) in deltas  # the forced tokens alone, masked
    assert all(set(masks) in ({0}, {1}) for _, masks in deltas)  # never mixed with sampled ones


def _call(name: str, arguments, call_id: str = "c1") -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def test_calculator_calls_render_as_the_model_was_trained(llm):
    # The bundled model learnt this exact text (scripts/train_tiny_model.py): a template change must keep it.
    messages = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12*34?"},
        _call("calculator", {"expression": "12*34"}), {"role": "tool", "tool_call_id": "c1", "content": "408"},
        {"role": "assistant", "content": "12*34 = 408."}, {"role": "user", "content": "And 2+2?"},
        {**_call("calculator", "2+2", "c2"), "content": "Let me see"},
        {"role": "tool", "tool_call_id": "c2", "content": "4"}]
    assert llm.tokenizer.decode(llm.apply_chat_template(messages)) == (
        "<|bos|><|user_start|>Be brief.\n\nWhat is 12*34?<|user_end|><|assistant_start|><|python_start|>12*34"
        "<|python_end|><|output_start|>408<|output_end|>12*34 = 408.<|assistant_end|><|user_start|>And 2+2?"
        "<|user_end|><|assistant_start|>Let me see<|python_start|>2+2<|python_end|><|output_start|>4<|output_end|>")


@pytest.mark.parametrize("arguments", [{"city": "Paris"}, "not json", 5, None])
def test_any_tool_call_renders_with_json_arguments(llm, arguments):
    messages = [{"role": "user", "content": "Weather?"}, _call("get_weather", arguments),
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = llm.tokenizer.decode(llm.apply_chat_template(messages))
    call = json.dumps({"name": "get_weather", "arguments": arguments})
    assert f"<|python_start|>{call}<|python_end|><|output_start|>sunny<|output_end|>" in text


def test_a_template_that_cannot_render_is_a_value_error_naming_messages(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match=r"^messages: .*roles must alternate"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    monkeypatch.setattr(llm.tokenizer, "chat_template", "{{ messages[0]['tool_calls'][0]['function'] }}")
    with pytest.raises(ValueError, match=r"^messages: .*tool_calls"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
