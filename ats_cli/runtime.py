"""Where and how code runs: device choice, peak-memory measurement, stop signals."""

from __future__ import annotations

import contextlib
import resource
import signal
import sys
import threading
from collections.abc import Iterator

import torch

__all__ = ["resolve_device", "peak_memory_mb", "reset_peak_memory", "stop_signals_interrupt"]


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


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM stops the work as Ctrl-C does (KeyboardInterrupt: training
    saves its state and stops), and so does SIGINT where it was ignored.

    Why: a batch scheduler ends a job with SIGTERM (SLURM on preemption or at the time
    limit, ``timeout``, ``kill``), and a job started in the background by a non-interactive
    shell inherits SIGINT *ignored*, so ``timeout -s INT`` or ``kill -INT`` would not reach
    it: either way the epoch's work would be lost. The previous handlers come back on exit.
    Off the main thread (where Python allows no handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _interrupt)
    if previous[signal.SIGINT] == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
