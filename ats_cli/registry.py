"""Things created by name through one registry (timm's habit: ``create_model("resnet18")``).

Commands, config files and checkpoints refer to networks (:mod:`ats_cli.nets`) and
methods (:mod:`ats_cli.models`) by name plus plain keyword arguments, so a checkpoint
can be rebuilt without pickling any Python object. Each of those holds one
:class:`Registry`; this module is the pattern they share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Registry", "UnknownNameError"]


class UnknownNameError(KeyError):
    """A name that is not in its registry; the message lists the available ones."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class Registry:
    """Factories by name, each of one of ``kinds`` when kinds are given.

    ``what`` names the things in messages ("network", "method"); ``error`` is the
    :class:`UnknownNameError` subclass raised for a name that is not registered, so that
    callers can catch the one they mean. Names are listed in registration order.
    """

    def __init__(self, what: str, *, kinds: tuple[str, ...] = (), error: type[UnknownNameError] = UnknownNameError):
        self.what = what
        self.kinds = kinds
        self.error = error
        self._factories: dict[str, tuple[str | None, Callable[..., Any]]] = {}

    def register(self, name: str, kind: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: register a factory under ``name`` (and ``kind``, where the registry has kinds)."""
        if self.kinds and kind not in self.kinds:
            raise ValueError(f"kind must be one of {', '.join(map(repr, self.kinds))}, got {kind!r}")
        if not self.kinds and kind is not None:
            raise ValueError(f"{self.what}s have no kinds, got {kind!r}")

        def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._factories:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self._factories[name] = (kind, factory)
            return factory

        return wrap

    def available(self, kind: str | None = None) -> list[str]:
        """Registered names, optionally only those of one kind."""
        return [n for n, (k, _) in self._factories.items() if kind is None or k == kind]

    def check(self, name: str, kind: str | None = None) -> None:
        """Raise :attr:`error` (listing the available names) unless ``name`` is registered,
        as a ``kind`` when one is given; for callers that build the thing elsewhere (in
        another process) and want the error before they start."""
        if name not in self._factories:
            raise self.error(f"unknown {self.what} {name!r}; available: {', '.join(self.available(kind))}")
        registered_kind = self._factories[name][0]
        if kind is not None and registered_kind != kind:
            raise self.error(f"{self.what} {name!r} is a {registered_kind} {self.what}, not a {kind} {self.what}")

    def create(self, name: str, kind: str | None = None, **kwargs: Any) -> Any:
        """What the factory registered as ``name`` returns for ``kwargs``."""
        self.check(name, kind)
        return self._factories[name][1](**kwargs)
