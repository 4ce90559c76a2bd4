"""One registry for every network, created by name (like timm's ``create_model``).

Commands, config files and checkpoints refer to networks by name plus keyword
arguments, so a checkpoint can be rebuilt without pickling any Python object.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

__all__ = ["register", "create", "available", "UnknownNetworkError"]

_REGISTRY: dict[str, tuple[str, Callable[..., nn.Module]]] = {}


class UnknownNetworkError(KeyError):
    """A network name that is not in the registry."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


def register(name: str, kind: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator: register a factory under ``name``; ``kind`` is 'attention' or 'features'."""
    if kind not in ("attention", "features"):
        raise ValueError(f"kind must be 'attention' or 'features', got {kind!r}")

    def wrap(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _REGISTRY:
            raise ValueError(f"network {name!r} is registered twice")
        _REGISTRY[name] = (kind, factory)
        return factory

    return wrap


def available(kind: str | None = None) -> list[str]:
    """Registered names, optionally only those of one kind."""
    return sorted(n for n, (k, _) in _REGISTRY.items() if kind is None or k == kind)


def create(name: str, kind: str | None = None, **kwargs) -> nn.Module:
    """Build network ``name`` with ``kwargs`` (e.g. ``in_channels``).

    Attention networks map [B, C, h, w] to scores [B, 1, h', w'] and expose ``margin``
    (low-res pixels lost per side by 'valid' convolutions). Feature networks map
    patches [N, C, ph, pw] to [N, D] and expose ``out_features`` = D.
    """
    if name not in _REGISTRY:
        raise UnknownNetworkError(f"unknown network {name!r}; available: {', '.join(available(kind))}")
    net_kind, factory = _REGISTRY[name]
    if kind is not None and net_kind != kind:
        raise UnknownNetworkError(f"network {name!r} is a {net_kind} network, not a {kind} network")
    return factory(**kwargs)
