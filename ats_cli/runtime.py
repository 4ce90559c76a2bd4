"""Where and how code runs: device choice and peak-memory measurement."""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["resolve_device", "peak_memory_mb", "reset_peak_memory"]


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' = CUDA when present, else CPU; anything else is passed to torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available on this machine")
    return device


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak bytes allocated by tensors since the last reset. CPU: the process's peak
    resident set size so far (ru_maxrss; it cannot be reset, so it is a high-water mark)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10
