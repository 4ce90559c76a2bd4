"""Saving and loading models and training state, safely.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, loaded with
``torch.load(weights_only=True)``: loading a file never runs code from it. The model is
rebuilt from its *spec* (method and network names from the registries plus plain
settings) by :func:`ats_cli.models.create_model`, never unpickled. A spec of an earlier
version is migrated to the current one as it is loaded (:func:`ats_cli.models.migrate_spec`:
an old checkpoint builds the model it always built); a later or pre-release one is refused
by name. Writes are
atomic (temporary file + rename): a crash or Ctrl-C during a save leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import importlib
import io
import os
import zipfile
from pathlib import Path
from typing import Any

import torch

from ats_cli.io import atomic_write_bytes, load_refusal
from ats_cli.models import SpecVersionError, create_model, migrate_spec

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "load_model"]

FORMAT = "ats-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A file that is not a usable ats checkpoint; the message names the file."""


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
    """The checkpoint dict of ``path``; raises :class:`CheckpointError` naming the file when
    it is missing, foreign, damaged, newer, or holds a model spec of a version this ats cannot
    read. Its spec is in the current layout (:func:`ats_cli.models.migrate_spec`), whatever
    version the file holds.

    ``path`` may also name a model in the Hugging Face Hub's form (:mod:`ats_cli.hub`): a
    directory of ``config.json`` + ``model.safetensors``, or ``hf-hub:ORG/NAME``; and a run
    directory, for its ``best.pt`` (else ``last.pt``). The Hub's reader is imported by name:
    it builds on this module (its errors, its checks) and on the export that writes the form."""
    hub = importlib.import_module("ats_cli.hub")

    if hub.is_hub_ref(path) or Path(path).is_dir():
        path = hub.locate(path)
        if path.is_dir():
            return hub.read_model_dir(path)
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: model file not found")
    kind = _foreign_kind(path)
    if kind:
        raise CheckpointError(f"{path}: not an ats checkpoint ({kind}); a checkpoint is the best.pt or last.pt "
                              "that ats train writes in its run folder")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for foreign or corrupt files
        raise CheckpointError(f"{path}: not an ats checkpoint ({_load_problem(e)})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an ats checkpoint (no '{FORMAT}' marker)")
    if ckpt.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: checkpoint version {ckpt['version']} is newer than this ats ({VERSION})")
    _check_finite(path, ckpt.get("model"))
    if isinstance(ckpt.get("spec"), dict):
        try:
            ckpt["spec"] = migrate_spec(ckpt["spec"])
        except SpecVersionError as e:
            raise CheckpointError(f"{path}: {e}") from None
    return ckpt


_IMAGE_MAGIC = ((b"\x89PNG", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
                (b"II+\x00", "BigTIFF"), (b"MM\x00+", "BigTIFF"), (b"GIF8", "GIF"), (b"BM", "BMP"))


def _foreign_kind(path: Path) -> str | None:
    """What ``path`` plainly is when it is not a checkpoint ("a text file", "a PNG image"),
    from its first bytes; None when it may be one. Without this a notes file or a
    dataset.json reached ``torch.load``, whose refusal quotes a pickle opcode ("101",
    "Python object (123)") that tells a user nothing about the file they gave. torch.save
    writes a zip archive ("PK") or, in the legacy format, a pickle (first byte 0x80):
    those go on to ``torch.load``, which reads only tensors and plain values."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if not head:
        return "an empty file"
    if head.startswith(b"PK"):
        return _foreign_zip(path)
    if head[0] == 0x80:
        return None
    for magic, name in _IMAGE_MAGIC:
        if head.startswith(magic):
            return f"a {name} image"
    if b"\x00" not in head:
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as e:
            text = head[:e.start].decode("utf-8") if e.start > len(head) - 4 else None  # a cut multi-byte char
        if text is not None:
            first = text.lstrip()[:1]
            return "a JSON file" if first in ("{", "[") else "a text file"
    return "a binary file of another kind: torch.save writes a zip archive or a pickle"


def _foreign_zip(path: Path) -> str | None:
    """A zip archive that torch.save did not write (it writes ``NAME/data.pkl``): a NumPy
    .npz, or another archive, named with its first members; None for a torch one."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return None  # let torch.load say what is wrong with it
    if any(n.endswith("data.pkl") for n in names):
        return None
    kind = "a NumPy .npz archive" if names and all(n.endswith(".npy") for n in names) else "a zip archive"
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{kind} of {shown}" if names else f"{kind}, empty"


def _load_problem(e: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file (:func:`ats_cli.io.load_refusal`)."""
    what, first = load_refusal(e)
    if what is not None:
        return (f"it holds a Python object{what} where a checkpoint holds only tensors and plain values; it was "
                "refused without running anything. Use checkpoints written by ats train")
    return f"cannot be read safely: {first}"


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


def load_model(path: str | os.PathLike[str], device: str | torch.device = "cpu"
               ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model of a checkpoint (or of any model :func:`load_checkpoint` reads), in eval
    mode on ``device``, and the checkpoint dict."""
    ckpt = load_checkpoint(path)
    try:
        model = create_model(ckpt["spec"])
        model.load_state_dict(ckpt["model"])
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: checkpoint does not match its model spec ({e})") from None
    return model.to(device).eval(), ckpt
