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
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
