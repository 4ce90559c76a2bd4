"""One registry per kind of extension, and the one way to create an extension from its spec."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ats_cli.registry import Registry, UnknownNameError

__all__ = ["KINDS", "ExtensionError", "UnknownExtensionError", "available_extensions", "create_extension",
           "register"]

KINDS = ("pooling", "support", "prior", "gain")


class UnknownExtensionError(UnknownNameError):
    """An extension name that is not registered for its kind; the message lists those that are."""


class ExtensionError(ValueError):
    """An extension spec that is not a name plus options the extension takes."""


_REGISTRIES = {kind: Registry(kind, error=UnknownExtensionError) for kind in KINDS}


def _registry(kind: str) -> Registry:
    if kind not in _REGISTRIES:
        raise ValueError(f"unknown kind of extension {kind!r}; choose from {', '.join(KINDS)}")
    return _REGISTRIES[kind]


def register(kind: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a class (or factory) as the ``kind`` extension ``name``. It is
    called with the model's dimensions its kind passes (see :func:`create_extension`) and
    the spec's options as keyword arguments."""
    return _registry(kind).register(name)


def available_extensions(kind: str) -> list[str]:
    """The names registered for ``kind``, in registration order."""
    return _registry(kind).available()


def create_extension(kind: str, spec: dict[str, Any], **dims: Any) -> Any:
    """The ``kind`` extension ``spec`` describes: ``{"name": NAME, **options}``. ``dims``
    are what the model knows and the extension may need (``features``, ``n_classes``).
    Raises :class:`UnknownExtensionError` for a name not registered, :class:`ExtensionError`
    for a spec that is not a dict with a name or holds an option the extension does not take."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ExtensionError(f"a {kind} spec is a dict with a 'name', got {spec!r}")
    options = {k: v for k, v in spec.items() if k != "name"}
    registry = _registry(kind)
    registry.check(spec["name"])
    try:
        return registry.create(spec["name"], **dims, **options)
    except TypeError as e:  # an option the extension does not take, or one missing
        raise ExtensionError(f"{kind} {spec['name']!r}: {e}") from None
