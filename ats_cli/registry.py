"""Everything created by name, in one place: networks, extensions, and the pattern they share.

Commands, config files and checkpoints refer to networks (:mod:`ats_cli.nets`),
extensions (:mod:`ats_cli.extensions`) and methods (:mod:`ats_cli.models`) by name plus
plain keyword arguments (timm's habit: ``create_model("resnet18")``), so a checkpoint can
be rebuilt without pickling any Python object. One module, because it is one idea: a
:class:`Registry` of factories by name, with a named :class:`UnknownNameError` subclass per
thing so that a caller catches the one it means. The factories themselves live with what
they build: a network module registers itself with :func:`register_net`, an extension
module with :func:`register_extension`, a method with :func:`ats_cli.models.register_method`;
importing their package registers them all. This module imports none of them: an extension
module is imported by name when its extension is made (:data:`EXTENSIONS`, the table of
which module registers which name, lists the names for the flags and their help without
importing torch, which every extension module does).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["PRETRAINED_FEATURE_NET", "RANDOM_FEATURE_NET",
           "EXTENSIONS", "KINDS", "ExtensionError", "Registry", "UnknownExtensionError", "UnknownNameError",
           "UnknownNetworkError", "available_extensions", "available_nets", "check_net", "create_extension",
           "create_net", "discover_extensions", "extension_choices", "register_extension", "register_net",
           "register_net_prefix"]


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


# --feature-net auto settles to one of these (ats_cli.config._feature_net says why): the
# pretrained encoder RGB images start from when its weights can be had, else a random net
PRETRAINED_FEATURE_NET, RANDOM_FEATURE_NET = "timm:convnext_atto.d2_in1k", "small-cnn"
_NETS = Registry("network", kinds=("attention", "features"), error=UnknownNetworkError)
# families of networks named "PREFIX:NAME" (timm:resnet50): prefix -> (kind, factory(name, **kwargs))
_NET_PREFIXES: dict[str, tuple[str, Callable[..., Any]]] = {}


def register_net(name: str, kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a network factory under ``name``; ``kind`` is 'attention' or 'features'."""
    return _NETS.register(name, kind)


def register_net_prefix(prefix: str, factory: Callable[..., Any], *, kind: str) -> None:
    """Register ``factory(name, **kwargs)`` for every network name ``PREFIX:...`` (a library's
    models by their own names: :mod:`ats_cli.nets.encoders`)."""
    _NET_PREFIXES[prefix] = (kind, factory)


def _net_family(name: str, kind: str | None) -> Callable[..., Any] | None:
    """The prefix factory for ``name``, None for a plain name; raises for the wrong kind."""
    prefix, sep, _ = name.partition(":")
    if not sep or prefix not in _NET_PREFIXES:
        return None
    registered_kind, factory = _NET_PREFIXES[prefix]
    if kind is not None and kind != registered_kind:
        raise UnknownNetworkError(f"network {name!r} is a {registered_kind} network, not a {kind} network")
    return factory


def available_nets(kind: str | None = None) -> list[str]:
    """Registered network names (sorted), optionally only those of one kind."""
    return sorted(_NETS.available(kind))


def check_net(name: str, kind: str | None = None) -> None:
    """Raise :class:`UnknownNetworkError` unless ``name`` is a registered network (of ``kind``)
    or has a registered prefix."""
    if _net_family(name, kind) is None:
        _NETS.check(name, kind)


def create_net(name: str, kind: str | None = None, **kwargs: Any) -> Any:
    """Build network ``name`` with ``kwargs`` (e.g. ``in_channels``).

    Attention networks map [B, C, h, w] to scores [B, 1, h', w'] and expose ``margin``
    (low-res pixels lost per side by 'valid' convolutions). Feature networks map
    patches [N, C, ph, pw] to [N, D] and expose ``out_features`` = D. A name ``PREFIX:...``
    goes to its prefix's factory (:func:`register_net_prefix`).
    """
    factory = _net_family(name, kind)
    return factory(name, **kwargs) if factory else _NETS.create(name, kind, **kwargs)


# -- extensions (:mod:`ats_cli.extensions`) --------------------------------------------------

KINDS = ("pooling", "support", "prior", "gain")  # an extension's slot in the model

# kind -> name -> (the module of ats_cli.extensions that registers it, the note beside the name
# in its flag's help), in the order the flag lists them: a new extension file adds its line here
EXTENSIONS: dict[str, dict[str, tuple[str, str]]] = {
    "pooling": {
        "features": ("pooling", "their features, then the classifier: the thesis"),
        "votes": ("pooling_votes", "each patch's class probabilities: a soft vote"),
        "counts": ("pooling_counts", "those over the attention mass around each patch: each object counts once"),
        "highest": ("pooling_highest", "the label is the highest class present: a grade, task max"),
        "highest-counts": ("pooling_highest", "highest, each object once: presence from counts"),
        "topmost-counts": ("pooling_topmost", "the class of the top-most object: task top"),
    },
    "support": {"bright": ("support_bright", "")},
    "prior": {"rarity": ("prior_rarity", "")},
    "gain": {"learned": ("gain_learned", "")},
}


class UnknownExtensionError(UnknownNameError):
    """An extension name that is not registered for its kind; the message lists those that are."""


class ExtensionError(ValueError):
    """An extension spec that is not a name plus options the extension takes."""


_REGISTRIES = {kind: Registry(kind, error=UnknownExtensionError) for kind in KINDS}
# names registered from outside the table (a module of one's own): name -> note, per kind
_OTHERS: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}


def _registry(kind: str) -> Registry:
    if kind not in _REGISTRIES:
        raise ValueError(f"unknown kind of extension {kind!r}; choose from {', '.join(KINDS)}")
    return _REGISTRIES[kind]


def register_extension(kind: str, name: str, *, note: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a class (or factory) as the ``kind`` extension ``name``. It is
    called with the model's dimensions its kind passes (see :func:`create_extension`) and
    the spec's options as keyword arguments. ``note``: what it does in a few words, the text
    beside its name in the flag's help, for a name registered from outside :data:`EXTENSIONS`
    (a name in the table has its note there)."""
    wrap = _registry(kind).register(name)
    if name not in EXTENSIONS.get(kind, {}):
        _OTHERS[kind][name] = note
    return wrap


def _load(kind: str, name: str | None = None) -> Registry:
    """``kind``'s registry with the module that registers ``name`` imported (all of the
    kind's modules in :data:`EXTENSIONS` for None): an import runs the registrations. A
    name the table does not know, and nothing has registered, is looked for in every
    module of the package (:func:`discover_extensions`)."""
    registry = _registry(kind)
    for known, (module, _) in EXTENSIONS[kind].items():
        if name is None or known == name:
            importlib.import_module(f"ats_cli.extensions.{module}")
    if name is not None and name not in EXTENSIONS[kind] and name not in registry.available():
        discover_extensions()
    return registry


_DISCOVERED = False


def discover_extensions() -> None:
    """Import every module of :mod:`ats_cli.extensions` (each of its ``__path__`` folders),
    so that a file added there registers its names with no other file touched: a name
    outside :data:`EXTENSIONS` is found when a configuration or a checkpoint names it. Why
    only then: the table lists the shipped ones for ``ats --help`` without importing torch,
    which every extension module does. Once a process."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    import pkgutil

    package = importlib.import_module("ats_cli.extensions")
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"ats_cli.extensions.{info.name}")
    _DISCOVERED = True


def available_extensions(kind: str) -> list[str]:
    """The names registered for ``kind``: those of :data:`EXTENSIONS` in its order (their
    modules imported), then any registered from elsewhere."""
    registered = _load(kind).available()
    return [n for n in EXTENSIONS[kind] if n in registered] + [n for n in registered if n not in EXTENSIONS[kind]]


def extension_choices(kind: str) -> dict[str, str]:
    """The ``kind`` extensions (name -> note), from :data:`EXTENSIONS` and what has been
    registered from elsewhere so far, without importing any extension module: a flag's
    allowed values (``--pooling``) and its help come from here, and ``ats --help`` must not
    import torch."""
    _registry(kind)
    return {**{n: note for n, (_, note) in EXTENSIONS[kind].items()}, **_OTHERS[kind]}


def create_extension(kind: str, spec: dict[str, Any], **dims: Any) -> Any:
    """The ``kind`` extension ``spec`` describes: ``{"name": NAME, **options}``. ``dims``
    are what the model knows and the extension may need (``features``, ``n_classes``).
    Raises :class:`UnknownExtensionError` for a name not registered, :class:`ExtensionError`
    for a spec that is not a dict with a name or holds an option the extension does not take."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ExtensionError(f"a {kind} spec is a dict with a 'name', got {spec!r}")
    options = {k: v for k, v in spec.items() if k != "name"}
    registry = _load(kind, spec["name"])
    if spec["name"] not in registry.available():
        raise UnknownExtensionError(f"unknown {kind} {spec['name']!r}; available: "
                                    f"{', '.join(available_extensions(kind))}")
    try:
        return registry.create(spec["name"], **dims, **options)
    except TypeError as e:  # an option the extension does not take, or one missing
        raise ExtensionError(f"{kind} {spec['name']!r}: {e}") from None
