"""Host tensors onto the device without a pageable copy (the prompt's ids, the prefill's inputs)."""
from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`. A CPU tensor reaches a GPU through pinned memory, without blocking: PyTorch waits for the
    stream after a copy from pageable memory, i.e. for every step queued on it (the caching host allocator keeps the
    pinned block until its copy has run, so it is never rewritten early)."""
    if host.device.type != "cpu" or device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
