"""One ``ats predict`` command before its first image: the request, the model loaded and
checked, the header line, how inputs are opened and what the run's outputs record.

Everything that can be refused (a model that cannot be used, an ``--out`` that cannot be
written, a ``--save-attention`` folder) is refused here, with one line on ``err``, before
any image is read: hours of prediction are not spent to find out at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ats_cli.io import check_writable
from ats_cli.predict import provenance
from ats_cli.predict.cohort import input_key
from ats_cli.predict.inputs import InputItem
from ats_cli.predict.predictor import Predictor

__all__ = ["Request", "announced", "load_checked", "opener", "print_header", "run_record",
           "run_settings", "worker_args"]


@dataclass(frozen=True)
class Request:
    """What ``ats predict`` was asked, flag by flag (None: the model's own setting)."""

    inputs: Sequence[str]
    model: str
    out: str | None = None
    n_patches: int | None = None
    estimator: str | None = None
    samples: int = 1
    batch_size: int = 1
    device: str = "auto"
    seed: int = 0
    recursive: bool = False
    reader: str | None = None
    level: int | None = None
    mpp: float | None = None
    tissue_mask: str | None = None
    max_pixels: int | None = None
    save_attention: Path | None = None
    overwrite: bool = False
    prefetch: bool = True
    threshold: float | None = None  # multi-label models: the decision threshold (None: 0.5)

    @property
    def to_stdout(self) -> bool:
        return self.out == "-"


def worker_args(req: Request) -> list[str]:
    """``ats predict`` arguments that reproduce ``req`` (for the processes --devices starts)."""
    args = [*req.inputs, "--model", req.model, "--out", str(req.out)]
    for name in ("n_patches", "estimator", "samples", "batch_size", "device", "seed", "reader", "level", "mpp",
                 "tissue_mask", "max_pixels", "save_attention", "threshold"):
        value = getattr(req, name)
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    args += ["--recursive"] * req.recursive + ["--overwrite"] * req.overwrite
    return args + ([] if req.prefetch else ["--no-prefetch"])


def opener(predictor: Predictor, req: Request):
    """How inputs are opened: the model's reading options overridden by the command's
    (``--tissue-mask on|off|auto``: True, False, the rule by file type)."""
    tissue = {"on": True, "off": False}.get(req.tissue_mask, req.tissue_mask)
    return predictor.opener(reader=req.reader, level=req.level, mpp=req.mpp, tissue=tissue, max_pixels=req.max_pixels)


def announced(predictor: Predictor, req: Request, err: Console):
    """:func:`opener` whose first input read each way says how (level, resampling) on ``err``."""
    from ats_cli.data.inputs import announce_readings

    return announce_readings(opener(predictor, req),
                             lambda line: err.print(escape(line), soft_wrap=True, highlight=False))


def run_settings(predictor: Predictor, req: Request, world_size: int, device_type: str | None = None
                 ) -> dict[str, Any]:
    """The settings that change a probability (written in every part file), with the
    values in force: an unset --n-patches is the model's, and the estimator is the one
    prediction uses (``auto`` is ``threshold``), so that naming the model's own value does
    not make another run. ``device_type``: where the workers predict, when not on
    ``predictor.device`` (the --devices launcher loads the model on the CPU)."""
    net = predictor.model  # a loaded predictor's model is in eval mode
    values = {"n_patches": req.n_patches or getattr(net, "patches_now", None),
              "estimator": getattr(net, "active_estimator", None), "samples": req.samples,
              "batch_size": req.batch_size, "seed": req.seed, "device": device_type or predictor.device.type}
    if predictor.threshold is not None:  # multi-label: it decides the prediction column
        values["threshold"] = predictor.threshold
    reading = opener(predictor, req).keywords
    return provenance.settings(provenance.model_digest(predictor.path), values, reading, world_size)


def run_record(predictor: Predictor, settings: dict[str, Any], items: Sequence[InputItem]) -> dict[str, Any]:
    """``--out FILE``'s record (:mod:`ats_cli.predict.provenance`): :func:`run_settings`
    for these inputs."""
    return provenance.record(predictor.path, predictor.classes, settings, [input_key(i.path) for i in items])


def print_header(console: Console, predictor: Predictor, items: Sequence[InputItem], req: Request,
                 procs: str = "") -> None:
    """The line before the predictions: model, inputs and the sampling settings in force
    (without --n-patches: the model's evaluation count, ATSModel.patches_now in the eval
    mode a loaded predictor is in; '-' for a model that does not sample)."""
    from ats_cli.predict.report import estimator_note, levels_note

    n_ok_inputs = sum(item.error is None for item in items)
    n_patches = req.n_patches or getattr(predictor.model, "patches_now", "-")
    console.print(f"model {predictor.path} ({len(predictor.classes)} classes, {predictor.device}{procs}); "
                  f"{n_ok_inputs} image(s); n_patches {n_patches}, "
                  f"{estimator_note(predictor.model)}samples {req.samples}, seed {req.seed}"
                  + levels_note(predictor.model)
                  + ("" if predictor.threshold is None else f"; multi-label, threshold {predictor.threshold:g}"))


def load_checked(req: Request, device: str, err: Console, *, check_out: bool) -> Predictor | None:
    """The model and the checks made before any image is read; None after saying why."""
    from ats_cli.checkpoint import CheckpointError
    from ats_cli.data.images import max_pixels_limit
    from ats_cli.predict.predictor import load_predictor

    try:
        max_pixels_limit(req.max_pixels)
        predictor = load_predictor(req.model, device, estimator=req.estimator, threshold=req.threshold)
    except (CheckpointError, ValueError, RuntimeError) as e:
        err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        return None
    if check_out:
        try:
            check_writable(str(req.out))
        except OSError as e:
            err.print(f"[red]error:[/] cannot write {escape(str(req.out))}: {escape(e.strerror or str(e))} (nothing "
                      "was predicted)", soft_wrap=True)
            return None
    if req.save_attention is not None and not _attention_writable(req.save_attention, predictor, err):
        return None
    return predictor


def _attention_writable(folder: Path, predictor: Predictor, err: Console) -> bool:
    """--save-attention DIR: the model must have an attention map and DIR must be writable
    (checked before any work); False after saying why."""
    from ats_cli.models import check_model

    try:
        check_model(predictor.model)
        check_writable(folder / "probe.geojson")
    except ValueError as e:
        err.print(f"[red]error:[/] --save-attention: {escape(str(e))}", soft_wrap=True)
        return False
    except OSError as e:
        err.print(f"[red]error:[/] cannot write to {escape(str(folder))}: {escape(e.strerror or str(e))} "
                  "(nothing was predicted)", soft_wrap=True)
        return False
    return True
