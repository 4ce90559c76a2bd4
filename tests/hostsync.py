"""Counting the calls that make the host wait for the device, on a machine without one.

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` raises at any synchronising call.
On a CPU nothing synchronises, so this shim stands in: while it is active, every Tensor
method (and torch function) that on a GPU reads a value back to the host -- ``item``,
``tolist``, ``cpu``, ``to("cpu")``, ``numpy``, ``bool(t)``, ``int(t)``, ``float(t)``,
``t.__index__``, ``nonzero``/``argwhere``/``masked_select``/``unique``, printing, and
indexing with a boolean mask -- is counted when it is called from code outside torch
(torch's own internals, e.g. the optimisers reading their host-side step counters, are
torch's business; the CUDA test covers them where it runs). ``exclude``: more source
folders whose calls are not counted (the lazy readers, which work on host data by
contract). What it cannot see on a CPU: a copy from pageable host memory to the device,
since there is no device; the CUDA test catches those.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
from collections.abc import Iterable

import torch

METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
           "argwhere", "masked_select", "unique", "__repr__", "__format__")
FUNCTIONS = ("nonzero", "argwhere", "masked_select", "unique")
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _is_host_target(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.split(":")[0] == "cpu"


def _has_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostSyncCounter:
    """Context manager; ``calls`` lists (what, file:line) of every counted call."""

    def __init__(self, exclude: Iterable[str | os.PathLike] = ()):
        self.exclude = tuple(str(p).rstrip(os.sep) + os.sep for p in exclude) + (TORCH_DIR,)
        self.calls: list[tuple[str, str]] = []
        self._saved: list[tuple[object, str, object, bool]] = []

    @property
    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(what for what, _ in self.calls))

    def _note(self, what: str) -> None:
        frame = sys._getframe(2)
        path = frame.f_code.co_filename
        if not path.startswith(self.exclude) and path != __file__:
            self.calls.append((what, f"{path}:{frame.f_lineno}"))

    def _patch(self, owner, name: str, wrap) -> None:
        own = name in vars(owner)
        original = getattr(owner, name)
        self._saved.append((owner, name, original, own))
        setattr(owner, name, wrap(original))

    def __enter__(self) -> HostSyncCounter:
        def counted(name, original, when=lambda args, kwargs: True):
            @functools.wraps(original)
            def wrapper(*args, **kwargs):
                if when(args, kwargs):
                    self._note(name)
                return original(*args, **kwargs)
            return wrapper

        for name in METHODS:
            self._patch(torch.Tensor, name, functools.partial(counted, name))
        self._patch(torch.Tensor, "to", functools.partial(
            counted, "to('cpu')", when=lambda args, kwargs: _is_host_target(args[1:], kwargs)))
        for name in ("__getitem__", "__setitem__"):
            self._patch(torch.Tensor, name, functools.partial(
                counted, f"{name}[bool mask]", when=lambda args, kwargs: _has_mask(args[1])))
        for name in FUNCTIONS:
            self._patch(torch, name, functools.partial(counted, f"torch.{name}"))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original, own in reversed(self._saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._saved.clear()
