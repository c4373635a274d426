"""Small real checkpoints written by transformers, with a real byte-level BPE tokenizer."""

import json
from pathlib import Path

import torch

VOCAB = 384
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world! How are you today? I am fine, thank you.",
    "nanoserve serves language models with a paged KV cache and continuous batching.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 12345",
    "日本語のテキスト、中文文本，한국어 텍스트 😀🎉🚀 café naïve",
]


def write_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """A byte-level BPE tokenizer (every byte is a token, so any text round-trips)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": template}))


def rope_factors(n: int, seed: int) -> list[float]:
    """n LongRoPE rescale factors in [1, 4)."""
    g = torch.Generator().manual_seed(seed)
    return (1 + 3 * torch.rand(n, generator=g)).tolist()


ARCHS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True,
                  head_dim=32),
    # Mixture of experts: layer 1 of qwen3_moe is dense (mlp_only_layers), so both MLP kinds run.
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], tie_word_embeddings=False,
                      head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False),
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=64, sliding_window=None),
    # Sinks, biases, YaRN, and a 24-token window on layer 0 (full attention on layer 1): prompts outgrow it.
    "gpt_oss": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], head_dim=16, num_local_experts=8,
                    num_experts_per_tok=2, intermediate_size=32, sliding_window=24),
    # Soft-capped attention (a cap of 1.5: random weights' scores reach past it) and logits, query_pre_attn_scalar,
    # a 24-token window on layer 0 of 2, norms with random weights (transformers draws them zero, which (1 + w) hides).
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], head_dim=32, sliding_window=24,
                   attn_logit_softcapping=1.5, final_logit_softcapping=3.0, query_pre_attn_scalar=20,
                   random_norms=True),
    # q/k norms, layers 0-1 windowed (local rope base) and 2 global (linear scaling), as 5:1 is in the big ones.
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], head_dim=32, num_hidden_layers=3,
                   sliding_window=24, sliding_window_pattern=3, query_pre_attn_scalar=24, random_norms=True,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 20000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}),
    # Phi-4-mini's layout: packed qkv_proj / gate_up_proj, 3/4 of each 64-dim head rotated (24 LongRoPE factors,
    # padded to 32 in the kernels), tied embeddings; and Phi-3-mini-4k's window (48 here: prompts outgrow it).
    # original_max_position_embeddings = max_position_embeddings keeps transformers on short_factor at every length,
    # as the engine is (tests/model/test_rope_scaling_vs_hf.py runs long_factor).
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=True, pad_token_id=None,
                 hidden_size=128, num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.75,
                 rope_scaling={"rope_type": "longrope", "short_factor": rope_factors(24, 0),
                               "long_factor": rope_factors(24, 1)},
                 original_max_position_embeddings=512, sliding_window=48),
}


def write_checkpoint(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Random weights (initializer_range 0.2, so outputs vary) saved as safetensors by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    spec = dict(ARCHS[arch])
    model_type = spec.pop("model_type")
    random_norms = spec.pop("random_norms", False)
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
    config = AutoConfig.for_model(model_type, **(fields | spec | overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if random_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def write_quantized_config(path: Path, source: Path, qc: dict) -> str:
    """A model directory at `path` whose config.json is source's with quantization_config `qc` (config checks only:
    no weights)."""
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = qc
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def write_eagle3_head(path: Path, seed: int = 0, vocab_size: int = VOCAB, draft_vocab_size: int = 128,
                      hidden_size: int = 64, **overrides) -> Path:
    """A random EAGLE-3 head in the published layout (config `LlamaForCausalLMEagle3`; fc, midlayer.*, norm,
    lm_head over a draft vocabulary, d2t / t2d; no embedding): transformers has no such model, so the tensors are
    written directly. Its draft vocabulary is a random sorted subset of the target's ids."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_act="silu",
                  hidden_size=hidden_size, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=1, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  vocab_size=vocab_size, draft_vocab_size=draft_vocab_size, bos_token_id=0, eos_token_id=1,
                  torch_dtype="float32") | overrides
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return 0.2 * torch.randn(*shape, generator=g)

    targets = torch.randperm(vocab_size, generator=g)[:draft_vocab_size].sort().values
    tensors = {
        "fc.weight": rand(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, q),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "midlayer.input_layernorm.weight": 1 + rand(h),
        "midlayer.hidden_norm.weight": 1 + rand(h),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h),
        "norm.weight": 1 + rand(h),
        "lm_head.weight": rand(draft_vocab_size, h),
        "d2t": targets - torch.arange(draft_vocab_size),
        "t2d": torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, targets, True),
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path
