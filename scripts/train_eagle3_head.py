"""Train an EAGLE-3 draft head for nanoserve's bundled chat model (speculative_config's eagle3 method).

    python scripts/train_eagle3_head.py                  # writes nanoserve/assets/eagle3/
    python scripts/train_eagle3_head.py --steps 50 --out /tmp/eagle3   # a quick smoke run

The head is what nanoserve/model/llama_eagle3.py runs: one Llama decoder layer whose attention reads the token's
embedding (the target's, frozen) beside a hidden state, and whose output, normed, gives next-token logits. Its
position i reads token i + 1 and fc([h_1, h_2, h_3]) of the frozen target's hidden states entering layers 1, 2, 3
at position i, and learns the target's own next-token distribution there (for token i + 2). At inference
(worker/eagle3.py) only the first draft reads fc: draft s + 1 reads the head's own output at the position before,
with attention over the head's KV of the target-fed positions up to the last known token and of the positions
it drafted since. Training unrolls exactly that ("training-time test", as the EAGLE-3 paper trains): step s runs
every position a of a batch again at position a + s, fed the head's step s - 1 output for a, attending to the
step-0 keys of positions 0..a and to its own keys of steps 1..s at a. The token fed at a drafted position is the
data's (a draft only matters while the ones before it were accepted, that is equal to the target's tokens).

Data is train_tiny_model.py's synthetic chat, same seed (the target's training distribution), held-out
evaluation expressions excluded; the loss is on the assistant's tokens, as the target's was. See scripts/TRAINING.md
for the run time and results of the shipped head.
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import nn
from tqdm import tqdm
from train_tiny_model import batches, conversations, encode, eval_prompts, optimizer  # the script beside this one
from transformers import LlamaForCausalLM

ASSETS = Path(__file__).resolve().parents[1] / "nanoserve" / "assets"
# The hidden states entering these target layers (id j: transformers' hidden_states[j]). The bundled target has 4
# layers, and the engine's default (2, L // 2, L - 3) would read layers 1 and 2 only, layer 2 twice.
AUX_LAYERS = (1, 2, 3)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """transformers' Llama rotary (rotate_half), which nanoserve's matches, on [B, heads, T, head_dim]."""
    half = x.shape[-1] // 2
    freqs = positions[:, None].double() / theta ** (torch.arange(half).double() / half)
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Eagle3Head(nn.Module):
    """The checkpoint's tensors by their names (fc, midlayer.*, norm, lm_head), with the training forward."""

    def __init__(self, hidden: int, heads: int, head_dim: int, intermediate: int, vocab: int, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = nn.Module()
        attn = self.midlayer.self_attn = nn.Module()
        attn.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        attn.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        mlp = self.midlayer.mlp = nn.Module()
        mlp.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        mlp.up_proj = nn.Linear(hidden, intermediate, bias=False)
        mlp.down_proj = nn.Linear(intermediate, hidden, bias=False)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            self.midlayer.register_parameter(name, nn.Parameter(torch.ones(hidden)))
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, theta: float):
        """q, k, v [B, heads, T, head_dim] from [norm(embedding), norm(hidden)], rotary at `positions`."""
        m, attn = self.midlayer, self.midlayer.self_attn
        x = torch.cat([rms_norm(embeds, m.input_layernorm, self.eps), rms_norm(hidden, m.hidden_norm, self.eps)], -1)
        b, t = x.shape[:2]
        q, k, v = (
            p(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        return rope(q, positions, theta), rope(k, positions, theta), v

    def finish(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """o_proj with the un-normed hidden state as residual, then the MLP: the layer's output (before `norm`)."""
        m = self.midlayer
        b, _, t, _ = attn_out.shape
        h = m.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1)) + hidden
        x = rms_norm(h, m.post_attention_layernorm, self.eps)
        return m.mlp.down_proj(F.silu(m.mlp.gate_proj(x)) * m.mlp.up_proj(x)) + h

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm(out, self.norm, self.eps))


def unroll(head: Eagle3Head, embed: nn.Embedding, x: torch.Tensor, aux: torch.Tensor, steps: int, theta: float):
    """The head's outputs (before its final norm) of draft steps 0..steps-1 for every position a of `x` [B, T]
    (step s: [B, T - 1 - s, hidden], row a predicting token a + s + 2), given the target's hidden states `aux`
    [B, T, 3 * hidden]."""
    t = x.shape[1]
    hidden = head.fc(aux)
    scale = head.head_dim**-0.5
    k0 = v0 = None
    drafted_kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # steps 1..s's keys and values at each a
    outs = []
    for s in range(steps):
        n = t - 1 - s  # positions a whose step-s token x[a + s + 1] exists
        q, k, v = head.qkv(embed(x[:, s + 1 : s + 1 + n]), hidden[:, :n], torch.arange(s, s + n), theta)
        if s == 0:
            k0, v0 = k, v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            drafted_kv.append((k, v))
            # Row a: the target-fed keys of positions 0..a, then one key per drafted step (a + 1 .. a + s).
            base = (q @ k0[:, :, :n].transpose(-1, -2)) * scale
            base = base.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            diag = torch.stack([(q * kj[:, :, :n]).sum(-1) for kj, _ in drafted_kv], -1) * scale
            p = torch.cat([base, diag], -1).softmax(-1)
            o = p[..., :n] @ v0[:, :, :n]
            for j, (_, vj) in enumerate(drafted_kv):
                o = o + p[..., n + j, None] * vj[:, :, :n]
        hidden = head.finish(o, hidden[:, :n])  # draft step s + 1 reads the head's own output, as the engine does
        outs.append(hidden)
    return outs


def target_pass(target: LlamaForCausalLM, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target's hidden states entering AUX_LAYERS [B, T, 3 * hidden] and its greedy next tokens [B, T]."""
    out = target(input_ids=x, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in AUX_LAYERS], -1), out.logits.argmax(-1)


def step_loss(
    head: Eagle3Head, outs: list[torch.Tensor], greedy: torch.Tensor, mask: torch.Tensor, decay: float
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Cross-entropy against the target's greedy token at each step's position (what a greedy verify step accepts),
    over the tokens the model produces (`mask`: logits are made for those rows only), step s weighted decay ** s
    (a later draft counts only when the ones before it were accepted). Also each step's agreement [B, n] with the
    target's token: greedy acceptance per position."""
    total, agree = 0.0, []
    for s, out in enumerate(outs):
        n = out.shape[1]
        m = torch.zeros(mask.shape[0], n, dtype=torch.bool)
        m[:, : n - 1] = mask[:, s + 2 : s + 1 + n]  # the last row's token is past the sequence
        labels = greedy[:, s + 1 : s + 1 + n][m]
        logits = head.logits(out[m])
        total = total + decay**s * F.cross_entropy(logits.float(), labels)
        agree.append(torch.zeros_like(m).masked_scatter_(m, logits.argmax(-1) == labels))
    return total, agree


def acceptance_length(agree: list[torch.Tensor], mask: torch.Tensor) -> float:
    """Mean tokens per verify step at k = len(agree) with greedy drafts: 1 + the accepted prefix, over the positions
    whose first draft is a produced token."""
    n = agree[-1].shape[1]
    first = mask[:, 2 : 2 + n]
    run = torch.ones_like(first)
    accepted = torch.zeros(first.shape)
    for a in agree:
        run = run & a[:, :n]
        accepted += run
    return 1 + float(accepted[first].mean()) if first.any() else float("nan")


def save(head: Eagle3Head, target_config: dict, out: Path, dtype: torch.dtype) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to(dtype).contiguous() for name, p in head.named_parameters()}
    tensors["norm.weight"] = tensors.pop("norm")
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{name}.weight"] = tensors.pop(f"midlayer.{name}")
    vocab = head.lm_head.out_features
    tensors["d2t"] = torch.zeros(vocab, dtype=torch.int64)  # draft vocabulary = the target's: id i is id i
    tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    save_file(tensors, str(out / "model.safetensors"))
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size", "bos_token_id",
            "eos_token_id", "hidden_act")  # fmt: skip
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}
    config |= {k: target_config[k] for k in keys if k in target_config}
    config |= {
        "num_hidden_layers": 1,
        "rope_theta": target_config.get("rope_parameters", {}).get("rope_theta", 10000.0),
        "draft_vocab_size": vocab,
        "target_hidden_size": target_config["hidden_size"],
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS), "use_aux_hidden_state": True},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=str(ASSETS))
    p.add_argument("--out", default=str(ASSETS / "eagle3"))
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--conversations", type=int, default=60_000)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ttt-steps", type=int, default=4, help="draft steps unrolled in training")
    p.add_argument("--step-decay", type=float, default=0.8, help="loss weight of draft step s: decay ** s")
    p.add_argument("--threads", type=int, default=1)  # see train_tiny_model.py: one thread on a shared 2-core VM
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = p.parse_args()
    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    target = LlamaForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    cfg = target.config
    tok = Tokenizer.from_file(str(Path(args.target) / "tokenizer.json"))
    held_out = {expr for _, expr, _ in eval_prompts(args.seed + 1)}
    convs = conversations(args.conversations, args.seed, held_out)
    data = [encode(tok, c) for c in convs]
    # Drawn with another seed, so not the training conversations: the head's acceptance at the end is measured there.
    val = [encode(tok, c) for c in conversations(512, args.seed + 2, held_out)]
    print(f"data: {len(data)} conversations, {time.time() - t0:.0f}s", flush=True)

    head = Eagle3Head(
        cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.rms_norm_eps
    )
    with torch.no_grad():  # start from the target's own output norm and (tied) unembedding
        head.lm_head.weight.copy_(target.lm_head.weight)
        head.norm.copy_(target.model.norm.weight)
    embed = target.model.embed_tokens
    theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
    n_params = sum(q.numel() for q in head.parameters())
    print(f"head: {n_params / 1e6:.2f}M parameters, target layers {list(AUX_LAYERS)}", flush=True)
    opt, lr_at = optimizer(head, args.lr, args.steps, warmup=min(100, args.steps // 10))

    def masks(y: torch.Tensor) -> torch.Tensor:
        return y != -100  # the tokens the model produces (train_tiny_model.batches marks the rest -100)

    rng, step, ema, ema_len = random.Random(args.seed), 0, None, None
    bar = tqdm(total=args.steps, desc="train", mininterval=10)
    while step < args.steps:
        for x, y in batches(data, args.batch_size, rng):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            # bf16 autocast: about 1.5x faster on a CPU with avx512_bf16 (train_tiny_model.py); weights stay fp32.
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with torch.no_grad():
                    aux, greedy = target_pass(target, x)
                outs = unroll(head, embed, x, aux, args.ttt_steps, theta)
                loss, agree = step_loss(head, outs, greedy, masks(y), args.step_decay)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            length = acceptance_length(agree[:3], masks(y))
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            ema_len = length if ema_len is None else 0.98 * ema_len + 0.02 * length
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.4f}", accept_k3=f"{ema_len:.2f}", lr=f"{lr_at(step):.1e}", refresh=False)
            if step == args.steps:
                break
    bar.close()
    train_time = time.time() - t0

    save(head, cfg.to_dict(), Path(args.out), getattr(torch, args.save_dtype))
    # Held out, in fp32, from the saved (rounded) weights: what the engine loads.
    saved = load_file(str(Path(args.out) / "model.safetensors"))
    with torch.no_grad():
        for name, q in head.named_parameters():
            q.copy_(saved[name if name in saved else f"{name}.weight"].float())
        lengths = []
        for x, y in batches(val, 64, random.Random(0)):
            aux, greedy = target_pass(target, x)
            _, agree = step_loss(head, unroll(head, embed, x, aux, 4, theta), greedy, masks(y), 1.0)
            lengths.append([acceptance_length(agree[:k], masks(y)) for k in (2, 3, 4)])
    val_len = [round(sum(col) / len(col), 3) for col in zip(*lengths, strict=True)]
    summary = {
        "params_m": round(n_params / 1e6, 2),
        "steps": args.steps,
        "final_loss": round(ema, 4),
        "train_s": round(train_time),
        "val_acceptance_length_k2_k3_k4": val_len,
        "file_mb": round((Path(args.out) / "model.safetensors").stat().st_size / 1e6, 2),
        "total_s": round(time.time() - t0),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
