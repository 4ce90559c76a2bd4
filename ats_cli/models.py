"""Models, created by name from a spec: the one factory behind train, predict, visualize
and benchmark.

A model is described by its *spec*, plain values that a checkpoint stores: the method
(a name in this module's registry), the networks (names in :mod:`ats_cli.nets`) and the
settings. :func:`model_spec` writes a spec from a training configuration;
:func:`create_model` builds the model a spec describes, through the method registered
under its name, so a checkpoint is rebuilt without unpickling anything. The methods:

* ``ats`` -- attention sampling (:class:`ats_cli.core.model.ATSModel`);
* ``uniform``, ``deepmil``, ``cnn`` -- the thesis's baselines (:mod:`ats_cli.baselines`);
* ``ips`` -- iterative patch selection (Bergner et al. 2023, :mod:`ats_cli.baselines_ips`);
* ``tile-mil`` -- every tissue tile encoded once by a frozen encoder, gated attention-MIL on
  the stored features (CLAM-SB, :mod:`ats_cli.baselines_tilemil`).

A new method is a function from a spec to a model, decorated with
``@register_method("name")``.

The spec layout (:data:`SPEC_VERSION`, 2): the method and network names with their keyword
arguments, ``n_classes``, ``channels``, the sampling settings of
:class:`~ats_cli.core.model.ATSModel` (``n_patches``, ``eval_n_patches``, ``patch_size``,
``scale``, ``replace``, ``estimator``, ``entropy_weight``, ``feature_scale``,
``patch_loss``), the four extension slots as plain specs (``"pooling": {"name": "counts",
"none_class": true, "floor": 0.02}``; ``support``, ``prior`` and ``gain`` likewise or null:
:mod:`ats_cli.extensions`), ``position`` (the position features' options, or null),
``multilabel`` (one sigmoid per class: :mod:`ats_cli.multilabel`), ``levels`` and
``input``, how training read its inputs. A two-level ``ats`` model
(:class:`~ats_cli.core.nested_model.NestedATSModel`, ``levels`` 2) adds ``regions``,
``eval_regions``, ``region_size``, ``coarse_scale``, ``region_temperature`` and
``eval_coarse_scale`` (:func:`ats_cli.config.levels_spec`; training or ``ats export`` may
set the last); a one-level spec (``levels`` 1) has none of them. An ``ips`` spec adds
``ips_memory``, ``ips_iter`` and ``ips_stride`` (0 = the patch size); no other method's has them. Every key is written:
an off setting is written as its off value, never left out.

Version 1 (the released models of 0.1.0) left a setting out when it was off and the reader
filled in what it meant. :func:`migrate_spec` turns a spec of any version this ats knows
into the current layout, one step per version (:data:`MIGRATIONS`), when a checkpoint is
loaded and when a model is created, so that an old checkpoint builds the very model it
built before.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ats_cli import nets
from ats_cli.baselines import CNNClassifier, DeepMIL, UniformAttention
from ats_cli.baselines_ips import IPSModel
from ats_cli.baselines_tilemil import TileMIL
from ats_cli.config import COUNTING_POOLINGS, VOTING_POOLINGS, ConfigError, TrainConfig, levels_spec, rarity_cap
from ats_cli.core.model import ATSModel
from ats_cli.nets.encoders import feature_spec
from ats_cli.registry import Registry, UnknownNameError

__all__ = ["MIGRATIONS", "SPEC_VERSION", "SpecVersionError", "UnknownMethodError", "available_methods",
           "check_model", "check_patch_size", "create_model", "migrate_spec", "model_spec", "register_method"]

# The spec layout this ats writes (see the module docstring). A change of which keys a spec
# holds or what one means bumps it and adds the migration from the previous version to
# MIGRATIONS; a spec of a later version is refused by name (ats_cli.checkpoint).
SPEC_VERSION = 2


class SpecVersionError(ValueError):
    """A model spec of a version this ats cannot read: a later one, or a pre-release layout."""


def _v1_to_v2(spec: dict[str, Any]) -> dict[str, Any]:
    """Version 1 left a setting out when it was off: fill in what version 1's reader
    assumed for each absent key (no patch loss, no position features, one label per image,
    one level; a two-level model's evaluation regions and coarse view as trained, a region
    temperature of 1; an input option absent read as its default, None)."""
    new = {"patch_loss": 0.0, "position": None, "multilabel": False, "levels": 1, **spec, "version": 2}
    if new["levels"] == 2:
        new = {"eval_regions": 0, "eval_coarse_scale": 0.0, "region_temperature": 1.0, **new}
    new["input"] = {**dict.fromkeys(("reader", "level", "mpp", "tissue", "resample")), **(spec.get("input") or {})}
    return new


# version -> the function from a spec of that version to one of the next
MIGRATIONS = {1: _v1_to_v2}


def migrate_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` in the current layout (:data:`SPEC_VERSION`), through one migration per
    version from its own; a new dict, ``spec`` itself untouched. Raises
    :class:`SpecVersionError` for a later version, and for the layout before the first
    release: it went through versions 0 to 6, one of which was also numbered 1, and every
    spec of it holds ``smoothing``, which no released layout does, so that one is told apart."""
    version = spec.get("version", 0)
    if "smoothing" in spec or not isinstance(version, int) or version < min(MIGRATIONS):
        raise SpecVersionError(f"model spec version {version!r} was written by a pre-release ats; this ats reads "
                               f"spec versions {min(MIGRATIONS)} to {SPEC_VERSION}: retrain the model")
    if version > SPEC_VERSION:
        raise SpecVersionError(f"model spec version {version} is newer than this ats ({SPEC_VERSION}); upgrade ats")
    while version < SPEC_VERSION:
        spec = MIGRATIONS[version](spec)
        version = spec["version"]
    return dict(spec)

CNN_NET = "resnet18"  # the CNN baseline's network name (thesis: a ResNet on the downsampled image)


class UnknownMethodError(UnknownNameError):
    """A method name that is not in the registry; the message lists the available ones."""


_METHODS = Registry("method", error=UnknownMethodError)


def register_method(name: str):
    """Decorator: register ``factory(spec) -> nn.Module`` as method ``name``."""
    return _METHODS.register(name)


def available_methods() -> list[str]:
    """The registered method names, attention sampling first, then the thesis's baselines, then ips and tile-mil."""
    return _METHODS.available()


def create_model(spec: dict[str, Any]) -> nn.Module:
    """The model ``spec`` describes, with fresh weights (load a state dict into it).
    ``spec`` may be of any version :func:`migrate_spec` reads. Raises
    :class:`UnknownMethodError` for a method that is not registered, :class:`SpecVersionError`
    for a spec of a version this ats cannot read. A spec with
    ``"multilabel": true`` gives a model read with one sigmoid per class (:mod:`ats_cli.multilabel`)."""
    spec = migrate_spec(spec)
    model = _METHODS.create(spec["method"], spec=spec)
    if spec["multilabel"]:
        model.multilabel = True
    return model


def model_spec(cfg: TrainConfig, *, n_classes: int, channels: int, mpp: float | None = None) -> dict[str, Any]:
    """The spec of the model ``cfg`` trains on data of ``n_classes`` and ``channels``;
    plain values only, so that a checkpoint holding it loads without running code.
    ``mpp``: the microns per pixel of the model's patches when known (--mpp, else the
    training slides': :func:`ats_cli.config.settle`); predict
    reads slides at that scale (``input.resample``). A pretrained encoder's name is resolved
    into the recipe it is rebuilt from (:func:`ats_cli.nets.encoders.feature_spec`)."""
    feature_net, feature_kwargs = feature_spec(cfg.feature_net, channels=channels, width=cfg.feature_width,
                                               train=cfg.feature_train)
    return {
        "version": SPEC_VERSION,
        "method": cfg.method,
        "attention_net": cfg.attention_net,
        "attention_kwargs": {"in_channels": channels, "width": cfg.attention_width},
        "feature_net": feature_net,
        "feature_kwargs": feature_kwargs,
        "n_classes": n_classes,
        "channels": channels,
        "n_patches": cfg.n_patches,
        "eval_n_patches": cfg.settled_eval_n_patches,  # 0 = n_patches
        "patch_size": [cfg.patch_size, cfg.patch_size],
        "scale": cfg.scale,
        "replace": cfg.replace,
        "estimator": cfg.estimator,
        "entropy_weight": cfg.entropy,
        "feature_scale": cfg.feature_scale,
        "patch_loss": float(cfg.patch_loss) if cfg.patch_loss > 0 and cfg.method == "ats" else 0.0,
        "multilabel": False,  # one sigmoid per class: set by ats train for multi-label data
        **extension_specs(cfg),
        "levels": 1,
        **levels_spec(cfg, mpp),  # a two-level model's keys, levels 2 among them
        **ips_spec(cfg),  # iterative patch selection's M, I and grid stride, for --method ips only
        # how inputs were read in training: predict and visualize read them alike by default
        "input": {**cfg.input_options(), **({"mpp": float(mpp)} if mpp else {}), "resample": True},
    }


def ips_spec(cfg: TrainConfig) -> dict[str, int]:
    """``--method ips``'s keys of the spec (memory M, iteration size I, grid stride, 0 = the
    patch size); none for any other method, so that their specs stay as they were."""
    if cfg.method != "ips":
        return {}
    return {"ips_memory": int(cfg.ips_memory), "ips_iter": int(cfg.ips_iter), "ips_stride": int(cfg.ips_stride)}


def extension_specs(cfg: TrainConfig) -> dict[str, dict[str, Any] | None]:
    """The extension slots (:mod:`ats_cli.extensions`) ``cfg``'s flags select, as plain specs:
    ``--pooling``, ``none_class``, ``count_floor`` and ``eval_count_floor`` the pooling; ``min_brightness``
    the ``bright`` support; ``rarity_prior`` and ``rarity_cap`` the ``rarity`` prior (never for ``uniform``,
    whose attention is uniform by definition); ``patch_gain`` the ``learned`` gain. A
    value still at auto (-1, settled by training) or at 0 selects nothing, except the cap,
    whose auto follows from the prior and the levels alone (:func:`ats_cli.config.settle`)."""
    # auto still unsettled (a spec made without ats train's settle): what settle gives without a hint
    pooling: dict[str, Any] = {"name": "features" if cfg.pooling == "auto" else cfg.pooling}
    if cfg.pooling in VOTING_POOLINGS:
        pooling["none_class"] = cfg.none_class == "on"  # auto still unsettled: off, as settle without a hint
    if cfg.pooling in COUNTING_POOLINGS:
        pooling["floor"] = max(float(cfg.count_floor), 0.0)  # auto (-1) still unsettled: 0, likewise
        if cfg.eval_count_floor >= 0 and float(cfg.eval_count_floor) != pooling["floor"]:
            # present only when it differs: a model read at its training floor keeps the spec it always had
            pooling["eval_floor"] = float(cfg.eval_count_floor)
    return {
        "pooling": pooling,
        "support": {"name": "bright", "threshold": float(cfg.min_brightness)} if cfg.min_brightness > 0 else None,
        "prior": {"name": "rarity", "weight": float(cfg.rarity_prior),
                  **({"cap": float(cap)} if (cap := rarity_cap(cfg)) > 0 else {})}  # absent: as it always was
        if cfg.rarity_prior > 0 and cfg.method != "uniform" else None,
        "gain": {"name": "learned"} if cfg.patch_gain in ("on", "late") else None,  # late: train._optimizer
        # its features, and the attention's view (ats_cli.extensions.position)
        "position": {"frequencies": 4, "attention": True} if cfg.position_features == "on" else None,
    }


def _features(spec: dict[str, Any]) -> nn.Module:
    return nets.create(spec["feature_net"], kind="features", **spec["feature_kwargs"])


def _sampling_model(spec: dict[str, Any], attention: nn.Module, *, prior: bool = True) -> ATSModel:
    """ATS with ``attention``: the learned network for ``ats``, a fixed one for ``uniform``
    (``prior`` False: nothing reshapes a uniform attention)."""
    settings = _sampling_settings(spec)
    if not prior:
        settings["prior"] = None
    return ATSModel(attention, _features(spec), spec["n_classes"], **settings)


def _sampling_settings(spec: dict[str, Any]) -> dict[str, Any]:
    """:class:`ATSModel`'s keyword arguments from a spec."""
    return dict(
        n_patches=spec["n_patches"],
        patch_size=tuple(spec["patch_size"]),
        scale=spec["scale"],
        replace=spec["replace"],
        estimator=spec["estimator"],
        entropy_weight=spec["entropy_weight"],
        eval_n_patches=spec["eval_n_patches"],
        feature_scale=spec["feature_scale"],
        pooling=spec["pooling"],
        support=spec["support"],
        prior=spec["prior"],
        gain=spec["gain"],
        # the feature side's options; "attention" is the attention net's (_ats)
        position={k: v for k, v in spec["position"].items() if k != "attention"} if spec["position"] else None,
        patch_loss=spec["patch_loss"],
    )


@register_method("ats")
def _ats(spec: dict[str, Any]) -> nn.Module:
    kwargs = spec["attention_kwargs"]
    positional = (spec["position"] or {}).get("attention")  # the view and each cell's place
    if positional:
        kwargs = {**kwargs, "in_channels": kwargs["in_channels"] + 2}  # (ats_cli.extensions.position)
    attention = nets.create(spec["attention_net"], kind="attention", **kwargs)
    if positional:
        from ats_cli.extensions.position import PositionalAttention

        attention = PositionalAttention(attention)
    if spec["levels"] == 2:  # the coarse attention is a second net of the same kind
        from ats_cli.core.nested_model import NestedATSModel

        coarse = nets.create(spec["attention_net"], kind="attention", **spec["attention_kwargs"])
        return NestedATSModel(coarse, attention, _features(spec), spec["n_classes"], regions=spec["regions"],
                              eval_regions=spec["eval_regions"], region_size=spec["region_size"],
                              eval_coarse_scale=spec["eval_coarse_scale"],
                              coarse_scale=spec["coarse_scale"], region_temperature=spec["region_temperature"],
                              **_sampling_settings(spec))
    return _sampling_model(spec, attention)


@register_method("uniform")
def _uniform(spec: dict[str, Any]) -> nn.Module:
    return _sampling_model(spec, UniformAttention(), prior=False)


@register_method("deepmil")
def _deepmil(spec: dict[str, Any]) -> nn.Module:
    return DeepMIL(_features(spec), spec["n_classes"], patch_size=tuple(spec["patch_size"]), scale=spec["scale"])


@register_method("cnn")
def _cnn(spec: dict[str, Any]) -> nn.Module:
    net = nets.create(CNN_NET, kind="features", in_channels=spec["channels"])
    return CNNClassifier(net, spec["n_classes"], scale=spec["scale"])


@register_method("ips")
def _ips(spec: dict[str, Any]) -> nn.Module:
    stride = spec["ips_stride"]
    return IPSModel(_features(spec), spec["n_classes"], patch_size=tuple(spec["patch_size"]),
                    stride=(stride, stride) if stride else None, memory=spec["ips_memory"],
                    iteration=spec["ips_iter"], scale=spec["scale"])


@register_method("tile-mil")
def _tile_mil(spec: dict[str, Any]) -> nn.Module:
    return TileMIL(_features(spec), spec["n_classes"], tile_size=spec["patch_size"][0], scale=spec["scale"])


def check_model(model) -> None:
    """ValueError unless ``model`` has an attention map to export with its patches: one that
    samples patches from an attention over its low-res view (``--method ats`` or
    ``uniform``), or tile-mil's attention over its tiles (the cells are then the tiles). Deep
    MIL's map is over an overlapping grid and the CNN reads no patches."""
    if not isinstance(model, (ATSModel, TileMIL)):
        raise ValueError(f"GeoJSON export needs an attention-sampling model (--method ats or uniform) or a tile-mil "
                         f"one; this one is a {type(model).__name__}")


def check_patch_size(model: nn.Module, spec: dict[str, Any]) -> None:
    """ConfigError unless ``model``'s feature network reads one patch of the spec's size.

    Why: a network of unpadded convolutions (the paper's ``mnist-features``) has a smallest
    input, and a patch under it fails deep inside torch at the first step, far from the
    flag that chose it. One blank patch through the network when a run builds its model
    says it at the start, naming the flag. Models without a feature network (the CNN
    baseline reads the low-res view) have nothing to check."""
    import torch

    feature_net = getattr(model, "feature_net", None)
    if feature_net is None:
        return
    ph, pw = spec["patch_size"]
    was_training = feature_net.training
    feature_net.eval()  # batch norm takes a batch of one
    try:
        with torch.no_grad():
            feature_net(torch.zeros(1, spec["channels"], ph, pw))
    except RuntimeError as e:
        problem = str(e).splitlines()[0]
        raise ConfigError(f"--patch-size {ph}: the feature network {spec['feature_net']} cannot read {ph}x{pw} "
                          f"patches ({problem}); give larger patches or another --feature-net") from None
    finally:
        feature_net.train(was_training)
