"""Host-to-device copies that never make the host wait.

A plain ``tensor.to("cuda")`` from ordinary (pageable) host memory is synchronous: CUDA
stages the bytes through a pinned buffer and torch waits for the copy before returning,
so the host cannot queue the next kernels meanwhile. From page-locked (pinned) memory the
copy is a DMA the host only enqueues (``non_blocking=True``): the step's launches keep
flowing. torch's caching host allocator keeps a pinned block alive until the copy that
reads it has run, so the host tensor may be dropped right after the call.
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(tensor: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    """``tensor`` on ``device``, copied asynchronously (pinned first) when it goes from the
    host to a CUDA device; unchanged when it is there already; None stays None."""
    if tensor is None:
        return None
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
