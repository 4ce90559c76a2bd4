"""What the model looked at, as GeoJSON that QuPath imports as objects on the slide.

``ats visualize SLIDE --model M --out X.geojson`` and ``ats predict ... --save-attention
DIR`` write one FeatureCollection per image (docs/slides.md, "Attention in QuPath"):

* **one annotation** covering the image, first: the prediction (name, classification) and
  the class probabilities as measurements (``prob_<class>``), locked;
* **one detection per attention cell** that matters, a square in the cell's footprint,
  with the measurement ``attention`` and its own colour (``properties.color``: viridis on
  a log scale spanning three decades below the top, as ``ats visualize``'s figure). Which
  cells: the highest-attention cells that together hold ``CELL_MASS`` (99%) of the
  attention, at most ``MAX_CELLS`` (5,000, about 1.5 MB); cells of attention 0 (outside
  the tissue mask) never. A 100k-pixel slide therefore gives a file of a few MB at most,
  and the top-level ``properties.cells`` says how many cells were left out and how much
  attention they held;
* **one detection per sampled patch**, in draw order, named ``patch K`` (K = 1.., the
  numbers of the PNG figure), classified as the predicted class, magenta, with the
  measurements ``attention`` (the probability the patch's cell was drawn with),
  ``draw_order`` (K) and ``weight`` (its weight in the unbiased estimate, the ``w_k`` of
  :func:`ats_cli.core.sampling.estimator_weights`; left out when it cannot be recovered);
* the boxes a dataset CSV records for the image (``boxes``/``digits`` columns), when
  known, as annotations classified ``label box``.

Coordinates are **level-0 pixels** of the file, QuPath's image coordinates, x = column
and y = row, also when the model reads patches from another pyramid level (``--level``,
``--mpp``): a patch at offset (r, c) of size s in level L covers level-0
[c*d, (c+s)*d) x [r*d, (r+s)*d), with d the reader's downsample of level L
(``SlideReader.downsamples``, the one OpenSlide itself reads with). Patch offsets come
from the model (:func:`ats_cli.core.geometry.positions_to_offsets`); cell squares use the
same footprint arithmetic. Rings are closed and counter-clockwise in (x, y) numbers
(RFC 7946); coordinates are rounded to 0.1 pixel, probabilities to 4 significant digits.
The file is written atomically, one feature per line.

The estimator weights are not part of the model's output: they depend on the draw's
(n+1)-th Gumbel key. :func:`replay_weights` recovers them by replaying the sampler with
the same seed (only the sampler draws from the generator) and checks that the replay drew
the same positions.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ats_cli.io import atomic_write_bytes, atomic_write_text

__all__ = [
    "CELL_MASS",
    "MAX_CELLS",
    "AttentionRecord",
    "GeoJSONSummary",
    "LevelFrame",
    "attention_feature_collection",
    "cell_boxes",
    "check_model",
    "geojson_text",
    "level_frame",
    "patch_boxes",
    "render_geojson",
    "replay_weights",
    "unique_names",
    "write_attention_geojson",
]

CELL_MASS = 0.99  # cells written: the fewest, highest, that hold this share of the attention ...
MAX_CELLS = 5000  # ... but at most this many (a feature is ~300 bytes)
DECADES = 3.0  # cell colours: log scale over this many decades below the top (as the PNG figure)
CELL_CMAP = "viridis"
PATCH_COLOUR = (255, 0, 255)  # magenta: apart from every viridis colour and from pink tissue
LABEL_BOX_COLOUR = (255, 42, 42)
CELL_CLASS = "attention"
LABEL_BOX_CLASS = "label box"
# tab10: the classification colours of the classes, in the model's class order
CLASS_COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
                 (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
FORMAT_VERSION = 1


# ---------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class LevelFrame:
    """Where the model's "full resolution" sits in the file: the level patches are read
    from, the downsample d (level-0 pixels per pixel of it: the level's times the
    resampling factor when the slide is read at the model's microns per pixel), its size
    and level 0's."""

    level: int
    downsample: float
    size: tuple[int, int]  # (H, W) of the level patches are read from
    size0: tuple[int, int]  # (H, W) at level 0
    mpp: tuple[float, float] | None = None  # level-0 microns per pixel (y, x), when the file says


def level_frame(source) -> LevelFrame:
    """The :class:`LevelFrame` of a patch source: a slide reader's chosen level and its
    downsample, or level 0 (d = 1) for an image read whole."""
    from ats_cli.data.slides import SlideReader

    if isinstance(source, SlideReader):
        level = int(source.level)
        return LevelFrame(level, float(source.patch_downsample), tuple(source.size), tuple(source.dimensions),
                          tuple(source.mpp) if source.mpp else None)
    H, W = (int(v) for v in source.size)
    return LevelFrame(0, 1.0, (H, W), (H, W), None)


def patch_boxes(offsets, patch_size: tuple[int, int], frame: LevelFrame) -> np.ndarray:
    """[n, 4] level-0 boxes (x0, y0, x1, y1) of patches at ``offsets`` [n, 2] (row, col)
    of size ``patch_size`` (h, w), both in the pixels of ``frame``'s level."""
    off = np.asarray(offsets, dtype=np.float64).reshape(-1, 2)
    d = frame.downsample
    ph, pw = patch_size
    r, c = off[:, 0], off[:, 1]
    return np.stack([c * d, r * d, (c + pw) * d, (r + ph) * d], axis=1)


def cell_boxes(attention_shape: tuple[int, int], low_size: tuple[int, int], margin: int,
               frame: LevelFrame) -> np.ndarray:
    """[att_h * att_w, 4] level-0 boxes (x0, y0, x1, y1) of the attention cells, row-major
    (the flat index the sampler draws). The footprint arithmetic of
    :func:`ats_cli.core.geometry.positions_to_offsets`: the map covers the low-res view
    less ``margin`` pixels per side, scaled to the patch level by size ratio, then by d."""
    ah, aw = attention_shape
    lh, lw = low_size
    H, W = frame.size
    d = frame.downsample
    ch, cw = (lh - 2 * margin) / ah, (lw - 2 * margin) / aw
    ry, rx = H / lh * d, W / lw * d
    rows, cols = np.arange(ah, dtype=np.float64), np.arange(aw, dtype=np.float64)
    y0, y1 = (margin + rows * ch) * ry, (margin + (rows + 1) * ch) * ry
    x0, x1 = (margin + cols * cw) * rx, (margin + (cols + 1) * cw) * rx
    Y0, X0 = np.meshgrid(y0, x0, indexing="ij")
    Y1, X1 = np.meshgrid(y1, x1, indexing="ij")
    return np.stack([X0.ravel(), Y0.ravel(), X1.ravel(), Y1.ravel()], axis=1)


def _num(v: float) -> float | int:
    """A coordinate rounded to 0.1 pixel; an int when whole (shorter files)."""
    r = round(float(v), 1)
    return int(r) if r == int(r) else r


def _sig(v: float, digits: int = 4) -> float:
    return float(f"{float(v):.{digits}g}")


def _ring(box) -> list[list[float | int]]:
    """A closed, counter-clockwise (in x, y numbers, RFC 7946) ring around a box."""
    x0, y0, x1, y1 = (_num(v) for v in box)
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]


# ---------------------------------------------------------------------------- the model's output


def check_model(model) -> None:
    """ValueError unless ``model`` samples patches from an attention map over its low-res
    view (``--method ats`` or ``uniform``): Deep MIL reads a fixed grid and the CNN no
    patches, so neither has patches and cells to export."""
    from ats_cli.core.model import ATSModel

    if not isinstance(model, ATSModel):
        raise ValueError(f"GeoJSON export needs an attention-sampling model (--method ats or uniform); this one is a "
                         f"{type(model).__name__}")


def replay_weights(model, output, *, seed: int, samplings: int = 1) -> torch.Tensor | None:
    """The estimator weights [B, n] of the last of ``samplings`` samplings that produced
    ``output`` from a generator seeded with ``seed`` on the attention's device (what
    ``ats predict`` and ``ats visualize`` do): the sampler is replayed on the output's
    attention, and the replay must draw the same positions (else None: something else
    drew from the generator). With replacement the weights are 1/n."""
    from ats_cli.core.sampling import estimator_threshold, estimator_weights, sample

    n = output.indices.shape[1]
    if getattr(model, "replace", False):
        return torch.full(output.sampled_probs.shape, 1.0 / n, dtype=torch.float64)
    probs = output.attention.flatten(1)
    generator = torch.Generator(device=probs.device).manual_seed(seed)
    draw = None
    for _ in range(max(1, samplings)):  # only the shape matters for how far the generator advances
        draw = sample(probs, n, replace=False, generator=generator)
    if draw is None or not torch.equal(draw.indices, output.indices):
        return None
    threshold = estimator_threshold(model.active_estimator, draw, probs)
    return estimator_weights(output.sampled_probs, replace=False, threshold=threshold).double()


@dataclass
class AttentionRecord:
    """One image's attention and sampled patches, in numbers (no tensors), with where
    they sit in the file."""

    attention: np.ndarray  # [att_h, att_w], sums to 1
    offsets: np.ndarray  # [n, 2] (row, col) top-left of each patch, in the patch level's pixels, draw order
    sampled_probs: np.ndarray  # [n]
    weights: np.ndarray | None  # [n] estimator weights, or None
    patch_size: tuple[int, int]
    low_size: tuple[int, int]
    margin: int
    frame: LevelFrame

    @classmethod
    def from_output(cls, model, opened, output, b: int = 0, weights: torch.Tensor | None = None) -> AttentionRecord:
        """Row ``b`` of a model output for the input ``opened`` (an OpenedImage)."""
        return cls(
            attention=output.attention[b].detach().double().cpu().numpy(),
            offsets=output.offsets[b].detach().cpu().numpy().astype(np.int64),
            sampled_probs=output.sampled_probs[b].detach().double().cpu().numpy(),
            weights=None if weights is None else weights[b].detach().double().cpu().numpy(),
            patch_size=tuple(int(v) for v in model.patch_size),
            low_size=tuple(int(v) for v in opened.low.shape[-2:]),
            margin=int(getattr(model.attention_net, "margin", 0)),
            frame=level_frame(opened.source),
        )


def select_cells(attention: np.ndarray, *, mass: float = CELL_MASS, max_cells: int = MAX_CELLS) -> np.ndarray:
    """Flat indices of the cells to write, highest attention first: the fewest that hold
    ``mass`` of the attention, at most ``max_cells``, never a cell of attention 0."""
    flat = np.asarray(attention, dtype=np.float64).ravel()
    order = np.argsort(-flat, kind="stable")
    order = order[flat[order] > 0]
    cumulative = np.cumsum(flat[order])
    k = int(np.searchsorted(cumulative, mass * cumulative[-1] if len(cumulative) else 0.0) + 1)
    return order[:min(k, max_cells, len(order))]


def _cell_colours(values: np.ndarray, vmax: float) -> tuple[np.ndarray, float, float]:
    """RGB uint8 [k, 3] from viridis on a log scale over DECADES below ``vmax``; (vmin, vmax)."""
    from matplotlib import colormaps

    vmin = vmax / 10**DECADES
    t = (np.log10(np.clip(values, vmin, vmax)) - math.log10(vmin)) / DECADES
    rgb = (colormaps[CELL_CMAP](t)[:, :3] * 255).round().astype(int)
    return rgb, vmin, vmax


def parse_boxes(text: str | None) -> list[tuple[str, int, int, int, int]]:
    """A dataset CSV's ``boxes``/``digits`` cell, ``[[class, row, col, h, w], ...]`` in
    level-0 pixels; [] when absent or malformed."""
    if not text:
        return []
    try:
        return [(str(c), int(r), int(k), int(h), int(w)) for c, r, k, h, w in json.loads(text)]
    except (ValueError, TypeError):
        return []


def attention_feature_collection(
    record: AttentionRecord,
    classes: Sequence[str],
    probs: Sequence[float],
    *,
    image: str | os.PathLike[str] | None = None,
    model: str | os.PathLike[str] | None = None,
    seed: int | None = None,
    samples: int = 1,
    label: str | None = None,
    boxes: Sequence[tuple[str, int, int, int, int]] = (),
    mass: float = CELL_MASS,
    max_cells: int = MAX_CELLS,
) -> dict:
    """The GeoJSON FeatureCollection (a dict) of one image: see the module docstring.
    ``probs``: the class probabilities the prediction reports (``ats predict`` averages
    ``samples`` samplings; the patches are the last one's)."""
    classes = [str(c) for c in classes]
    probs = [float(p) for p in probs]
    if len(probs) != len(classes):
        raise ValueError(f"{len(probs)} probabilities for {len(classes)} classes")
    k = max(range(len(probs)), key=probs.__getitem__)
    prediction = classes[k]
    frame = record.frame
    H0, W0 = frame.size0

    def colour(name: str) -> list[int]:
        i = classes.index(name) if name in classes else len(classes)
        return list(CLASS_COLOURS[i % len(CLASS_COLOURS)])

    features = [{
        "type": "Feature",
        "geometry": {"type": "Polygon", "coordinates": [_ring((0, 0, W0, H0))]},
        "properties": {
            "objectType": "annotation",
            "name": f"ats: {prediction} (p = {probs[k]:.2f})",
            "classification": {"name": prediction, "color": colour(prediction)},
            "isLocked": True,
            "measurements": {f"prob_{c}": _sig(p, 6) for c, p in zip(classes, probs, strict=True)},
            "metadata": {key: str(value) for key, value in (("image", image and Path(image).name),
                                                              ("model", model and Path(model).name),
                                                              ("seed", seed)) if value is not None},
        },
    }]
    for cls, r, c, h, w in boxes:
        features.append({
            "type": "Feature",
            "geometry": {"type": "Polygon", "coordinates": [_ring((c, r, c + w, r + h))]},
            "properties": {"objectType": "annotation", "name": f"label box: {cls}",
                           "classification": {"name": LABEL_BOX_CLASS, "color": list(LABEL_BOX_COLOUR)}},
        })

    att = record.attention
    n_cells = att.size
    chosen = select_cells(att, mass=mass, max_cells=max_cells)
    vmax = max(float(att.max()), 10.0 / n_cells)  # a uniform map sits a decade below the top, as in the PNG
    values = att.ravel()[chosen]
    rgb, vmin, vmax = _cell_colours(values, vmax)
    cells = cell_boxes(att.shape, record.low_size, record.margin, frame)
    aw = att.shape[1]
    for i, value, col in zip(chosen.tolist(), values.tolist(), rgb.tolist(), strict=True):
        features.append({
            "type": "Feature",
            "geometry": {"type": "Polygon", "coordinates": [_ring(cells[i])]},
            "properties": {"objectType": "detection", "name": f"cell {i // aw},{i % aw}", "color": col,
                           "classification": {"name": CELL_CLASS, "color": [68, 1, 84]},
                           "measurements": {"attention": _sig(value)}},
        })

    patches = patch_boxes(record.offsets, record.patch_size, frame)
    for j, box in enumerate(patches):
        measurements = {"attention": _sig(record.sampled_probs[j]), "draw_order": j + 1}
        if record.weights is not None:
            measurements["weight"] = _sig(record.weights[j])
        features.append({
            "type": "Feature",
            "geometry": {"type": "Polygon", "coordinates": [_ring(box)]},
            "properties": {"objectType": "detection", "name": f"patch {j + 1}", "color": list(PATCH_COLOUR),
                           "classification": {"name": prediction, "color": colour(prediction)},
                           "measurements": measurements},
        })

    held = float(values.sum())
    properties = {
        "format": "ats attention GeoJSON", "version": FORMAT_VERSION,
        "coordinates": "level-0 pixels of the image file (QuPath's image coordinates), x = column, y = row",
        "image": None if image is None else str(image),
        "model": None if model is None else str(model),
        "image_size": {"width": W0, "height": H0},
        "level": frame.level, "downsample": frame.downsample,
        "level_size": {"width": frame.size[1], "height": frame.size[0]},
        "mpp": None if frame.mpp is None else {"x": frame.mpp[1], "y": frame.mpp[0]},
        "prediction": prediction,
        "probabilities": {c: _sig(p, 6) for c, p in zip(classes, probs, strict=True)},
        "label": label,
        "seed": seed, "samples": samples,
        "patches": {"count": len(patches), "size_level": list(record.patch_size),
                    "size_level0": [_num(record.patch_size[0] * frame.downsample),
                                    _num(record.patch_size[1] * frame.downsample)],
                    "weights": record.weights is not None,
                    "note": "the last sampling's patches" if samples > 1 else "the sampling the prediction used"},
        "cells": {"grid": list(att.shape), "written": len(chosen), "nonzero": int((att > 0).sum()),
                  "attention_written": _sig(held, 6), "attention_left_out": _sig(max(0.0, 1.0 - held), 4),
                  "rule": f"highest cells holding {mass:.0%} of the attention, at most {max_cells}"},
        "cell_colour_scale": {"colormap": CELL_CMAP, "scale": "log10", "min": _sig(vmin), "max": _sig(vmax)},
        "patch_colour": list(PATCH_COLOUR),
    }
    return {"type": "FeatureCollection", "properties": properties, "features": features}


def geojson_text(collection: Mapping) -> str:
    """JSON text with one feature per line (diffable, greppable); refuses NaN/inf."""
    head = {k: v for k, v in collection.items() if k != "features"}
    parts = [json.dumps(f, separators=(",", ":"), allow_nan=False) for f in collection["features"]]
    opening = json.dumps(head, separators=(",", ":"), allow_nan=False)[:-1]
    return opening + ',"features":[\n' + ",\n".join(parts) + "\n]}\n"


def write_geojson(path: str | os.PathLike[str], collection: Mapping) -> Path:
    """Write :func:`geojson_text` atomically, creating the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, geojson_text(collection))
    return path


def unique_names(paths: Sequence[str | os.PathLike[str]], suffix: str = ".geojson") -> list[str]:
    """One file name per input, ``<stem><suffix>``, in input order; a stem seen before
    gets ``-2``, ``-3``, ... (the first free one), so two ``slide.svs`` in different
    folders never overwrite each other, and a name depends only on the inputs before it."""
    used: set[str] = set()
    names = []
    for p in paths:
        stem = Path(p).stem or "image"
        name, k = f"{stem}{suffix}", 1
        while name.lower() in used:
            k += 1
            name = f"{stem}-{k}{suffix}"
        used.add(name.lower())
        names.append(name)
    return names


# ---------------------------------------------------------------------------- ats visualize X.geojson


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
    reading: str | None = None  # how the slide was read (ats_cli.data.magnification.describe_reading)


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
) -> GeoJSONSummary:
    """One sampling of ``model`` (a checkpoint, run directory or loaded Predictor) on
    ``image``, as GeoJSON at ``out``: the same patches ``ats visualize`` draws with the
    same seed. ``reading``: reader/level/mpp/tissue/max_pixels overrides (as ``ats
    predict``'s). ``data``: a dataset directory or CSV for the label and recorded boxes
    (default: found next to the image, as for the PNG figure)."""
    from ats_cli.predict import Predictor, load_predictor
    from ats_cli.visualize import sample_attention

    predictor = model if isinstance(model, Predictor) else load_predictor(model, device)
    net = predictor.model
    check_model(net)
    opened = predictor.opener(**(reading or {}))(image, channels=predictor.channels, scale=net.scale,
                                                 patch_size=net.patch_size)
    output = sample_attention(predictor, opened, n_patches=n_patches, seed=seed)
    probs = torch.softmax(output.logits[0].float(), 0).cpu().tolist()
    record = AttentionRecord.from_output(net, opened, output, 0, replay_weights(net, output, seed=seed))
    label, boxes = _image_info(image, data)
    collection = attention_feature_collection(record, predictor.classes, probs, image=image, model=predictor.path,
                                              seed=seed, label=label, boxes=boxes)
    write_geojson(out, collection)
    k = max(range(len(probs)), key=probs.__getitem__)
    return GeoJSONSummary(Path(out), predictor.classes[k], probs[k], len(record.offsets),
                          collection["properties"]["cells"]["written"], record.frame.level, record.frame.downsample,
                          label, opened.reading)


def _image_info(image, data) -> tuple[str | None, list]:
    """(label, boxes) from a dataset CSV that lists ``image``; (None, []) if none does."""
    try:
        from ats_cli.visualize import find_image_info

        info = find_image_info(image, data)
    except Exception:  # a CSV that cannot be read: the GeoJSON does without
        return None, []
    if info is None:
        return None, []
    return info.label, [(b.cls, b.row, b.col, b.h, b.w) for b in info.boxes]


# ---------------------------------------------------------------------------- a PNG from the GeoJSON


def render_geojson(geojson: str | os.PathLike[str], image: str | os.PathLike[str], out: str | os.PathLike[str],
                   *, max_side: int = 1024, dpi: int = 110) -> tuple[int, int]:
    """Draw a GeoJSON file written here over the image's thumbnail, from the file alone
    (what QuPath shows after importing it): cells filled in the colours the file gives
    them (opacity rising with the colour scale, so that the tissue stays visible under
    low attention; QuPath fills every detection alike), patches outlined in their colour
    and numbered in draw order, label boxes dashed, a colour bar for the cells. The axes
    are level-0 pixels. Returns the PNG's (width, height)."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from ats_cli.data.slides import open_image

    collection = json.loads(Path(geojson).read_text(encoding="utf-8"))
    props = collection.get("properties", {})
    with open_image(image) as slide:
        thumb = slide.thumbnail(max_side)
        H0, W0 = slide.dimensions
    cells, patches, boxes, head = [], [], [], None
    for f in collection["features"]:
        p = f["properties"]
        ring = np.asarray(f["geometry"]["coordinates"][0], dtype=float)[:-1]
        cls = p.get("classification", {}).get("name")
        if cls == LABEL_BOX_CLASS:
            boxes.append(ring)
        elif p.get("objectType") == "annotation":
            head = p
        elif cls == CELL_CLASS:
            cells.append((ring, p["measurements"]["attention"], np.asarray(p["color"]) / 255.0))
        else:
            patches.append((ring, p["measurements"]))

    scale = props.get("cell_colour_scale") or {"min": 1e-3, "max": 1.0, "colormap": CELL_CMAP}
    norm = LogNorm(scale["min"], scale["max"], clip=True)
    # Layout in inches: the image panel keeps the image's aspect; titles above, legend below, bar right.
    panel_w = 6.2
    panel_h = min(max(panel_w * H0 / W0, 2.5), 9.0)
    top, bottom, left, right = 0.85, 1.05, 0.75, 1.35
    fig_w, fig_h = left + panel_w + right, top + panel_h + bottom
    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    ax = fig.add_axes((left / fig_w, bottom / fig_h, panel_w / fig_w, panel_h / fig_h))
    gray = thumb.shape[2] == 1
    ax.imshow(thumb[..., 0] if gray else thumb, cmap="gray" if gray else None, extent=(0, W0, H0, 0),
              interpolation="bilinear", zorder=1, aspect="auto")
    if cells:
        t = np.asarray(norm([c[1] for c in cells]), dtype=float)
        ax.add_collection(PolyCollection([c[0] for c in cells], edgecolors="none", zorder=2,
                                         facecolors=[(*c[2], 0.3 + 0.6 * ti) for c, ti in zip(cells, t, strict=True)]))
    if boxes:
        ax.add_collection(PolyCollection(boxes, facecolors="none", edgecolors=[np.asarray(LABEL_BOX_COLOUR) / 255.0],
                                         linestyles="--", linewidths=1.6, zorder=5))
    colour = np.asarray(props.get("patch_colour", PATCH_COLOUR)) / 255.0
    ax.add_collection(PolyCollection([r for r, _ in patches], facecolors="none", edgecolors=[colour],
                                     linewidths=1.3, zorder=4))
    for ring, m in patches:
        ax.text(ring[:, 0].min(), ring[:, 1].min(), str(m.get("draw_order", "")), color=colour, fontsize=6,
                fontweight="bold", ha="left", va="bottom", zorder=6, clip_on=True)
    ax.set_xlim(0, W0)
    ax.set_ylim(H0, 0)
    ax.tick_params(labelsize=7, length=2)
    ax.set_xlabel("x = column, level-0 pixels (QuPath's image coordinates)", fontsize=8, labelpad=2)
    ax.set_ylabel("y = row, level-0 pixels", fontsize=8)

    cax = fig.add_axes(((left + panel_w + 0.25) / fig_w, (bottom + panel_h * 0.15) / fig_h, 0.17 / fig_w,
                        panel_h * 0.7 / fig_h))
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=colormaps[scale.get("colormap", CELL_CMAP)]), cax=cax)
    bar.set_label("attention per cell (log scale)", fontsize=8)
    bar.ax.tick_params(labelsize=7)

    info = props.get("cells", {})
    share = info.get("attention_written")
    cell_text = f"attention cells: the {info.get('written', len(cells))} highest of {info.get('nonzero', '?')}"
    if share is not None:
        cell_text += f", {share:.0%} of the attention"
    handles = [Patch(facecolor=colormaps[scale.get("colormap", CELL_CMAP)](0.75), alpha=0.8, label=cell_text),
               Line2D([], [], color=colour, lw=1.5, label=f"the {len(patches)} sampled patches, in draw order")]
    if boxes:
        handles.append(Line2D([], [], color=np.asarray(LABEL_BOX_COLOUR) / 255.0, lw=1.6, ls="--",
                              label="boxes recorded in the dataset CSV"))
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.01), ncol=1, fontsize=8, frameon=False)

    title = head["name"].removeprefix("ats: ") if head else props.get("prediction", "")
    if props.get("label") is not None:
        title += f"  |  label {props['label']}"
    fig.text(0.5, 1 - 0.12 / fig_h, f"predicted {title}", fontsize=13, fontweight="bold", ha="center", va="top")
    fig.text(0.5, 1 - 0.48 / fig_h, f"{Path(geojson).name} drawn over {Path(image).name} ({W0}x{H0})  ·  patches "
             f"read at level {props.get('level', 0)} (downsample {props.get('downsample', 1):g})",
             ha="center", va="top", fontsize=8, color="0.3")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor="white")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, buffer.getvalue())
    from PIL import Image

    with Image.open(buffer) as im:
        return im.size
