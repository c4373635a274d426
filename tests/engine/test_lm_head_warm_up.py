"""The LM head's start-up warm-up (run on CUDA by ModelRunner) covers every row count a step can sample."""

from nanoserve import LLM


def test_warm_up_runs_the_lm_head_at_every_row_count(llama_dir):
    llm = LLM(str(llama_dir), max_num_seqs=12, num_kv_blocks=64)
    runner = llm.engine.runner
    seen = []
    lm_head = runner.model.compute_logits

    def counting(hidden):
        seen.append(hidden.shape[0])
        logits = lm_head(hidden)
        assert logits.shape == (hidden.shape[0], runner.config.model.vocab_size)
        return logits

    runner.model.compute_logits = counting
    runner.warm_up_lm_head()
    assert seen == list(range(1, 13))
