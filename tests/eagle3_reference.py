"""A plain PyTorch reference of an EAGLE-3 head's greedy drafts, written from the definition (transformers has no
EAGLE-3 model), over the target's hidden states from transformers."""

import json

import torch


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
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.w = load_file(str(head_dir / "model.safetensors"))
        self.cfg = json.loads((head_dir / "config.json").read_text())
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        n = self.target.config.num_hidden_layers
        self.layers = sorted((2, n // 2, n - 3))  # in layer order, as vLLM gathers them

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        w, cfg = self.w, self.cfg
        eps, heads, kv_heads = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        t, d = tokens.shape[0], cfg.get("head_dim") or cfg["hidden_size"] // heads
        theta = cfg.get("rope_theta", 10000.0)
        embeds = self.target.model.embed_tokens(tokens)
        x = torch.cat(
            [
                _rms(embeds, w["midlayer.input_layernorm.weight"], eps),
                _rms(hidden, w["midlayer.hidden_norm.weight"], eps),
            ],
            dim=-1,
        )
        positions = torch.arange(t)
        q = _rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, heads, d), positions, theta)
        k = _rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, kv_heads, d), positions, theta)
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
