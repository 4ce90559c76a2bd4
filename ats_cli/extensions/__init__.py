"""Extensions of attention sampling: the named pieces a kind of data adds to the thesis's model.

:class:`ats_cli.core.model.ATSModel` is the method of the thesis. What a task needs beyond
it plugs into one of four slots, each with a registry of its own (in :mod:`ats_cli.registry`):

* ``pooling`` -- what the estimator averages and how the logits are read from the estimate
  (:mod:`.pooling`: ``features``, the thesis's; :mod:`.pooling_votes`; :mod:`.pooling_counts`;
  :mod:`.pooling_highest`; :mod:`.pooling_topmost`);
* ``support`` -- which low-res cells may be sampled at all (:mod:`.support`; :mod:`.support_bright`);
* ``prior`` -- a fixed log-prior added to the attention scores (:mod:`.prior`; :mod:`.prior_rarity`);
* ``gain`` -- a per-patch factor on the unit-norm feature (:mod:`.gain`; :mod:`.gain_learned`).

Each is created from a plain spec, ``{"name": ..., **options}`` (:func:`create_extension`),
the form a checkpoint stores, so that a model is rebuilt without unpickling anything.

Adding one is adding a file to this package that registers what it defines with
:func:`register_extension` when it is imported, and one line in :data:`EXTENSIONS` below
saying which module registers the name (and what it does, in a few words). Why the table:
the name is also a value of the kind's flag (``--pooling``), and ``ats --help`` lists the
values without importing torch, which every extension module does; the table is read
instead, and the modules are imported when an extension is made or the registry is listed
(:func:`available_extensions`). A test holds the table and what the modules register to the
same names and order. A module outside this package that registers a name before the
configuration is read (``ats_cli.config``) adds its value too.

Why they all keep the estimator unbiased: its argument (step (*) of
:func:`ats_cli.core.sampling.expectation`) asks only that the value pooled for a cell be a
deterministic, differentiable function of the parameters and the input, the same whichever
cells are drawn, and that the draws come from the distribution the weights are computed
for. A support or a prior changes that distribution (the weights follow it); a gain or a
pooling changes the value of a cell. Each module says why its piece keeps both conditions;
tests/test_extensions.py checks each by Monte Carlo, beside a biased variant it rejects.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ats_cli.registry import KINDS, Registry, UnknownNameError

__all__ = ["EXTENSIONS", "KINDS", "ExtensionError", "UnknownExtensionError", "available_extensions",
           "create_extension", "extension_choices", "register_extension"]

# kind -> name -> (the module of this package that registers it, the note beside the name in
# its flag's help), in the order the flag lists them
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
    kind's modules in :data:`EXTENSIONS` for None): an import runs the registrations."""
    registry = _registry(kind)
    for known, (module, _) in EXTENSIONS[kind].items():
        if name is None or known == name:
            importlib.import_module(f"{__name__}.{module}")
    return registry


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
