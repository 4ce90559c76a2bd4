"""One registry for every network, created by name (like timm's ``create_model``).

Commands, config files and checkpoints refer to networks by name plus keyword
arguments, so a checkpoint can be rebuilt without pickling any Python object.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from ats_cli.registry import Registry, UnknownNameError

__all__ = ["register", "register_prefix", "create", "check", "available", "UnknownNetworkError"]


class UnknownNetworkError(UnknownNameError):
    """A network name that is not in the registry."""


_NETS = Registry("network", kinds=("attention", "features"), error=UnknownNetworkError)
# families of networks named "PREFIX:NAME" (timm:resnet50): prefix -> (kind, factory(name, **kwargs))
_PREFIXES: dict[str, tuple[str, Callable[..., nn.Module]]] = {}


def register(name: str, kind: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator: register a factory under ``name``; ``kind`` is 'attention' or 'features'."""
    return _NETS.register(name, kind)


def register_prefix(prefix: str, factory: Callable[..., nn.Module], *, kind: str) -> None:
    """Register ``factory(name, **kwargs)`` for every name ``PREFIX:...`` (a library's models
    by their own names: :mod:`ats_cli.nets.encoders`)."""
    _PREFIXES[prefix] = (kind, factory)


def _family(name: str, kind: str | None) -> Callable[..., nn.Module] | None:
    """The prefix factory for ``name``, None for a plain name; raises for the wrong kind."""
    prefix, sep, _ = name.partition(":")
    if not sep or prefix not in _PREFIXES:
        return None
    registered_kind, factory = _PREFIXES[prefix]
    if kind is not None and kind != registered_kind:
        raise UnknownNetworkError(f"network {name!r} is a {registered_kind} network, not a {kind} network")
    return factory


def available(kind: str | None = None) -> list[str]:
    """Registered names, optionally only those of one kind."""
    return sorted(_NETS.available(kind))


def check(name: str, kind: str | None = None) -> None:
    """Raise :class:`UnknownNetworkError` unless ``name`` is a registered network (of ``kind``)
    or has a registered prefix."""
    if _family(name, kind) is None:
        _NETS.check(name, kind)


def create(name: str, kind: str | None = None, **kwargs) -> nn.Module:
    """Build network ``name`` with ``kwargs`` (e.g. ``in_channels``).

    Attention networks map [B, C, h, w] to scores [B, 1, h', w'] and expose ``margin``
    (low-res pixels lost per side by 'valid' convolutions). Feature networks map
    patches [N, C, ph, pw] to [N, D] and expose ``out_features`` = D.
    """
    factory = _family(name, kind)
    return factory(name, **kwargs) if factory else _NETS.create(name, kind, **kwargs)
