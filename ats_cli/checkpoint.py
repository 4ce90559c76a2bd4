"""Saving and loading models and training state, safely.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, loaded with
``torch.load(weights_only=True)``: loading a file never runs code from it. The model is
rebuilt from its *spec* (network names from the registry plus plain settings), never
unpickled. Writes are atomic (temporary file + rename): a crash or Ctrl-C during a save
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import torch

from ats_cli.core.model import ATSModel
from ats_cli.io import atomic_write_bytes
from ats_cli.methods import build_method

__all__ = ["CheckpointError", "build_model", "save_checkpoint", "load_checkpoint", "load_model", "model_spec"]

FORMAT = "ats-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A file that is not a usable ats checkpoint; the message names the file."""


def model_spec(cfg: Any, *, n_classes: int, channels: int) -> dict[str, Any]:
    """The plain-values description from which :func:`build_model` rebuilds a model."""
    return {
        "method": cfg.method,
        "attention_net": cfg.attention_net,
        "attention_kwargs": {"in_channels": channels, "width": cfg.attention_width},
        "feature_net": cfg.feature_net,
        "feature_kwargs": {"in_channels": channels, "width": cfg.feature_width},
        "n_classes": n_classes,
        "channels": channels,
        "n_patches": cfg.n_patches,
        "patch_size": [cfg.patch_size, cfg.patch_size],
        "scale": cfg.scale,
        "replace": cfg.replace,
        "estimator": cfg.estimator,
        "entropy_weight": cfg.entropy,
        "smoothing": cfg.smoothing,
        "min_brightness": cfg.min_brightness,
        "feature_scale": cfg.feature_scale,
        # how inputs were read in training: predict and visualize read them alike by default
        "input": cfg.input_options(),
    }


def build_model(spec: dict[str, Any]) -> ATSModel:
    """The spec's model; its ``method`` (ats, uniform, deepmil, cnn) picks the class."""
    return build_method(spec)


def save_checkpoint(path: str | os.PathLike[str], *, spec: dict, classes: list[str], model: torch.nn.Module,
                    **state: Any) -> None:
    """Write ``spec``, ``classes``, the model weights and any extra ``state`` (optimizer
    state dict, epoch, RNG states, config, metrics) atomically to ``path``."""
    payload = {"format": FORMAT, "version": VERSION, "spec": spec, "classes": list(classes),
               "model": model.state_dict(), **state}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def load_checkpoint(path: str | os.PathLike[str], map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: model file not found")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for foreign or corrupt files
        raise CheckpointError(f"{path}: not an ats checkpoint ({_load_problem(e)})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an ats checkpoint (no '{FORMAT}' marker)")
    if ckpt.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: checkpoint version {ckpt['version']} is newer than this ats ({VERSION})")
    _check_finite(path, ckpt.get("model"))
    return ckpt


def _load_problem(e: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, without PyTorch's advice to
    load it with ``weights_only=False``: for a file from elsewhere that advice means
    running whatever code it carries, which is exactly what the refusal prevented."""
    text = str(e).strip()
    blocked = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"Unsupported operand (\d+)", text)
    if blocked or "Weights only load failed" in text:
        what = f" ({blocked.group(1)})" if blocked else ""
        return (f"it holds a Python object{what} where a checkpoint holds only tensors and plain values; it was "
                "refused without running anything. Use checkpoints written by ats train")
    lines = [line.strip() for line in text.splitlines() if line.strip() and "weights_only" not in line]
    return f"cannot be read safely: {lines[0] if lines else type(e).__name__}"


def _check_finite(path: Path, weights: Any) -> None:
    """A model whose weights hold NaN or infinity predicts nonsense (every probability NaN)
    without failing: refuse it by name."""
    if not isinstance(weights, dict):
        return
    for name, value in weights.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                raise CheckpointError(f"{path}: weight {name} holds {bad} NaN/infinite value(s) of {value.numel()}; "
                                      "the file is damaged or its training diverged, and it cannot be used")


def load_model(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> tuple[ATSModel, dict[str, Any]]:
    """The model of a checkpoint, in eval mode on ``device``, and the checkpoint dict."""
    ckpt = load_checkpoint(path)
    try:
        model = build_model(ckpt["spec"])
        model.load_state_dict(ckpt["model"])
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: checkpoint does not match its model spec ({e})") from None
    return model.to(device).eval(), ckpt
