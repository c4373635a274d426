"""The hardware ceilings, measured in the same run, and the bounds they put on decoding.

Every decode step reads all weights once plus the KV of every live sequence, so a step can be no
faster than those bytes over the measured bandwidth; prompt tokens cost 2 FLOPs per parameter.
"""

import numpy as np
import torch


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


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter once (a tied embedding counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def model_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def kv_bytes_per_token(config) -> int:
    """KV bytes one GPU reads per token of context: its kv heads only under tensor parallelism, where the bounds
    are one GPU's (rank 0's share of the weights over its own bandwidth; the ranks run in parallel)."""
    m = config.model
    elem = torch.empty((), dtype=config.dtype).element_size()
    return 2 * m.num_hidden_layers * config.num_kv_heads_per_rank * m.head_dim * elem


def decode_bound_seconds(prompt_lens, output_lens, weight_bytes: int, kv_per_token: int,
                         bandwidth: float) -> float:
    """All requests decoding together: step t reads the weights and the KV of those still running."""
    prompt_lens, output_lens = np.asarray(prompt_lens), np.asarray(output_lens)
    steps = int(output_lens.max())
    total = 0.0
    for t in range(steps):
        live = output_lens > t
        total += weight_bytes + kv_per_token * float((prompt_lens[live] + t).sum())
    return total / bandwidth


def prefill_bound_seconds(num_prompt_tokens: int, params: int, flops: float) -> float:
    return 2 * params * num_prompt_tokens / flops
