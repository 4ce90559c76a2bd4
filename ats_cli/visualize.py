"""Pictures and GeoJSON of what the model looks at: the one place that runs the model for them.

Each command runs the model once, seeded, and reads everything a picture says off that
one output: the attention, the patches it drew, the estimator weights the estimate used
and each draw's contribution to the prediction (``ATSOutput.weights`` and
``.contributions``). The renderers in :mod:`ats_cli.render` draw those records and
recompute nothing, so the figure, the GeoJSON and the prediction never disagree about
what the model did. What is read from files for the pictures (a dataset CSV's label and
boxes, a run directory's epochs, the image at display size) is found here too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ats_cli.checkpoint import CheckpointError
from ats_cli.core.sampling import entropy as attention_entropy
from ats_cli.data.dataset import KNOWN_SPLITS
from ats_cli.data.inputs import OpenedImage
from ats_cli.models import check_model
from ats_cli.multilabel import NO_CLASS, class_probabilities
from ats_cli.predict import Predictor, load_predictor, read_inputs_csv
from ats_cli.render.evolution import EpochPanel, EvolutionFigure, draw_evolution
from ats_cli.render.figure import AttentionFigure, draw_attention
from ats_cli.render.geojson import feature_collection, write_geojson
from ats_cli.render.records import AttentionRecord, DigitBox, parse_boxes, patch_sites

__all__ = [
    "GeoJSONSummary",
    "ImageInfo",
    "RenderSummary",
    "check_model",
    "epoch_checkpoints",
    "find_image_info",
    "render_attention",
    "render_evolution",
    "sample_attention",
    "select_epochs",
    "write_attention_geojson",
]

MAX_PANELS = 8
DISPLAY_SIDE = 1000  # the image under the heat is read at about this many pixels on its long side
PREVIEW_SIDE = 1024  # the GeoJSON preview's thumbnail, long side
_EPOCH_FILE = re.compile(r"epoch_(\d+)\.pt$")


# ---------------------------------------------------------------------------- ground truth


@dataclass(frozen=True)
class ImageInfo:
    """What a dataset CSV knows about an image: its label and its ``digits`` boxes (may be empty)."""

    csv: Path
    label: str | None
    boxes: list[DigitBox]


def find_image_info(image: str | os.PathLike[str], data: str | os.PathLike[str] | None = None) -> ImageInfo | None:
    """Look ``image`` up in dataset CSVs to get its label and digit boxes.

    ``data`` is a dataset directory (its train/val/test CSVs are searched) or one CSV.
    Without it, the CSVs named train/val/test.csv in the image's directory and the two
    directories above it are searched, which finds ``DATA/test/00003.png`` in
    ``DATA/test.csv`` as the generators write them. None when the image is in none.
    """
    target = Path(os.path.normpath(Path(image).expanduser().absolute()))
    if data is not None:
        data = Path(data).expanduser()
        csvs = [data] if data.is_file() else [data / f"{s}.csv" for s in KNOWN_SPLITS]
    else:
        dirs = [target.parent, *list(target.parents)[1:3]]
        csvs = [d / f"{s}.csv" for d in dirs for s in KNOWN_SPLITS]
    for csv_path in csvs:
        if not csv_path.is_file():
            continue
        for item in read_inputs_csv(csv_path):
            if item.error is None and Path(os.path.normpath(item.path.absolute())) == target:
                boxes = item.extra.get("digits") or item.extra.get("boxes")
                return ImageInfo(csv_path, item.label, [DigitBox(*b) for b in parse_boxes(boxes)])
    return None


def _image_info(image, data) -> ImageInfo | None:
    """:func:`find_image_info`, None when a CSV cannot be read: the GeoJSON does without."""
    try:
        return find_image_info(image, data)
    except Exception:  # noqa: BLE001 - the label and boxes are extras
        return None


# ---------------------------------------------------------------------------- epochs


def epoch_checkpoints(run_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """``{epoch: RUN_DIR/epochs/epoch_NNN.pt}`` in epoch order; CheckpointError naming the
    directory when there are none (not a run directory, or no epoch finished yet)."""
    run_dir = Path(run_dir)
    folder = run_dir / "epochs"
    found = {}
    if folder.is_dir():
        for p in folder.iterdir():
            m = _EPOCH_FILE.fullmatch(p.name)
            if m and p.is_file():
                found[int(m.group(1))] = p
    if not found:
        raise CheckpointError(f"{run_dir}: no epochs/epoch_NNN.pt files (a run directory of `ats train` "
                              "has one per finished epoch)")
    return dict(sorted(found.items()))


def select_epochs(spec: str | None, available: Sequence[int], max_panels: int = MAX_PANELS) -> list[int]:
    """Epochs to draw: ``spec`` is ``all`` (or None) or a comma list such as ``1,5,10``
    (``last`` = the latest). More than ``max_panels`` are thinned to that many, evenly
    spaced, always keeping the first and the last: past ~8 panels each is too small to read."""
    available = sorted(available)
    if spec is None or spec.strip().lower() == "all":
        wanted = available
    else:
        wanted = []
        for part in spec.split(","):
            part = part.strip().lower()
            if not part:
                continue
            if part == "last":
                value = available[-1]
            else:
                try:
                    value = int(part)
                except ValueError:
                    raise ValueError(f"--epochs: {part!r} is not an epoch number (give e.g. 1,5,10 or all)") from None
            if value not in available:
                raise ValueError(f"--epochs: epoch {value} has no checkpoint; saved epochs: {_ranges(available)}")
            if value not in wanted:
                wanted.append(value)
        wanted.sort()
    if len(wanted) > max_panels:
        picks = np.linspace(0, len(wanted) - 1, max_panels).round().astype(int)
        wanted = [wanted[i] for i in sorted(set(picks.tolist()))]
    return wanted


def _ranges(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values) if len(values) <= 12 else f"{values[0]}..{values[-1]}"


def _metrics(run_dir: Path) -> dict[int, dict]:
    out = {}
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                record = json.loads(line)
                out[int(record["epoch"])] = record
            except (ValueError, KeyError, TypeError):
                continue
    except OSError:
        pass
    return out


# ---------------------------------------------------------------------------- the model, once


@dataclass(frozen=True)
class RenderSummary:
    """What a figure shows, for the command line to report."""

    out: Path
    size_px: tuple[int, int]  # (width, height)
    prediction: str | None = None
    probability: float | None = None
    label: str | None = None
    epochs: tuple[int, ...] = ()
    n_boxes: int = 0
    n_sites: int = 0  # distinct sampled patch locations, one box each
    strip: tuple[tuple[int, int], ...] = ()  # (row, col) of the patches in the strip, in its order
    reading: str | None = None  # how a slide was read (ats_cli.data.inputs.describe_reading)


@dataclass(frozen=True)
class GeoJSONSummary:
    """What ``ats visualize --out X.geojson`` reports."""

    out: Path
    prediction: str
    probability: float
    n_patches: int
    n_cells: int
    level: int
    downsample: float
    label: str | None = None
    reading: str | None = None  # how the slide was read (ats_cli.data.inputs.describe_reading)
    preview: Path | None = None
    preview_px: tuple[int, int] | None = None  # (width, height)


def sample_attention(predictor: Predictor, opened: OpenedImage, *, n_patches: int | None, seed: int,
                     return_patches: bool = False, path: str | os.PathLike[str] | None = None):
    """One seeded sampling of ``opened``, as ``ats predict`` runs it (a slide's tissue mask
    included): the forward pass every picture of it is drawn from, so the same seed shows
    the same patches in the figure and the GeoJSON. ``path``: the file ``opened`` was read
    from, for a model with a feature store (tile-mil: its tiles' features read back, keyed
    as ``ats predict`` keys them)."""
    from ats_cli.data.inputs import batch_sources

    generator = torch.Generator(device=predictor.device).manual_seed(seed)
    mask = None if opened.support is None else opened.support[None]
    keys = predictor.feature_keys(None if path is None else [path], batch_sources([opened.source]))
    with torch.no_grad():
        out = predictor.model(opened.low[None].to(predictor.device), [opened.source], n_patches=n_patches,
                              generator=generator, return_patches=return_patches, support_mask=mask,
                              **({} if keys is None else {"feature_keys": keys}))
    predictor.flush_features()
    return out


def _open(model, image, device: str, reading: Mapping[str, object] | None):
    """(predictor, opened image) as ``ats predict`` opens it."""
    predictor = model if isinstance(model, Predictor) else load_predictor(model, device)
    net = predictor.model
    opened = predictor.opener(**(reading or {}))(image, channels=predictor.channels, scale=net.scale,
                                                 patch_size=net.patch_size)
    return predictor, opened


def _attention_extent(model, opened: OpenedImage) -> tuple[float, float, float, float]:
    """Where the attention map lies in full-res pixels, imshow order (l, r, b, t): the
    low-res view less the attention net's margin, or the model's own (tile-mil: its tiles)."""
    H, W = opened.source.size
    if hasattr(model, "attention_extent"):
        return model.attention_extent((H, W))
    low_h, low_w = opened.low.shape[-2:]
    margin = getattr(getattr(model, "attention_net", None), "margin", 0)  # Deep MIL: its grid spans the image
    ry, rx = H / low_h, W / low_w
    return margin * rx, (low_w - margin) * rx, (low_h - margin) * ry, margin * ry


def _thumbnail(image, reading: Mapping[str, object] | None, side: int) -> np.ndarray | None:
    """The image file at about ``side`` pixels on its long side, uint8 [h, w, C], read from
    the smallest pyramid level that suffices; None when it cannot be read."""
    from ats_cli.data.slides import open_image

    reading = reading or {}
    try:
        with open_image(image, reader=str(reading.get("reader") or "auto"),
                        max_pixels=reading.get("max_pixels")) as slide:  # type: ignore[arg-type]
            return slide.thumbnail(side)
    except Exception:  # noqa: BLE001 - the caller draws without it
        return None


def _low_view(opened: OpenedImage) -> np.ndarray:
    """The low-res view the attention net saw, [C, h, w] in [0, 1]."""
    return opened.low.detach().cpu().float().clamp(0, 1).numpy()


def render_attention(
    model: str | os.PathLike[str] | Predictor,
    image: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    n_patches: int | None = None,
    seed: int = 0,
    data: str | os.PathLike[str] | None = None,
    device: str = "cpu",
    reading: Mapping[str, object] | None = None,
    dpi: int = 110,
) -> RenderSummary:
    """The attention figure of ``image`` (:func:`ats_cli.render.figure.draw_attention`)
    from one seeded sampling: the image at display resolution (the low-res view the
    attention net sees is often too coarse to make out what is in it) under the attention,
    the patches ranked by their contributions to the prediction (their weights, or their
    attention, for a model that reports none), the boxes a dataset CSV records. Raises
    CheckpointError (model) or ImageReadError (image), both naming the file. ``reading``:
    reader/level/mpp/tissue overrides, as for ``ats predict`` (default: the model's
    training settings)."""
    predictor, opened = _open(model, image, device, reading)
    net = predictor.model
    output = sample_attention(predictor, opened, n_patches=n_patches, seed=seed, return_patches=True, path=image)
    record = AttentionRecord.from_output(net, opened, output)
    probs = class_probabilities(net, output.logits[0]).cpu()
    k = int(probs.argmax())
    prediction = predictor.decide(probs.tolist()) or NO_CLASS  # multi-label: the set at the threshold
    weights, contributions = record.weights, record.contributions
    if weights is None:
        ranking = "attention"
    elif contributions is None or np.allclose(contributions, weights, rtol=1e-6, atol=0):
        ranking, contributions = "weight", None  # each draw adds its weight: nothing more to show
    else:
        ranking = "contribution"
    info = find_image_info(image, data)
    thumb = _thumbnail(image, reading, DISPLAY_SIDE)
    background = _low_view(opened) if thumb is None else thumb[..., :3].transpose(2, 0, 1) / 255.0
    n = len(record.offsets)
    estimator = getattr(net, "active_estimator", None)  # Deep MIL: no sampling, no estimator
    sampling = f"{n} {'patch' if n == 1 else 'patches'}, seed {seed}"
    extent = _attention_extent(net, opened)
    entropy = float(output.entropy[0])
    if record.regions:  # two levels: the coarse attention lies over the region grid
        rows, cols = record.region_grid
        side = record.regions[0].size
        extent = (0.0, float(cols * side), float(rows * side), 0.0)
        sampling = f"{len(record.regions)} regions x {n // len(record.regions)} patches, seed {seed}"
        # the figure's "uniform" is that of the map it draws: the regions' entropy, not the
        # model's regulariser (the regions' plus the mean of the drawn regions' own)
        entropy = float(attention_entropy(torch.as_tensor(record.attention, dtype=torch.float64).reshape(1, -1))[0])
    if record.tile:  # tile-mil reads every tissue tile: the patches shown are those of most attention
        sampling = f"the {n} of {int((record.attention > 0).sum())} tissue tiles of most attention"
    if getattr(net, "replace", False):
        sampling += ", with replacement"
    elif weights is not None and estimator:
        sampling += f", {estimator} estimator"
    figure = AttentionFigure(
        image_name=Path(image).name, size=tuple(opened.source.size), background=background,
        attention=record.attention, attention_extent=extent, patch_size=record.patch_size,
        sites=patch_sites(record.offsets.tolist(), record.sampled_probs.tolist(), weights, contributions),
        patches=output.patches[0].detach().cpu().float().numpy(), prediction=prediction,
        probability=float(probs[k]), ranking=ranking, label=info.label if info else None,
        boxes=info.boxes if info else [], model_name=predictor.path.name, sampling=sampling,
        entropy=entropy, regions=record.regions or (), tiles=bool(record.tile))
    drawn = draw_attention(figure, out, dpi=dpi)
    return RenderSummary(Path(out), drawn.size_px, prediction=figure.prediction, probability=figure.probability,
                         label=figure.label, n_boxes=len(figure.boxes), n_sites=len(drawn.sites),
                         strip=tuple((s.row, s.col) for s in drawn.strip), reading=opened.reading)


def write_attention_geojson(
    model,
    image: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    n_patches: int | None = None,
    seed: int = 0,
    data: str | os.PathLike[str] | None = None,
    device: str = "cpu",
    reading: Mapping[str, object] | None = None,
    preview: str | os.PathLike[str] | None = None,
) -> GeoJSONSummary:
    """One sampling of ``model`` (a checkpoint, run directory or loaded Predictor) on
    ``image``, as GeoJSON at ``out`` (:mod:`ats_cli.render.geojson`): the same patches
    the figure draws with the same seed. ``preview``: a PNG of the file drawn over the
    image, as QuPath shows it after importing it (:mod:`ats_cli.render.qupath`).
    ``reading``: reader/level/mpp/tissue/max_pixels overrides (as ``ats predict``'s).
    ``data``: a dataset directory or CSV for the label and recorded boxes (default: found
    next to the image, as for the figure)."""
    predictor, opened = _open(model, image, device, reading)
    net = predictor.model
    check_model(net)
    output = sample_attention(predictor, opened, n_patches=n_patches, seed=seed, path=image)
    probs = class_probabilities(net, output.logits[0]).cpu().tolist()
    record = AttentionRecord.from_output(net, opened, output)
    info = _image_info(image, data)
    label = info.label if info else None
    boxes = [(b.cls, b.row, b.col, b.h, b.w) for b in info.boxes] if info else []
    collection = feature_collection(record, predictor.classes, probs, image=image, model=predictor.path, seed=seed,
                                    label=label, boxes=boxes, prediction=predictor.decide(probs))
    write_geojson(out, collection)
    preview_px = None
    if preview is not None:
        from ats_cli.data.images import ImageReadError
        from ats_cli.render.geojson import grid_extent
        from ats_cli.render.qupath import render_preview

        thumb = _thumbnail(image, reading, PREVIEW_SIDE)
        if thumb is None:
            raise ImageReadError(f"{image}: cannot read a thumbnail for the preview ({out} was written)")
        preview_px = render_preview(collection, thumb, preview, attention=record.attention,
                                    attention_extent=grid_extent(record), geojson_name=Path(out).name,
                                    image_name=Path(image).name)
    k = max(range(len(probs)), key=probs.__getitem__)
    return GeoJSONSummary(Path(out), collection["properties"]["prediction"], probs[k], len(record.offsets),
                          collection["properties"]["cells"]["written"], record.frame.level, record.frame.downsample,
                          label, opened.reading, None if preview is None else Path(preview), preview_px)


def render_evolution(
    run_dir: str | os.PathLike[str],
    image: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    epochs: str | None = None,
    data: str | os.PathLike[str] | None = None,
    device: str = "cpu",
    reading: Mapping[str, object] | None = None,
    max_panels: int = MAX_PANELS,
    dpi: int = 110,
) -> RenderSummary:
    """The attention of one image after successive epochs, side by side
    (:mod:`ats_cli.render.evolution`), from ``RUN_DIR/epochs/epoch_NNN.pt``: one forward
    per epoch. Attention does not depend on the sampling seed, so there is none.
    ``epochs``: see :func:`select_epochs`."""
    run_dir = Path(run_dir)
    files = epoch_checkpoints(run_dir)
    chosen = select_epochs(epochs, list(files), max_panels)
    metrics = _metrics(run_dir)
    info = find_image_info(image, data)

    panels, opened, net = [], None, None
    for epoch in chosen:
        predictor = load_predictor(files[epoch], device)
        net = predictor.model
        if opened is None:  # every epoch of a run shares channels, scale and patch size
            _, opened = _open(predictor, image, device, reading)
        output = sample_attention(predictor, opened, n_patches=1, seed=0, path=image)
        panels.append(EpochPanel(epoch, output.attention[0].detach().cpu().double().numpy(),
                                 metrics.get(epoch, {}).get("test_acc")))
    assert opened is not None and net is not None
    thinned = "" if len(chosen) == len(files) or epochs not in (None, "all") else f" ({len(files)} saved; evenly " \
                                                                                 "spaced)"
    figure = EvolutionFigure(image_name=Path(image).name, size=tuple(opened.source.size),
                             background=_low_view(opened), attention_extent=_attention_extent(net, opened),
                             panels=panels, run_name=str(run_dir), thinned=thinned,
                             label=info.label if info else None, boxes=info.boxes if info else [])
    size = draw_evolution(figure, out, dpi=dpi)
    return RenderSummary(Path(out), size, label=figure.label, epochs=tuple(chosen), n_boxes=len(figure.boxes))
