"""Training configuration: plain values, overridable from a TOML file and the command line.

Precedence: defaults < ``--config FILE`` < flags. The resolved values are written to
``RUN_DIR/config.json`` so every run records exactly what it did.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ats_cli.core.sampling import ESTIMATORS
from ats_cli.legacy import upgrade_run_config

__all__ = ["TrainConfig", "ConfigError", "load_config_file", "resolve_config"]


class ConfigError(ValueError):
    """A configuration file or value that cannot be used."""


@dataclass
class TrainConfig:
    data: str = ""
    out: str = ""
    # the method
    method: str = "ats"  # ats | uniform | deepmil | cnn (see ats_cli.models)
    # 0 = the dataset's hint (dataset.json "hints"), else DATA_DEFAULTS (the paper's Megapixel MNIST)
    n_patches: int = 0
    patch_size: int = 0
    scale: float = 0.0
    replace: bool = False
    # auto | threshold | sequential: the unbiased estimator without replacement (same expectation,
    # different variance: ats_cli.core.sampling). Runs and checkpoints from before the choice
    # existed (no key) used sequential: resuming such a run keeps sequential, predicting with
    # such a checkpoint uses auto (ats_cli.legacy says why).
    estimator: str = "auto"
    entropy: float = 0.01
    smoothing: float = 0.0
    # > 0: never sample low-res cells darker than this (black backgrounds); 0 = off; -1 = auto:
    # AUTO_MIN_BRIGHTNESS when the training images have a black background (ats_cli.train)
    min_brightness: float = -1.0
    eval_n_patches: int = 0  # 0 = same as n_patches
    feature_scale: float = 10.0  # multiplies the L2-normalised features (1 = the paper; see ATSModel)
    # auxiliary training signals (ats_cli.core.model.auxiliary_losses; 0 = off = the thesis's loss).
    # Off by default: they slowed learning in every run measured (docs/training.md, ablation)
    patch_loss: float = 0.0
    attention_loss: float = 0.0
    # reading slides and TIFFs (ats predict's options; saved in the model, so predict reads alike)
    reader: str = "auto"  # auto | openslide | tifffile | pillow
    level: int = 0  # pyramid level patches are read from
    mpp: float = 0.0  # > 0: read patches from the level closest to this many microns per pixel
    tissue_mask: str = "auto"  # auto (on for slides/TIFFs, off for other images) | on | off
    # networks (names from ats_cli.nets)
    attention_net: str = "mnist-attention"
    feature_net: str = "small-cnn"
    attention_width: int = 8
    feature_width: int = 32
    # optimisation
    optimizer: str = "adam"
    lr: float = 3e-3  # docs/training.md: faster off the plateau than the reference's 1e-3, same budget
    weight_decay: float = 0.0
    schedule: str = "cosine"  # constant | cosine
    warmup_epochs: int = 0
    clip_norm: float = 1.0  # 0 = no clipping
    batch_size: int = 32
    epochs: int = 20
    # running
    init: str = ""  # start from this checkpoint's weights (fine-tuning / curriculum); "" = random init
    seed: int = 0
    device: str = "auto"
    workers: int = 2
    amp: str = "none"  # none | bf16 | fp16 (CUDA only)

    def validate(self) -> TrainConfig:
        problems = []
        positive = ("batch_size", "epochs", "lr", "feature_scale")
        problems += [f"{k} must be > 0 (got {getattr(self, k)})" for k in positive if not getattr(self, k) > 0]
        non_negative = ("entropy", "weight_decay", "clip_norm", "workers", "warmup_epochs",
                        "eval_n_patches", "level", "mpp", "patch_loss", "attention_loss",
                        "n_patches", "patch_size", "scale")  # 0: from the data
        problems += [f"{k} must be >= 0" for k in non_negative if getattr(self, k) < 0]
        if self.min_brightness < 0 and self.min_brightness != -1:
            problems.append(f"min_brightness must be >= 0, or -1 for auto (got {self.min_brightness})")
        if self.scale > 1:
            problems.append(f"scale is the low-res view's scale and must be <= 1 (got {self.scale})")
        if self.level and self.mpp:
            problems.append("give level or mpp, not both")
        if not 0 <= self.smoothing < 1:
            problems.append(f"smoothing must be in [0, 1) (got {self.smoothing})")
        for key, allowed in (("method", ("ats", "uniform", "deepmil", "cnn")),
                             ("optimizer", ("adam", "adamw", "sgd")), ("schedule", ("constant", "cosine")),
                             ("amp", ("none", "bf16", "fp16")),
                             ("estimator", ESTIMATORS), ("tissue_mask", ("auto", "on", "off")),
                             ("reader", ("auto", "openslide", "tifffile", "pillow"))):
            if getattr(self, key) not in allowed:
                problems.append(f"{key} must be one of {', '.join(allowed)} (got {getattr(self, key)!r})")
        if problems:
            raise ConfigError("invalid configuration: " + "; ".join(problems))
        return self

    def from_data(self, hints: dict[str, Any]) -> list[str]:
        """Settle ``n_patches``, ``patch_size`` and ``scale`` left at 0 from the dataset's
        hints (a generator knows its images: Megapixel MNIST's 0.12 and 50x50, synthetic
        slides' 1/32 and 64x64), else from DATA_DEFAULTS; in place. Returns what was set,
        for the log. ``image_size``-like hints are lists; the first value is taken."""
        settled = []
        for key, fallback in DATA_DEFAULTS.items():
            if getattr(self, key):
                continue
            hint = hints.get(key)
            hint = hint[0] if isinstance(hint, list) and hint else hint
            usable = isinstance(hint, int | float) and not isinstance(hint, bool) and hint > 0
            setattr(self, key, type(fallback)(hint) if usable else fallback)
            settled.append(f"{key} {getattr(self, key)} ({'dataset.json' if usable else 'default'})")
        return settled

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def input_options(self) -> dict[str, Any]:
        """:func:`ats_cli.data.inputs.open_input`'s reading options (None = its default)."""
        return {"reader": None if self.reader == "auto" else self.reader, "level": self.level or None,
                "mpp": self.mpp or None, "tissue": {"auto": None, "on": True, "off": False}[self.tissue_mask]}


# what n_patches, patch_size and scale become when neither the user nor the dataset says
DATA_DEFAULTS: dict[str, Any] = {"n_patches": 10, "patch_size": 50, "scale": 0.12}


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (or JSON, e.g. a previous run's config.json) file of TrainConfig keys."""
    path = Path(path)
    try:
        text = path.read_text()
        values = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a valid config file ({e})") from None
    values = values.get("train", values)  # allow a [train] table
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}")
    return values


def resolve_config(file: str | Path | None = None, *, resumed: bool = False, **overrides: Any) -> TrainConfig:
    """Defaults, then the file, then the overrides that are not None.

    ``resumed``: the file is a run's saved config.json; keys it lacks because the run predates
    them take the value that run used (:func:`ats_cli.legacy.upgrade_run_config`), not today's
    default.
    """
    values: dict[str, Any] = load_config_file(file) if file else {}
    if resumed:
        values = upgrade_run_config(values)
    values.update({k: v for k, v in overrides.items() if v is not None})
    types = {f.name: type(f.default) for f in fields(TrainConfig)}
    for k, v in values.items():
        want = types[k]
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            values[k] = float(v)
        elif not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ConfigError(f"config key {k!r} must be {want.__name__}, got {v!r}")
    return TrainConfig(**values).validate()
