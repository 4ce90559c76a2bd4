"""What the model looked at, as GeoJSON that QuPath imports as objects on the slide.

``ats visualize SLIDE --model M --out X.geojson`` and ``ats predict ... --save-attention
DIR`` write one FeatureCollection per image (docs/slides.md, "Attention in QuPath"):

* **one annotation** covering the image, first: the prediction (name, classification) and
  the class probabilities as measurements (``prob_<class>``), locked;
* **one detection per attention cell** that matters, a square in the cell's footprint,
  with the measurement ``attention`` and its own colour (``properties.color``: viridis on
  a log scale spanning three decades below the top, as ``ats visualize``'s figure). Which
  cells: the highest-attention cells that together hold ``CELL_MASS`` of the attention,
  at most ``MAX_CELLS``, so that the file of a huge slide with an untrained, flat map
  stays small; cells of attention 0 (outside the tissue mask) never. The top-level
  ``properties.cells`` says how many cells were left out and how much attention they held;
* **one detection per sampled patch**, in draw order, named ``patch K`` (K = 1.., the
  numbers of the preview), classified as the predicted class, magenta, with the
  measurements ``attention`` (the probability the patch's cell was drawn with),
  ``draw_order`` (K) and ``weight`` (its weight in the unbiased estimate, as the model's
  output gives it; left out for a model without). The polygon is the patch clipped to the
  image, what QuPath can draw on the slide; ``properties.patch_box`` keeps the box the
  model read (x0, y0, x1, y1), which sticks out of the image at its border, where the
  reader pads with zeros;
* for a two-level model (:mod:`ats_cli.core.nested_model`) the attention cells are the
  regions of its grid (``cell i,j`` squares of the region side, their ``attention`` the
  coarse attention); **one detection per drawn region**, named ``region K`` in draw order,
  classified ``region``, with the measurements ``attention`` (the coarse attention it was
  drawn with), ``weight`` (its weight in the outer estimate), ``contribution`` and
  ``draw_order``; each patch then also has ``region`` (K), its ``attention`` is the fine
  attention within its region and its ``weight`` its weight in the whole estimate (the
  region's times its own);
* for a tile-mil model (:mod:`ats_cli.baselines_tilemil`) the attention cells are its tiles
  (``cell i,j`` the tile at row i, column j of the grid from the top left, clipped to the
  image), every tissue tile written (up to ``MAX_CELLS``, the highest), and the patches are
  the tiles of most attention; ``properties.cells.tile`` gives the tile's side;
* the boxes a dataset CSV records for the image (``boxes``/``digits`` columns), when
  known, as annotations classified ``label box``.

Coordinates are **level-0 pixels** of the file, QuPath's image coordinates, x = column
and y = row, also when the model reads patches from another pyramid level (``--level``,
``--mpp``): a patch at offset (r, c) of size s in level L covers level-0
[c*d, (c+s)*d) x [r*d, (r+s)*d), with d the reader's downsample of level L (the one
OpenSlide itself reads with). Cell squares use the footprint arithmetic of the model's
offsets. Rings are closed and counter-clockwise in (x, y) numbers (RFC 7946);
coordinates are rounded to 0.1 pixel, probabilities to 4 significant digits. The file is
written atomically, one feature per line, so that it diffs and greps.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ats_cli.io import atomic_write_text
from ats_cli.multilabel import NO_CLASS
from ats_cli.render.records import AttentionRecord, LevelFrame, parse_boxes

__all__ = [
    "CELL_CLASS",
    "CELL_MASS",
    "REGION_CLASS",
    "FORMAT_VERSION",
    "LABEL_BOX_CLASS",
    "MAX_CELLS",
    "PATCH_COLOUR",
    "cell_boxes",
    "feature_collection",
    "geojson_text",
    "grid_extent",
    "parse_boxes",
    "patch_boxes",
    "select_cells",
    "unique_names",
    "write_geojson",
]

CELL_MASS = 0.99  # cells written: the fewest, highest, that hold this share of the attention ...
MAX_CELLS = 5000  # ... but at most this many
DECADES = 3.0  # cell colours: log scale over this many decades below the top (as the PNG figure)
CELL_CMAP = "viridis"
PATCH_COLOUR = (255, 0, 255)  # magenta: apart from every viridis colour and from pink tissue
LABEL_BOX_COLOUR = (255, 42, 42)
CELL_CLASS = "attention"
REGION_CLASS = "region"
REGION_COLOUR = (255, 255, 255)  # white: the drawn regions, apart from the magenta patches
LABEL_BOX_CLASS = "label box"
# tab10: the classification colours of the classes, in the model's class order
CLASS_COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
                 (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
FORMAT_VERSION = 2  # raised whenever what a reader may rely on changes


# ---------------------------------------------------------------------------- geometry


def patch_boxes(offsets, patch_size: tuple[int, int], frame: LevelFrame) -> np.ndarray:
    """[n, 4] level-0 boxes (x0, y0, x1, y1) of patches at ``offsets`` [n, 2] (row, col)
    of size ``patch_size`` (h, w), both in the pixels of ``frame``'s level: what the
    model read, also where that leaves the image."""
    off = np.asarray(offsets, dtype=np.float64).reshape(-1, 2)
    d = frame.downsample
    ph, pw = patch_size
    r, c = off[:, 0], off[:, 1]
    return np.stack([c * d, r * d, (c + pw) * d, (r + ph) * d], axis=1)


def clip_boxes(boxes: np.ndarray, frame: LevelFrame) -> np.ndarray:
    """``boxes`` [n, 4] (x0, y0, x1, y1) cut to the level-0 image: what can be drawn on it."""
    H0, W0 = frame.size0
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    return np.stack([np.clip(boxes[:, 0], 0, W0), np.clip(boxes[:, 1], 0, H0),
                     np.clip(boxes[:, 2], 0, W0), np.clip(boxes[:, 3], 0, H0)], axis=1)


def cell_boxes(attention_shape: tuple[int, int], low_size: tuple[int, int], margin: int,
               frame: LevelFrame) -> np.ndarray:
    """[att_h * att_w, 4] level-0 boxes (x0, y0, x1, y1) of the attention cells, row-major
    (the flat index the sampler draws). The footprint arithmetic of the model's patch
    offsets: the map covers the low-res view less ``margin`` pixels per side, scaled to
    the patch level by size ratio, then by d."""
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


def region_boxes(grid: tuple[int, int], size: int, frame: LevelFrame) -> np.ndarray:
    """[rows * cols, 4] level-0 boxes (x0, y0, x1, y1) of a two-level model's regions of
    ``size`` pixels of ``frame``'s level, row-major (the flat index its coarse attention
    draws), clipped to the image (the last row and column may run past it)."""
    rows, cols = np.divmod(np.arange(grid[0] * grid[1]), grid[1])
    return clip_boxes(patch_boxes(np.stack([rows, cols], 1) * size, (size, size), frame), frame)


def grid_extent(record: AttentionRecord) -> tuple[float, float, float, float]:
    """Level-0 (x0, y0, x1, y1) that ``record``'s attention map covers, cell (0, 0) at the
    top left: :func:`cell_boxes`'s footprint, or a two-level model's region grid (whose
    last row and column may run past the image)."""
    frame, grid = record.frame, record.region_grid
    if record.tile:  # tile-mil: the tile grid, whose last row and column may run past the image
        rows, cols = record.attention.shape
        side = record.tile * frame.downsample
        return 0.0, 0.0, cols * side, rows * side
    if grid is not None:
        size = record.regions[0].size * frame.downsample
        return 0.0, 0.0, grid[1] * size, grid[0] * size
    boxes = cell_boxes(record.attention.shape, record.low_size, record.margin, frame)
    return float(boxes[0, 0]), float(boxes[0, 1]), float(boxes[-1, 2]), float(boxes[-1, 3])


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


# ---------------------------------------------------------------------------- the collection


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


def feature_collection(
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
    mass: float | None = None,
    max_cells: int = MAX_CELLS,
    prediction: str | None = None,
) -> dict:
    """The GeoJSON FeatureCollection (a dict) of one image: see the module docstring.
    ``probs``: the class probabilities the prediction reports (``ats predict`` averages
    ``samples`` samplings; the patches are the last one's). ``prediction``: what was
    predicted, when not the most probable class (a multi-label model's set, ``3;7``);
    ``p`` in the annotation's name stays the largest probability. ``mass``: the share of the
    attention the cells written hold; default :data:`CELL_MASS`, and for a tile-mil model's
    record (its cells are its tiles) all of it: every tissue tile, up to ``max_cells``."""
    classes = [str(c) for c in classes]
    probs = [float(p) for p in probs]
    if len(probs) != len(classes):
        raise ValueError(f"{len(probs)} probabilities for {len(classes)} classes")
    k = max(range(len(probs)), key=probs.__getitem__)
    prediction = classes[k] if prediction is None else (prediction or NO_CLASS)
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

    if mass is None:
        mass = 1.0 if record.tile else CELL_MASS
    att = record.attention
    n_cells = att.size
    chosen = select_cells(att, mass=mass, max_cells=max_cells)
    vmax = max(float(att.max()), 10.0 / n_cells)  # a uniform map sits a decade below the top, as in the PNG
    values = att.ravel()[chosen]
    rgb, vmin, vmax = _cell_colours(values, vmax)
    grid = record.region_grid
    if record.tile:  # tile-mil: each cell is a tile the model read, clipped to the image
        cells = region_boxes(att.shape, record.tile, frame)
    else:
        cells = cell_boxes(att.shape, record.low_size, record.margin, frame) if grid is None \
            else region_boxes(grid, record.regions[0].size, frame)
    aw = att.shape[1]
    for i, value, col in zip(chosen.tolist(), values.tolist(), rgb.tolist(), strict=True):
        features.append({
            "type": "Feature",
            "geometry": {"type": "Polygon", "coordinates": [_ring(cells[i])]},
            "properties": {"objectType": "detection", "name": f"cell {i // aw},{i % aw}", "color": col,
                           "classification": {"name": CELL_CLASS, "color": [68, 1, 84]},
                           "measurements": {"attention": _sig(value)}},
        })

    for region in record.regions or ():
        box = patch_boxes([(region.row, region.col)], (region.size, region.size), frame)
        measurements = {"attention": _sig(region.attention), "weight": _sig(region.weight),
                        "draw_order": region.draw}
        if region.contribution is not None:
            measurements["contribution"] = _sig(region.contribution)
        features.append({
            "type": "Feature",
            "geometry": {"type": "Polygon", "coordinates": [_ring(clip_boxes(box, frame)[0])]},
            "properties": {"objectType": "detection", "name": f"region {region.draw}", "color": list(REGION_COLOUR),
                           "classification": {"name": REGION_CLASS, "color": list(REGION_COLOUR)},
                           "measurements": measurements, "region_box": [_num(v) for v in box[0]]},
        })
    per_region = len(record.offsets) // len(record.regions) if record.regions else 0
    patches = patch_boxes(record.offsets, record.patch_size, frame)
    for j, (box, drawn) in enumerate(zip(patches, clip_boxes(patches, frame), strict=True)):
        measurements = {"attention": _sig(record.sampled_probs[j]), "draw_order": j + 1}
        if per_region:
            measurements["region"] = j // per_region + 1
        if record.weights is not None:
            measurements["weight"] = _sig(record.weights[j])
        features.append({
            "type": "Feature",
            "geometry": {"type": "Polygon", "coordinates": [_ring(drawn)]},
            "properties": {"objectType": "detection", "name": f"patch {j + 1}", "color": list(PATCH_COLOUR),
                           "classification": {"name": prediction, "color": colour(prediction)},
                           "measurements": measurements, "patch_box": [_num(v) for v in box]},
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
                    "polygon": "the patch clipped to the image; properties.patch_box: the box the model read "
                               "(x0, y0, x1, y1), zero-padded outside the image",
                    "note": "the last sampling's patches" if samples > 1 else "the sampling the prediction used"},
        "cells": {"grid": list(att.shape), "written": len(chosen), "nonzero": int((att > 0).sum()),
                  "attention_written": _sig(held, 6), "attention_left_out": _sig(max(0.0, 1.0 - held), 4),
                  "rule": f"highest cells holding {mass:.0%} of the attention, at most {max_cells}"},
        "cell_colour_scale": {"colormap": CELL_CMAP, "scale": "log10", "min": _sig(vmin), "max": _sig(vmax)},
        "patch_colour": list(PATCH_COLOUR),
    }
    if record.tile:  # a tile-mil model: only its files have this key
        properties["cells"]["tile"] = {
            "size_level": record.tile, "size_level0": _num(record.tile * frame.downsample),
            "note": "cells are the tiles the model read (cell i,j at row i, column j of tiles from the top left; "
                    "0 attention: not tissue); patches are the tiles of most attention"}
    if grid is not None:  # a two-level model: only its files have this key
        properties["regions"] = {
            "count": len(record.regions), "grid": list(grid), "size_level": record.regions[0].size,
            "size_level0": _num(record.regions[0].size * frame.downsample), "patches_per_region": per_region,
            "note": "cells are the regions of the grid, their attention the coarse attention; a patch's attention is "
                    "the fine attention within its region, its weight the region's times its own"}
    return {"type": "FeatureCollection", "properties": properties, "features": features}


# ---------------------------------------------------------------------------- the file


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
    from ats_cli.data.remote import is_url, url_name

    for p in paths:
        stem = Path(url_name(p) if is_url(p) else p).stem or "image"
        name, k = f"{stem}{suffix}", 1
        while name.lower() in used:
            k += 1
            name = f"{stem}-{k}{suffix}"
        used.add(name.lower())
        names.append(name)
    return names
