"""Models, created by name from a spec: the one factory behind train, predict, visualize
and benchmark.

A model is described by its *spec*, plain values that a checkpoint stores: the method
(a name in this module's registry), the networks (names in :mod:`ats_cli.nets`) and the
settings. :func:`model_spec` writes a spec from a training configuration;
:func:`create_model` builds the model a spec describes, through the method registered
under its name, so a checkpoint is rebuilt without unpickling anything. The methods:

* ``ats`` -- attention sampling (:class:`ats_cli.core.model.ATSModel`);
* ``uniform``, ``deepmil``, ``cnn`` -- the thesis's baselines (:mod:`ats_cli.baselines`).

A new method is a function from a spec to a model, decorated with
``@register_method("name")``.

The spec layout (:data:`SPEC_VERSION`): the method and network names with their keyword
arguments, ``n_classes``, ``channels``, the sampling settings of
:class:`~ats_cli.core.model.ATSModel` (``n_patches``, ``eval_n_patches``, ``patch_size``,
``scale``, ``replace``, ``estimator``, ``entropy_weight``, ``feature_scale``), the four
extension slots as plain specs (``"pooling": {"name": "counts", "none_class": true,
"floor": 0.02}``; ``support``, ``prior`` and ``gain`` likewise or null:
:mod:`ats_cli.extensions`) and ``input``, how training read its inputs. A two-level
``ats`` model (:class:`~ats_cli.core.nested_model.NestedATSModel`) adds ``levels`` (2),
``regions``, ``region_size``, ``coarse_scale``, ``region_temperature`` and
``eval_coarse_scale`` (:func:`ats_cli.config.levels_spec`; training or ``ats export`` may
set the last); a one-level spec has none of them.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ats_cli import nets
from ats_cli.baselines import CNNClassifier, DeepMIL, UniformAttention
from ats_cli.config import COUNTING_POOLINGS, VOTING_POOLINGS, ConfigError, TrainConfig, levels_spec, rarity_cap
from ats_cli.core.model import ATSModel
from ats_cli.nets.encoders import feature_spec
from ats_cli.registry import Registry, UnknownNameError

__all__ = ["SPEC_VERSION", "UnknownMethodError", "available_methods", "check_model", "check_patch_size",
           "create_model", "model_spec", "register_method"]

# The spec layout this ats writes and reads (see the module docstring). A change of what a
# key means bumps it; a checkpoint of another version is refused by name (ats_cli.checkpoint).
SPEC_VERSION = 1

CNN_NET = "resnet18"  # the CNN baseline's network name (thesis: a ResNet on the downsampled image)


class UnknownMethodError(UnknownNameError):
    """A method name that is not in the registry; the message lists the available ones."""


_METHODS = Registry("method", error=UnknownMethodError)


def register_method(name: str):
    """Decorator: register ``factory(spec) -> nn.Module`` as method ``name``."""
    return _METHODS.register(name)


def available_methods() -> list[str]:
    """The registered method names, attention sampling first, then the baselines."""
    return _METHODS.available()


def create_model(spec: dict[str, Any]) -> nn.Module:
    """The model ``spec`` describes, with fresh weights (load a state dict into it).
    Raises :class:`UnknownMethodError` for a method that is not registered. A spec with
    ``"multilabel": true`` gives a model read with one sigmoid per class (:mod:`ats_cli.multilabel`)."""
    model = _METHODS.create(spec["method"], spec=spec)
    if spec.get("multilabel"):
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
        # present only when on, so that the spec of a model without it is what it always was
        **({"patch_loss": float(cfg.patch_loss)} if cfg.patch_loss > 0 and cfg.method == "ats" else {}),
        **extension_specs(cfg),
        **levels_spec(cfg, mpp),
        # how inputs were read in training: predict and visualize read them alike by default
        "input": {**cfg.input_options(), **({"mpp": float(mpp)} if mpp else {}), "resample": True},
    }


def extension_specs(cfg: TrainConfig) -> dict[str, dict[str, Any] | None]:
    """The extension slots (:mod:`ats_cli.extensions`) ``cfg``'s flags select, as plain specs:
    ``--pooling``, ``--none-class``, ``--count-floor`` and ``--eval-count-floor`` the pooling; ``--min-brightness``
    the ``bright`` support; ``--rarity-prior`` and ``--rarity-cap`` the ``rarity`` prior (never for ``uniform``,
    whose attention is uniform by definition); ``--patch-gain`` the ``learned`` gain. A
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
        # present only when on, so that the spec of a model without it is what it always was
        # (its features, and the attention's view: ats_cli.extensions.position)
        **({"position": {"frequencies": 4, "attention": True}} if cfg.position_features == "on" else {}),
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
        position={k: v for k, v in spec["position"].items() if k != "attention"} if spec.get("position") else None,
        patch_loss=spec.get("patch_loss", 0.0),
    )


@register_method("ats")
def _ats(spec: dict[str, Any]) -> nn.Module:
    kwargs = spec["attention_kwargs"]
    positional = (spec.get("position") or {}).get("attention")  # the view and each cell's place
    if positional:
        kwargs = {**kwargs, "in_channels": kwargs["in_channels"] + 2}  # (ats_cli.extensions.position)
    attention = nets.create(spec["attention_net"], kind="attention", **kwargs)
    if positional:
        from ats_cli.extensions.position import PositionalAttention

        attention = PositionalAttention(attention)
    if spec.get("levels", 1) == 2:  # the coarse attention is a second net of the same kind
        from ats_cli.core.nested_model import NestedATSModel

        coarse = nets.create(spec["attention_net"], kind="attention", **spec["attention_kwargs"])
        return NestedATSModel(coarse, attention, _features(spec), spec["n_classes"], regions=spec["regions"],
                              eval_regions=spec.get("eval_regions", 0), region_size=spec["region_size"],
                              eval_coarse_scale=spec.get("eval_coarse_scale", 0.0),
                              coarse_scale=spec["coarse_scale"], region_temperature=spec.get("region_temperature", 1.0),
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


def check_model(model) -> None:
    """ValueError unless ``model`` samples patches from an attention map over its low-res
    view (``--method ats`` or ``uniform``): Deep MIL reads a fixed grid and the CNN no
    patches, so neither has patches and cells to export."""
    if not isinstance(model, ATSModel):
        raise ValueError(f"GeoJSON export needs an attention-sampling model (--method ats or uniform); this one is a "
                         f"{type(model).__name__}")


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
