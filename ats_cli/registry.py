"""Everything created by name, in one place: networks, extensions, and the pattern they share.

Commands, config files and checkpoints refer to networks (:mod:`ats_cli.nets`),
extensions (:mod:`ats_cli.extensions`) and methods (:mod:`ats_cli.models`) by name plus
plain keyword arguments (timm's habit: ``create_model("resnet18")``), so a checkpoint can
be rebuilt without pickling any Python object. One module, because it is one idea: a
:class:`Registry` of factories by name, with a named :class:`UnknownNameError` subclass per
thing so that a caller catches the one it means. The factories themselves live with what
they build: a network module registers itself with :func:`register_net`, an extension
module with :func:`register_extension`, a method with :func:`ats_cli.models.register_method`;
importing their package registers them all (this module imports none of them).
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "ExtensionError", "Registry", "UnknownExtensionError", "UnknownNameError", "UnknownNetworkError",
           "available_extensions", "available_nets", "check_net", "create_extension", "create_net",
           "extension_choices", "register_extension", "register_net"]


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


# -- networks (:mod:`ats_cli.nets`) ----------------------------------------------------------


class UnknownNetworkError(UnknownNameError):
    """A network name that is not in the registry."""


_NETS = Registry("network", kinds=("attention", "features"), error=UnknownNetworkError)


def register_net(name: str, kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a network factory under ``name``; ``kind`` is 'attention' or 'features'."""
    return _NETS.register(name, kind)


def available_nets(kind: str | None = None) -> list[str]:
    """Registered network names (sorted), optionally only those of one kind."""
    return sorted(_NETS.available(kind))


def check_net(name: str, kind: str | None = None) -> None:
    """Raise :class:`UnknownNetworkError` unless ``name`` is a registered network (of ``kind``)."""
    _NETS.check(name, kind)


def create_net(name: str, kind: str | None = None, **kwargs: Any) -> Any:
    """Build network ``name`` with ``kwargs`` (e.g. ``in_channels``).

    Attention networks map [B, C, h, w] to scores [B, 1, h', w'] and expose ``margin``
    (low-res pixels lost per side by 'valid' convolutions). Feature networks map
    patches [N, C, ph, pw] to [N, D] and expose ``out_features`` = D.
    """
    return _NETS.create(name, kind, **kwargs)


# -- extensions (:mod:`ats_cli.extensions`) --------------------------------------------------

KINDS = ("pooling", "support", "prior", "gain")


class UnknownExtensionError(UnknownNameError):
    """An extension name that is not registered for its kind; the message lists those that are."""


class ExtensionError(ValueError):
    """An extension spec that is not a name plus options the extension takes."""


_EXTENSIONS = {kind: Registry(kind, error=UnknownExtensionError) for kind in KINDS}


def _extensions(kind: str) -> Registry:
    if kind not in _EXTENSIONS:
        raise ValueError(f"unknown kind of extension {kind!r}; choose from {', '.join(KINDS)}")
    return _EXTENSIONS[kind]


def register_extension(kind: str, name: str, *, note: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a class (or factory) as the ``kind`` extension ``name``. It is
    called with the model's dimensions its kind passes (see :func:`create_extension`) and
    the spec's options as keyword arguments. ``note``: what it does in a few words, the
    text beside its name in the flag's help (:func:`extension_choices` reads it, as written,
    from the file)."""
    return _extensions(kind).register(name)


def available_extensions(kind: str) -> list[str]:
    """The names registered for ``kind``, in registration order (the extension modules are
    registered when :mod:`ats_cli.extensions` is imported)."""
    return _extensions(kind).available()


def create_extension(kind: str, spec: dict[str, Any], **dims: Any) -> Any:
    """The ``kind`` extension ``spec`` describes: ``{"name": NAME, **options}``. ``dims``
    are what the model knows and the extension may need (``features``, ``n_classes``).
    Raises :class:`UnknownExtensionError` for a name not registered, :class:`ExtensionError`
    for a spec that is not a dict with a name or holds an option the extension does not take."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ExtensionError(f"a {kind} spec is a dict with a 'name', got {spec!r}")
    options = {k: v for k, v in spec.items() if k != "name"}
    registry = _extensions(kind)
    registry.check(spec["name"])
    try:
        return registry.create(spec["name"], **dims, **options)
    except TypeError as e:  # an option the extension does not take, or one missing
        raise ExtensionError(f"{kind} {spec['name']!r}: {e}") from None


def extension_choices(kind: str) -> dict[str, str]:
    """The ``kind`` extensions (name -> note) as the extension files register them, read
    from the files rather than imported: a flag's allowed values (``--pooling``) and its help
    come from here, and ``ats --help`` must not import torch, which every extension does.
    Adding a file to :mod:`ats_cli.extensions` thus adds its flag value. The files are read
    in the order :mod:`ats_cli.extensions` imports them, so this lists what
    :func:`available_extensions` lists after the import, in the same order (tested)."""
    _extensions(kind)
    spec = importlib.util.find_spec("ats_cli.extensions")  # finds the package without running it
    files = {m.name: Path(m.module_finder.path) / f"{m.name}.py"  # type: ignore[union-attr]
             for m in pkgutil.iter_modules(spec.submodule_search_locations if spec else ())}
    choices: dict[str, str] = {}
    done: set[str] = set()

    def read(name: str) -> None:  # as an import runs it: the sibling extensions it imports first
        done.add(name)
        if not files[name].is_file():
            return
        for node in ast.walk(ast.parse(files[name].read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ats_cli.extensions."):
                sibling = node.module.rpartition(".")[2]  # type: ignore[union-attr]
                if sibling in files and sibling not in done:
                    read(sibling)
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_extension"
                    and len(node.args) == 2 and all(isinstance(a, ast.Constant) for a in node.args)
                    and node.args[0].value == kind):
                notes = [k.value.value for k in node.keywords if k.arg == "note" and isinstance(k.value, ast.Constant)]
                choices[node.args[1].value] = notes[0] if notes else ""

    for name in files:
        if name not in done:
            read(name)
    return choices
