"""Small helpers shared across layers."""

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or array as a tensor on `device`, without waiting for the GPU; `values` may go at once.

    torch.tensor(values, device="cuda") copies with non_blocking=False, which synchronizes the stream:
    the host would wait for every queued kernel, and async scheduling would lose its overlap. A
    non-blocking copy from pageable memory may do the same: CUDA's API sync behavior allows the driver to
    synchronize with the stream to stage it. So the values go to pinned memory first, whose copy is only
    queued; PyTorch's pinned-memory cache reuses that buffer only once the copy has run.
    """
    return pinned(torch.as_tensor(values, dtype=dtype), device).to(device, non_blocking=True)


def pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` in pinned memory when it is bound for a GPU (to_device says why), else as it is."""
    return host.pin_memory() if device.type == "cuda" else host
