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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.nn as nn

from ats_cli import nets
from ats_cli.baselines import CNNClassifier, DeepMIL, UniformAttention
from ats_cli.core.model import ATSModel
from ats_cli.legacy import SPEC_VERSION, upgrade_spec
from ats_cli.registry import Registry, UnknownNameError

if TYPE_CHECKING:
    from ats_cli.config import TrainConfig

__all__ = ["UnknownMethodError", "available_methods", "create_model", "model_spec", "register_method"]

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
    A spec from an older ats is read through :func:`ats_cli.legacy.upgrade_spec` first.
    Raises :class:`UnknownMethodError` for a method that is not registered."""
    spec = upgrade_spec(spec)
    return _METHODS.create(spec["method"], spec=spec)


def model_spec(cfg: TrainConfig, *, n_classes: int, channels: int, mpp: float | None = None) -> dict[str, Any]:
    """The spec of the model ``cfg`` trains on data of ``n_classes`` and ``channels``;
    plain values only, so that a checkpoint holding it loads without running code.
    ``mpp``: the microns per pixel of the model's patches when known (--mpp, else the
    training slides': :func:`ats_cli.data.magnification.settle_physical_scale`); predict
    reads slides at that scale (``input.resample``)."""
    return {
        "version": SPEC_VERSION,
        "method": cfg.method,
        "attention_net": cfg.attention_net,
        "attention_kwargs": {"in_channels": channels, "width": cfg.attention_width},
        "feature_net": cfg.feature_net,
        "feature_kwargs": {"in_channels": channels, "width": cfg.feature_width},
        "n_classes": n_classes,
        "channels": channels,
        "n_patches": cfg.n_patches,
        "eval_n_patches": cfg.settled_eval_n_patches,  # 0 = n_patches
        "patch_size": [cfg.patch_size, cfg.patch_size],
        "scale": cfg.scale,
        "replace": cfg.replace,
        "estimator": cfg.estimator,
        "entropy_weight": cfg.entropy,
        "smoothing": cfg.smoothing,
        "min_brightness": cfg.min_brightness,
        "feature_scale": cfg.feature_scale,
        "rarity_prior": cfg.rarity_prior,
        "patch_gain": cfg.patch_gain == "on",  # settled by training (auto -> on/off) before the spec is written
        "pooling": cfg.pooling,
        "none_class": cfg.none_class == "on",
        "count_floor": cfg.count_floor,
        # how inputs were read in training: predict and visualize read them alike by default
        "input": {**cfg.input_options(), **({"mpp": float(mpp)} if mpp else {}), "resample": True},
    }


def _features(spec: dict[str, Any]) -> nn.Module:
    return nets.create(spec["feature_net"], kind="features", **spec["feature_kwargs"])


def _sampling_model(spec: dict[str, Any], attention: nn.Module) -> ATSModel:
    """ATS with ``attention``: the learned network for ``ats``, a fixed one for ``uniform``."""
    return ATSModel(
        attention,
        _features(spec),
        spec["n_classes"],
        n_patches=spec["n_patches"],
        eval_n_patches=spec["eval_n_patches"],
        patch_size=tuple(spec["patch_size"]),
        scale=spec["scale"],
        replace=spec["replace"],
        entropy_weight=spec["entropy_weight"],
        smoothing=spec["smoothing"],
        min_brightness=spec["min_brightness"],
        feature_scale=spec["feature_scale"],
        estimator=spec["estimator"],
        # U-N is uniform by definition: no prior reshapes its attention
        rarity_prior=spec["rarity_prior"] if not isinstance(attention, UniformAttention) else 0.0,
        patch_gain=bool(spec["patch_gain"]),
        pooling=spec["pooling"],
        none_class=bool(spec["none_class"]),
        count_floor=float(spec["count_floor"]),
    )


@register_method("ats")
def _ats(spec: dict[str, Any]) -> nn.Module:
    return _sampling_model(spec, nets.create(spec["attention_net"], kind="attention", **spec["attention_kwargs"]))


@register_method("uniform")
def _uniform(spec: dict[str, Any]) -> nn.Module:
    return _sampling_model(spec, UniformAttention())


@register_method("deepmil")
def _deepmil(spec: dict[str, Any]) -> nn.Module:
    return DeepMIL(_features(spec), spec["n_classes"], patch_size=tuple(spec["patch_size"]), scale=spec["scale"])


@register_method("cnn")
def _cnn(spec: dict[str, Any]) -> nn.Module:
    net = nets.create(CNN_NET, kind="features", in_channels=spec["channels"])
    return CNNClassifier(net, spec["n_classes"], scale=spec["scale"])
