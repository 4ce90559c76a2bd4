"""Where and how code runs: device choice, peak-memory measurement, stop signals."""

from __future__ import annotations

import contextlib
import resource
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["resolve_device", "peak_memory_mb", "reset_peak_memory", "stop_signals_interrupt", "Deferred",
           "deferred_interrupts"]


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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _stop_handlers(choose: Callable[[int, Any], Any]) -> Iterator[None]:
    """Within the block, each stop signal's handler is ``choose(sig, previous)`` (None: the
    previous one stays); the previous handlers come back on exit. Off the main thread
    (where Python allows no handlers) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig, handler in previous.items():
        chosen = choose(sig, handler)
        if chosen is not None:
            signal.signal(sig, chosen)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM stops the work as Ctrl-C does (KeyboardInterrupt: training
    saves its state and stops), and so does SIGINT where it was ignored.

    Why: a batch scheduler ends a job with SIGTERM (SLURM on preemption or at the time
    limit, ``timeout``, ``kill``), and a job started in the background by a non-interactive
    shell inherits SIGINT *ignored*, so ``timeout -s INT`` or ``kill -INT`` would not reach
    it: either way the epoch's work would be lost. The previous handlers come back on exit.
    Off the main thread (where Python allows no handlers) it does nothing."""

    def choose(sig, previous):
        if sig == signal.SIGTERM:
            return _interrupt
        return signal.default_int_handler if previous == signal.SIG_IGN else None

    with _stop_handlers(choose):
        yield


class Deferred:
    """What :func:`deferred_interrupts` saw: ``stopped`` is True when a stop signal came."""

    stopped: bool = False


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[Deferred]:
    """Within the block, Ctrl-C and SIGTERM are noted instead of acted on; the caller checks
    ``.stopped`` after it and stops cleanly.

    Why: training writes an epoch's checkpoints, its metrics line and its curves in one
    block; an interrupt in the middle (the first matplotlib import can take seconds) used to
    surface as a traceback and exit 1 although the epoch was saved. Deferred, the block
    finishes and the run stops with "interrupted at the end of epoch N". Where SIGINT is
    ignored it stays ignored. Off the main thread it defers nothing."""
    seen = Deferred()

    def note(signum, frame) -> None:
        seen.stopped = True

    with _stop_handlers(lambda sig, previous: None if previous == signal.SIG_IGN else note):
        yield seen
