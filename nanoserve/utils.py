"""Small helpers shared across layers."""

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or array as a tensor on `device`, without waiting for the GPU.

    torch.tensor(values, device="cuda") copies with non_blocking=False, which synchronizes the stream:
    the host would wait for every queued kernel, and async scheduling would lose its overlap. From
    pageable memory a non-blocking copy is staged before the call returns, so `values` may go at once.
    """
    return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)
