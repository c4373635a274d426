"""EAGLE-3 speculative decoding: the head's drafts are those of a plain PyTorch reference of its forward (written
here from the definition, over the target's hidden states from transformers), and greedy tokens equal plain
decoding's through prefix hits, chunked prefill, preemption and n > 1; the head's refusals."""

import pytest
import torch
from checkpoints import write_checkpoint, write_eagle3_head

from nanoserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
K = 3


def prompts() -> list[list[int]]:
    """Mixed lengths, the first two sharing a 40-token prefix (prefix hits)."""
    g = torch.Generator().manual_seed(6)
    system = torch.randint(2, 384, (40,), generator=g).tolist()
    return [
        system + torch.randint(2, 384, (5,), generator=g).tolist(),
        system + torch.randint(2, 384, (19,), generator=g).tolist(),
        torch.randint(2, 384, (27,), generator=g).tolist(),
    ]


def run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    # Four layers: the head reads the hidden states entering layers 2, 2 and 1 (2, L // 2, L - 3).
    target = write_checkpoint(root / "target", "llama", num_hidden_layers=4, initializer_range=0.06)
    return target, write_eagle3_head(root / "head", seed=1)


@pytest.fixture(scope="module")
def reference(dirs) -> list[list[int]]:
    return run(LLM(str(dirs[0]), enable_prefix_caching=False, num_kv_blocks=64), prompts())


def eagle3(head, k: int = K) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """transformers' Llama rotary (rotate_half) on [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    freqs = positions[:, None].double() / theta ** (torch.arange(half).double() / half)
    cos, sin = freqs.cos().float()[:, None, :], freqs.sin().float()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class ReferenceHead:
    """EAGLE-3's head from its definition: for position i, x = [norm(embed(token i + 1)), norm(hidden_i)];
    causal attention over positions 0..i (q/k/v from x, rotary at i), plus hidden_i as the residual; the MLP with its
    residual; logits of lm_head(norm(out)) over the draft vocabulary, id j is target id j + d2t[j]. hidden_i is
    fc([h_a, h_b, h_c]) of the target's hidden states entering layers a, b, c at position i, or, for drafted
    positions, the head's own output at the position before."""

    def __init__(self, head_dir, target_dir) -> None:
        import json

        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.w = load_file(str(head_dir / "model.safetensors"))
        self.cfg = json.loads((head_dir / "config.json").read_text())
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        n = self.target.config.num_hidden_layers
        self.layers = (2, n // 2, n - 3)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        w, cfg = self.w, self.cfg
        eps, heads, kv_heads = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        t, d = tokens.shape[0], cfg["hidden_size"] // heads
        embeds = self.target.model.embed_tokens(tokens)
        x = torch.cat(
            [
                _rms(embeds, w["midlayer.input_layernorm.weight"], eps),
                _rms(hidden, w["midlayer.hidden_norm.weight"], eps),
            ],
            dim=-1,
        )
        positions = torch.arange(t)
        q = _rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, heads, d), positions, 10000.0)
        k = _rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, kv_heads, d), positions, 10000.0)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, kv_heads, d)
        k, v = (z.repeat_interleave(heads // kv_heads, dim=1) for z in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads * d)
        h = attn @ w["midlayer.self_attn.o_proj.weight"].T + hidden
        m = _rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
        mlp = torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (
            m @ w["midlayer.mlp.up_proj.weight"].T
        )
        return mlp @ w["midlayer.mlp.down_proj.weight"].T + h

    def to_target(self, out: torch.Tensor) -> int:
        logits = _rms(out, self.w["norm.weight"], self.cfg["rms_norm_eps"]) @ self.w["lm_head.weight"].T
        j = int(logits.argmax())
        return j + int(self.w["d2t"][j])

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """Greedy drafts after `tokens` (the last one sampled by the target, not yet run through it)."""
        ids = torch.tensor(tokens)
        states = self.target(ids[None, :-1], output_hidden_states=True).hidden_states
        hidden = torch.cat([states[i][0] for i in self.layers], dim=-1) @ self.w["fc.weight"].T
        inputs, drafted = ids[1:], []
        for _ in range(k):
            out = self.forward(inputs, hidden)[-1]
            drafted.append(self.to_target(out))
            inputs = torch.cat([inputs, torch.tensor(drafted[-1:])])
            hidden = torch.cat([hidden, out[None]])
        return drafted


def test_drafts_equal_the_reference_heads(dirs, reference):
    """Every proposal of a greedy run (the first after the prompt, the later ones after verify steps) is what the
    reference drafts from the same tokens. The engine is handed the true continuation with its last token wrong in
    place of the head's drafts (a random head's are all rejected), so that verify steps accept all but one: the head
    catches up on several positions of a verify step's hidden states, and the rejected position's are written over.
    Its drafts must not depend on which drafts the engine verified."""
    spec = LLM(str(dirs[0]), num_kv_blocks=64, speculative_config=eagle3(dirs[1]))
    proposer, seen = spec.engine.proposer, []
    propose = proposer.propose
    future = prompts()[2] + reference[2]

    def oracle(rows, caps):
        out = propose(rows, caps)
        seen.extend((list(r.token_ids), d) for r, d in zip(rows, out, strict=True))
        true = [future[len(r.token_ids) : len(r.token_ids) + len(d)] for r, d in zip(rows, out, strict=True)]
        return [t[:-1] + [(t[-1] + 1) % 384] if t else t for t in true]

    proposer.propose = oracle
    assert run(spec, prompts()[2:]) == reference[2:]
    stats = spec.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(seen) >= 3
    ref = ReferenceHead(dirs[1], dirs[0])
    for tokens, drafts in seen:
        assert drafts == ref.drafts(tokens, len(drafts))


def test_greedy_through_prefix_hits_chunks_preemption_and_n(dirs, reference):
    # 9 blocks of 16 hold about two of these sequences; 24 tokens a step chunk the prompts and cap the drafts.
    spec = LLM(str(dirs[0]), num_kv_blocks=9, max_num_batched_tokens=24, speculative_config=eagle3(dirs[1]))
    assert run(spec, prompts()) == reference
    engine = spec.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_hits > 0
    assert engine.spec_stats.num_draft_tokens > 0
    assert engine.proposer.tables == {} and engine.proposer.hidden == {}  # all given back
    assert len(engine.proposer.free) == 9
    out = spec.generate(
        prompts()[2], SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.token_ids for c in out.outputs] == [reference[2]] * 3


def test_refusals(dirs, tmp_path):
    narrow = write_eagle3_head(tmp_path / "narrow", hidden_size=32)
    with pytest.raises(ValueError, match="the EAGLE-3 head's hidden_size 32 differs from the target's 64"):
        LLM(str(dirs[0]), num_kv_blocks=16, speculative_config=eagle3(narrow))
    wide = write_eagle3_head(tmp_path / "wide", vocab_size=400)
    with pytest.raises(ValueError, match="the EAGLE-3 head's vocab_size 400 differs from the target's 384"):
        LLM(str(dirs[0]), num_kv_blocks=16, speculative_config=eagle3(wide))
    with pytest.raises(ValueError, match="'LlamaForCausalLM' is not an EAGLE-3 head"):
        LLM(str(dirs[0]), num_kv_blocks=16, speculative_config=eagle3(dirs[0]))
    with pytest.raises(ValueError, match="kv_offload_gb"):
        LLM(str(dirs[0]), kv_offload_gb=1, speculative_config=eagle3(dirs[1]))
    with pytest.raises(ValueError, match="speculative_config.model: a draft model's directory is required"):
        LLM(str(dirs[0]), speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
