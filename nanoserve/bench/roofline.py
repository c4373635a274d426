"""The hardware ceilings, measured in the same run, and the bounds they put on decoding.

Every decode step reads all weights once plus the KV of every live sequence, so a step can be no
faster than those bytes over the measured bandwidth; prompt tokens cost 2 FLOPs per parameter. A mixture-of-experts
step reads only the experts its tokens chose, and a token runs through its top-k experts only (WeightBytes). Bytes are
the tensors' as they are held: MXFP4 experts kept packed (gpt-oss on the GPU) count 4.25 bits a weight, while their
parameters count as weights (two a byte); FP8 experts kept in FP8 (an FP8 MoE checkpoint on the GPU) a byte a weight
plus 4 bytes a scale (one a row, or one a block), their parameters a weight a byte; 4-bit experts kept packed (a
GPTQ, AWQ or compressed-tensors MoE checkpoint on the GPU) half a byte a weight plus 4 bytes a scale and (asymmetric)
a byte a zero point per group, their parameters eight weights an int32.
"""

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.layers.moe import FusedMoE


def _time_ms(fn, iters: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def measure_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second of a large device copy, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (_time_ms(lambda: dst.copy_(src)) / 1e3)


def measure_matmul(device: torch.device, n: int = 8192) -> float:
    """bf16 FLOP per second of a large square matmul (random data: zeros run faster)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / (_time_ms(lambda: a @ b) / 1e3)


@dataclass
class WeightBytes:
    """The weights a decode step reads: every dense parameter once (a tied embedding counted once), and of a
    mixture-of-experts model's routed experts only those the step's tokens chose."""

    dense: int
    experts: int = 0  # all routed experts' bytes on this rank, as held (packed MXFP4: half a byte a weight + scales;
    # FP8: a byte a weight + fp32 scales; W4: half a byte a weight + fp32 scales and uint8 zero points)
    expert_params: int = 0  # their weights (FusedMoE.num_weights)
    num_experts: int = 1  # the model's, per layer
    top_k: int = 1

    def read_by(self, tokens: int) -> float:
        """Bytes a step of `tokens` tokens reads. With uniform routing (random weights route near uniformly, the
        worst case for bytes) an expert is chosen by none of B tokens with probability (1 - k/E)^B, so a step
        touches E(1 - (1 - k/E)^B) experts of a layer on average."""
        touched = 1 - (1 - self.top_k / self.num_experts) ** tokens
        return self.dense + self.experts * touched

    def active_params(self, dense_params: int) -> float:
        """Parameters a token runs through: the dense ones and its top_k experts (2 FLOPs each)."""
        return dense_params + self.expert_params * self.top_k / self.num_experts


def _dense_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters outside the routed experts, each once (a tied embedding counted once)."""
    expert_ptrs = {p.data_ptr() for m in model.modules() if isinstance(m, FusedMoE) for p in m.parameters()}
    seen, dense = set(), []
    for p in model.parameters():
        if p.data_ptr() not in seen and p.data_ptr() not in expert_ptrs:
            seen.add(p.data_ptr())
            dense.append(p)
    return dense


def weight_bytes(model: torch.nn.Module) -> WeightBytes:
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    dense = sum(p.numel() * p.element_size() for p in _dense_parameters(model))
    if not experts:
        return WeightBytes(dense)
    return WeightBytes(dense, sum(p.numel() * p.element_size() for m in experts for p in m.parameters()),
                       sum(m.num_weights() for m in experts), experts[0].num_experts, experts[0].top_k)


def model_params(model: torch.nn.Module) -> float:
    """Parameters one token runs through (a mixture of experts: its top_k experts, not all)."""
    return weight_bytes(model).active_params(sum(p.numel() for p in _dense_parameters(model)))


def kv_bytes_per_token(config) -> int:
    """KV bytes one GPU reads per token of context: its kv heads only under tensor parallelism, where the bounds
    are one GPU's (rank 0's share of the weights over its own bandwidth; the ranks run in parallel)."""
    m = config.model
    elem = config.kv_dtype.itemsize  # kv_cache_dtype fp8: one byte
    return 2 * m.num_hidden_layers * config.num_kv_heads_per_rank * m.head_dim * elem


def decode_bound_seconds(prompt_lens, output_lens, weights: WeightBytes, kv_per_token: int,
                         bandwidth: float) -> float:
    """All requests decoding together: step t reads the weights its tokens need and the KV of those still
    running."""
    prompt_lens, output_lens = np.asarray(prompt_lens), np.asarray(output_lens)
    steps = int(output_lens.max())
    total = 0.0
    for t in range(steps):
        live = output_lens > t
        total += weights.read_by(int(live.sum())) + kv_per_token * float((prompt_lens[live] + t).sum())
    return total / bandwidth


def prefill_bound_seconds(num_prompt_tokens: int, params: int, flops: float) -> float:
    return 2 * params * num_prompt_tokens / flops
