"""The preview of an attention GeoJSON: what QuPath shows after importing it, as a PNG.

Drawn over a thumbnail of the image (its panel is about 680 pixels across, whatever the
slide's size), with the file's patches, regions, label boxes and prediction. Made to read
at any slide size, where a patch or an attention cell of a 20k slide is a pixel or two of
the preview and one of a 200k slide a fraction of one:

* **the attention as a heat layer** at the preview's resolution: each pixel shows the
  largest attention of the cells under it (the model's whole map; the file holds only its
  highest cells, and drawn from the file alone those are used), coloured on a log scale
  from the top of the map down to its :data:`HEAT_FLOOR` th percentile (a trained map
  spans eight decades or more over the tissue: the file's three-decade cell colours would
  leave a handful of specks), blended over the image, a peak glowing over :data:`GLOW_PX`
  pixels so that it is a spot one can see; clear where the attention is 0 (off the tissue
  mask) or below the scale;
* **patch boxes** at least :data:`MIN_BOX_PX` pixels across, about the patch and inside
  the image; boxes that would overlap at that size (a region's draws, a place drawn
  twice) are one box with all their draw numbers;
* **numbers** (draw order, the file's ``patch K``; runs as ``9-16``) at the
  :data:`MAX_LABELS` heaviest places, beside their boxes where they cover no other number,
  else left out; the legend says how many are shown.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ats_cli.io import atomic_write_bytes
from ats_cli.render.draw import place_labels
from ats_cli.render.geojson import (
    CELL_CLASS,
    CELL_CMAP,
    LABEL_BOX_CLASS,
    LABEL_BOX_COLOUR,
    PATCH_COLOUR,
    REGION_CLASS,
    REGION_COLOUR,
)

__all__ = ["GLOW_PX", "MIN_BOX_PX", "heat_raster", "patch_places", "render_preview"]


MIN_BOX_PX = 7  # a patch box is at least this many preview pixels across
GLOW_PX = 12  # a peak of the heat glows over this many preview pixels (heat_rgba)
MAX_LABELS = 16  # places numbered, the heaviest first; more would bury the slide under numbers
HEAT_FLOOR = 5.0  # the heat's scale starts at this percentile of the attention on tissue ...
HEAT_DECADES = 10.0  # ... at most this many decades below its top
HEAT_ALPHA = (0.35, 0.85)  # the heat's opacity at the bottom and the top of its scale
PANEL_DPI = 110


def render_preview(collection: Mapping, thumbnail: np.ndarray, out: str | os.PathLike[str], *,
                   attention: np.ndarray | None = None,
                   attention_extent: tuple[float, float, float, float] | None = None,
                   geojson_name: str = "", image_name: str = "", dpi: int = PANEL_DPI) -> tuple[int, int]:
    """Draw ``collection`` (an attention FeatureCollection) over ``thumbnail`` (uint8
    [h, w, 1 or 3], the whole image at any size) into the PNG ``out``. ``attention``: the
    model's whole map, over the level-0 box ``attention_extent`` (x0, y0, x1, y1;
    :func:`ats_cli.render.geojson.grid_extent`); without it the heat is made of the cells
    the file holds. The axes are level-0 pixels. Returns the PNG's (width, height)."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    props = collection.get("properties", {})
    size = props.get("image_size") or {"width": thumbnail.shape[1], "height": thumbnail.shape[0]}
    W0, H0 = int(size["width"]), int(size["height"])
    cells, patches, regions, boxes, head = [], [], [], [], None
    for f in collection["features"]:
        p = f["properties"]
        ring = np.asarray(f["geometry"]["coordinates"][0], dtype=float)[:-1]
        cls = p.get("classification", {}).get("name")
        if cls == LABEL_BOX_CLASS:
            boxes.append(ring)
        elif p.get("objectType") == "annotation":
            head = p
        elif cls == CELL_CLASS:
            cells.append((ring, p["measurements"]["attention"]))
        elif cls == REGION_CLASS:
            regions.append(ring)
        else:
            patches.append((ring, p["measurements"]))

    scale = props.get("cell_colour_scale") or {"colormap": CELL_CMAP}
    cmap = colormaps[scale.get("colormap", CELL_CMAP)]
    # Layout in inches: the image panel keeps the image's aspect; titles above, legend below, bar right.
    panel_w = 6.2
    panel_h = min(max(panel_w * H0 / W0, 2.5), 9.0)
    legend_lines = 2 + bool(regions) + bool(boxes)
    top, bottom, left, right = 0.85, 0.71 + 0.17 * legend_lines, 0.75, 1.35
    fig_w, fig_h = left + panel_w + right, top + panel_h + bottom
    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    ax = fig.add_axes((left / fig_w, bottom / fig_h, panel_w / fig_w, panel_h / fig_h))
    gray = thumbnail.ndim == 2 or thumbnail.shape[2] == 1
    ax.imshow(thumbnail.reshape(thumbnail.shape[:2]) if gray else thumbnail[..., :3], cmap="gray" if gray else None,
              vmin=0, vmax=255, extent=(0, W0, H0, 0), interpolation="bilinear", zorder=1, aspect="auto")
    shape = heat_shape((H0, W0), (panel_h * dpi, panel_w * dpi))
    if attention is not None and attention_extent is not None:
        raster = heat_raster(attention, attention_extent, (H0, W0), shape)
    else:  # the file alone: its cells
        raster = cells_raster([(r[:, 0].min(), r[:, 1].min(), r[:, 0].max(), r[:, 1].max(), v) for r, v in cells],
                              (H0, W0), shape)
    rgba, norm = heat_rgba(raster, cmap, GLOW_PX)
    ax.imshow(rgba, extent=(0, W0, H0, 0), interpolation="antialiased", zorder=2, aspect="auto")
    if boxes:
        ax.add_collection(PolyCollection(boxes, facecolors="none", edgecolors=[np.asarray(LABEL_BOX_COLOUR) / 255.0],
                                         linestyles="--", linewidths=1.6, zorder=5))
    colour = np.asarray(props.get("patch_colour", PATCH_COLOUR)) / 255.0
    if regions:
        ax.add_collection(PolyCollection(regions, facecolors="none", edgecolors=[np.asarray(REGION_COLOUR) / 255.0],
                                         linestyles="--", linewidths=1.0, zorder=3))
    places = patch_places([(r[:, 0].min(), r[:, 1].min(), r[:, 0].max(), r[:, 1].max()) for r, _ in patches],
                          [int(m.get("draw_order", k + 1)) for k, (_, m) in enumerate(patches)],
                          [float(m.get("weight", m.get("attention", 0.0))) for _, m in patches], (H0, W0),
                          MIN_BOX_PX * W0 / (panel_w * dpi))
    ax.add_collection(PolyCollection([[(x0, y0), (x1, y0), (x1, y1), (x0, y1)] for (x0, y0, x1, y1), _, _ in places],
                                     facecolors="none", edgecolors=[colour], linewidths=1.3, zorder=4))
    ax.set_xlim(0, W0)
    ax.set_ylim(H0, 0)
    groups = label_groups(places)[:MAX_LABELS]  # the heaviest
    written = place_labels(ax, [box for box, _, _ in groups], [draw_numbers(ds) for _, ds, _ in groups],
                           colour=colour, fontsize=6.5, skip=True)
    ax.tick_params(labelsize=7, length=2)
    ax.set_xlabel("x = column, level-0 pixels (QuPath's image coordinates)", fontsize=8, labelpad=2)
    ax.set_ylabel("y = row, level-0 pixels", fontsize=8)

    cax = fig.add_axes(((left + panel_w + 0.25) / fig_w, (bottom + panel_h * 0.15) / fig_h, 0.17 / fig_w,
                        panel_h * 0.7 / fig_h))
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), cax=cax)
    bar.set_label("attention per cell (log scale)", fontsize=8)
    bar.ax.tick_params(labelsize=7)

    info = props.get("cells", {})
    share = info.get("attention_written")
    held = f"the file holds the {info.get('written', len(cells)):,} highest"
    if share is not None:
        held += f", {share:.0%} of it"
    whole = "the model's attention map" if attention is not None else "the file's attention cells"
    shown = sum(len(ds) for (_, ds, _), w in zip(groups, written, strict=True) if w)
    numbers = ("numbered in draw order" if shown == len(patches) else
               f"numbered in draw order: {shown} of them (the heaviest, where a number fits)")
    handles = [Patch(facecolor=cmap(0.75), alpha=0.8, label=f"heat: {whole}, clear where 0 ({held})"),
               Line2D([], [], color=colour, lw=1.5, label=f"the {len(patches)} sampled patches, {numbers}")]
    if regions:
        handles.append(Line2D([], [], color="0.4", lw=1.0, ls="--", label=f"the {len(regions)} regions drawn (white)"))
    if boxes:
        handles.append(Line2D([], [], color=np.asarray(LABEL_BOX_COLOUR) / 255.0, lw=1.6, ls="--",
                              label="boxes recorded in the dataset CSV"))
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.01), ncol=1, fontsize=8, frameon=False)

    title = head["name"].removeprefix("ats: ") if head else props.get("prediction", "")
    if props.get("label") is not None:
        title += f"  |  label {props['label']}"
    fig.text(0.5, 1 - 0.12 / fig_h, f"predicted {title}", fontsize=13, fontweight="bold", ha="center", va="top")
    fig.text(0.5, 1 - 0.48 / fig_h, f"{geojson_name} drawn over {image_name} ({W0}x{H0})  ·  patches "
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


def heat_shape(size0: tuple[int, int], panel_px: tuple[float, float]) -> tuple[int, int]:
    """(h, w) of the heat raster: the panel's pixels, no more than the image has."""
    H0, W0 = size0
    return max(1, min(H0, round(panel_px[0]))), max(1, min(W0, round(panel_px[1])))


def _spans(n_px: int, side0: float, lo: float, hi: float, n_cells: int) -> tuple[np.ndarray, np.ndarray]:
    """[start, stop) of the cells (of ``n_cells`` over level-0 [lo, hi)) that each of
    ``n_px`` pixels over level-0 [0, side0) overlaps; empty (start >= stop) off the map."""
    edges = np.arange(n_px + 1, dtype=np.float64) * side0 / n_px
    u = (edges - lo) / max(hi - lo, 1e-12) * n_cells
    start = np.clip(np.floor(u[:-1] + 1e-9), 0, n_cells).astype(np.int64)
    stop = np.clip(np.ceil(u[1:] - 1e-9), 0, n_cells).astype(np.int64)
    return start, stop


def heat_raster(attention: np.ndarray, extent: tuple[float, float, float, float], size0: tuple[int, int],
                shape: tuple[int, int]) -> np.ndarray:
    """[h, w]: the largest attention of the cells each pixel of a ``shape`` raster over the
    level-0 image ``size0`` overlaps (0 where it overlaps none). The largest, not the mean:
    a 100k slide has a few cells per pixel, and a peak must not be averaged away. Rows
    then columns, in time and memory set by the map's and the raster's sizes."""
    att = np.asarray(attention, dtype=np.float64)
    (H0, W0), (h, w) = size0, shape
    x0, y0, x1, y1 = extent
    rs, re = _spans(h, H0, y0, y1, att.shape[0])
    cs, ce = _spans(w, W0, x0, x1, att.shape[1])
    rows = np.zeros((h, att.shape[1]))
    for i in np.flatnonzero(re > rs):
        rows[i] = att[rs[i]:re[i]].max(axis=0)
    out = np.zeros((h, w))
    for j in np.flatnonzero(ce > cs):
        out[:, j] = rows[:, cs[j]:ce[j]].max(axis=1)
    return out


def cells_raster(cells, size0: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """:func:`heat_raster` of the cells a file holds: ``cells`` (x0, y0, x1, y1, attention)
    in level-0 pixels, the largest where they overlap."""
    (H0, W0), (h, w) = size0, shape
    out = np.zeros((h, w))
    for x0, y0, x1, y1, v in cells:
        r0, r1 = int(y0 * h / H0), max(int(y0 * h / H0) + 1, math.ceil(y1 * h / H0))
        c0, c1 = int(x0 * w / W0), max(int(x0 * w / W0) + 1, math.ceil(x1 * w / W0))
        np.maximum(out[r0:r1, c0:c1], v, out=out[r0:r1, c0:c1])
    return out


def glow(level: np.ndarray, radius: int) -> np.ndarray:
    """Each pixel's brightest neighbour within ``radius`` pixels, dimmed with distance (to
    half at ``radius``): ``max_q level(q) * (1 - d(p, q) / (2 radius))``. A peak of one cell,
    a pixel or less of a 100k slide's preview, becomes a spot one can see, fading out,
    while a smooth background keeps its own level (its neighbours' are no higher)."""
    if radius < 1:
        return level
    h, w = level.shape
    padded = np.pad(level, radius)
    out = level.copy()
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            d = math.hypot(dy, dx)
            if 0 < d <= radius:
                shifted = padded[radius + dy:radius + dy + h, radius + dx:radius + dx + w]
                np.maximum(out, shifted * (1 - d / (2 * radius)), out=out)
    return out


def heat_rgba(raster: np.ndarray, cmap, radius: int):
    """(RGBA [h, w, 4], its LogNorm): the attention ``raster`` coloured on a log scale from
    its top down to the :data:`HEAT_FLOOR` th percentile of its nonzero values (at most
    :data:`HEAT_DECADES` below), each peak glowing over ``radius`` pixels (:func:`glow`),
    opacity rising over :data:`HEAT_ALPHA`. Clear where the attention is 0 (off the
    tissue, outside the map) or below the scale, but for the upper half of a glow."""
    from matplotlib.colors import LogNorm

    nonzero = raster[raster > 0]
    vmax = float(nonzero.max()) if nonzero.size else 1.0
    vmin = float(np.percentile(nonzero, HEAT_FLOOR)) if nonzero.size else vmax / 10
    vmin = max(vmin, vmax / 10**HEAT_DECADES)
    vmin = min(vmin, vmax / 10)  # a flat map: one colour, not a scale of width 0
    norm = LogNorm(vmin, vmax, clip=True)
    on_scale = raster >= vmin
    level = np.where(on_scale, np.asarray(norm(np.where(on_scale, raster, vmin)), dtype=np.float64), 0.0)
    lit = glow(level, radius)
    shown = on_scale | (lit >= 0.5)
    rgba = cmap(lit)
    lo, hi = HEAT_ALPHA
    rgba[..., 3] = np.where(shown, lo + (hi - lo) * lit, 0.0)
    return rgba, norm


def patch_places(boxes, draws: list[int], weights: list[float], size0: tuple[int, int], min_side: float):
    """[((x0, y0, x1, y1), [draw numbers], weight)]: the places patches were read, as the
    preview can show them. Each box is grown about its centre to at least ``min_side``
    level-0 pixels (a patch of a 100k slide is a fraction of a preview pixel) and moved to
    lie inside the image (a grown box at the border would hang off it). One place drawn
    again is one box; so are grown boxes that then overlap another (the draws of one
    region of a 100k slide), around them all. Patches that the preview shows at their own
    size keep their own boxes, overlapping or not. Each place has all its draws and its
    summed ``weights``; in the order of its first draw."""
    H0, W0 = size0
    found: dict[tuple, list] = {}
    for box, d, w in zip(boxes, draws, weights, strict=True):
        place = found.setdefault(tuple(round(float(v), 1) for v in box), [None, [], 0.0, False])
        place[1].append(d)
        place[2] += w
    places = []
    for (x0, y0, x1, y1), (_, ds, w, _) in found.items():
        grown = x1 - x0 < min_side or y1 - y0 < min_side
        x0, x1 = _grow(x0, x1, min_side, W0)
        y0, y1 = _grow(y0, y1, min_side, H0)
        places.append([(x0, y0, x1, y1), ds, w, grown])
    merged = True
    while merged:
        merged = False
        for i in range(len(places)):
            for j in range(i + 1, len(places)):
                (a, _, _, ga), (b, _, _, gb) = places[i], places[j]
                if (ga or gb) and a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]:
                    places[i] = [(min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3])),
                                 places[i][1] + places[j][1], places[i][2] + places[j][2], True]
                    del places[j]
                    merged = True
                    break
            if merged:
                break
    places.sort(key=lambda p: min(p[1]))
    return [(box, sorted(ds), w) for box, ds, w, _ in places]


def label_groups(places, overlap: float = 0.3):
    """[((x0, y0, x1, y1), [draws], weight)] to number, heaviest first: places whose boxes
    overlap by more than ``overlap`` (intersection over union; a digit sampled again a few
    pixels off) share one label over them all, so the numbers of one spot do not crowd
    out those of the rest."""
    groups: list[list] = []
    for box, ds, w in sorted(places, key=lambda p: -p[2]):
        for g in groups:
            if _iou(g[3], box) > overlap:
                g[0] = (min(g[0][0], box[0]), min(g[0][1], box[1]), max(g[0][2], box[2]), max(g[0][3], box[3]))
                g[1] += ds
                g[2] += w
                break
        else:
            groups.append([box, list(ds), w, box])  # the last: the box the group is anchored on
    return sorted(((box, sorted(ds), w) for box, ds, w, _ in groups), key=lambda g: -g[2])


def _iou(a, b) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def draw_numbers(draws: list[int], most: int = 3) -> str:
    """``[3, 9, 10, 11, 12]`` -> ``"3,9-12"``: a place's draws, runs as ranges, the first
    ``most`` runs and how many draws more (``"1,7,9 +14"``): a label, not a list."""
    parts, run = [], [draws[0]]
    for d in draws[1:]:
        if d == run[-1] + 1:
            run.append(d)
        else:
            parts.append(run)
            run = [d]
    parts.append(run)
    text = ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in parts[:most])
    more = sum(len(r) for r in parts[most:])
    return f"{text} +{more}" if more else text


def _grow(a: float, b: float, side: float, limit: float) -> tuple[float, float]:
    """[a, b) widened about its centre to ``side`` (at most ``limit``), then shifted into [0, limit]."""
    side = min(max(b - a, side), limit)
    centre = (a + b) / 2
    a = min(max(centre - side / 2, 0.0), limit - side)
    return a, a + side
