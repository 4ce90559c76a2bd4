"""The preview of an attention GeoJSON: what QuPath shows after importing it, as a PNG.

Drawn from the FeatureCollection alone (the features and the top-level properties a
reader of the file has), over a thumbnail of the image, so that what the picture shows is
what the file says: cells filled in the colours the file gives them, patches outlined in
their colour and numbered in draw order, label boxes dashed, a colour bar for the cells.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ats_cli.io import atomic_write_bytes
from ats_cli.render.geojson import CELL_CLASS, CELL_CMAP, LABEL_BOX_CLASS, LABEL_BOX_COLOUR, PATCH_COLOUR

__all__ = ["render_preview"]


def render_preview(collection: Mapping, thumbnail: np.ndarray, out: str | os.PathLike[str], *,
                   geojson_name: str = "", image_name: str = "", dpi: int = 110) -> tuple[int, int]:
    """Draw ``collection`` (an attention FeatureCollection) over ``thumbnail`` (uint8
    [h, w, 1 or 3], the whole image at any size) into the PNG ``out``. Cells are filled
    with an opacity rising with their colour scale, so that the tissue stays visible under
    low attention (QuPath fills every detection alike). The axes are level-0 pixels.
    Returns the PNG's (width, height)."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    props = collection.get("properties", {})
    size = props.get("image_size") or {"width": thumbnail.shape[1], "height": thumbnail.shape[0]}
    W0, H0 = int(size["width"]), int(size["height"])
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
    cmap = colormaps[scale.get("colormap", CELL_CMAP)]
    norm = LogNorm(scale["min"], scale["max"], clip=True)
    # Layout in inches: the image panel keeps the image's aspect; titles above, legend below, bar right.
    panel_w = 6.2
    panel_h = min(max(panel_w * H0 / W0, 2.5), 9.0)
    top, bottom, left, right = 0.85, 1.05, 0.75, 1.35
    fig_w, fig_h = left + panel_w + right, top + panel_h + bottom
    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    ax = fig.add_axes((left / fig_w, bottom / fig_h, panel_w / fig_w, panel_h / fig_h))
    gray = thumbnail.ndim == 2 or thumbnail.shape[2] == 1
    ax.imshow(thumbnail.reshape(thumbnail.shape[:2]) if gray else thumbnail[..., :3], cmap="gray" if gray else None,
              vmin=0, vmax=255, extent=(0, W0, H0, 0), interpolation="bilinear", zorder=1, aspect="auto")
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
        top = ring[:, 1].min()
        inside = top < 0.02 * H0  # a patch on the top edge: its number below it, not off the image
        ax.text(ring[:, 0].min(), ring[:, 1].max() if inside else top, str(m.get("draw_order", "")), color=colour,
                fontsize=6, fontweight="bold", ha="left", va="top" if inside else "bottom", zorder=6, clip_on=True)
    ax.set_xlim(0, W0)
    ax.set_ylim(H0, 0)
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
    cell_text = f"attention cells: the {info.get('written', len(cells))} highest of {info.get('nonzero', '?')}"
    if share is not None:
        cell_text += f", {share:.0%} of the attention"
    handles = [Patch(facecolor=cmap(0.75), alpha=0.8, label=cell_text),
               Line2D([], [], color=colour, lw=1.5, label=f"the {len(patches)} sampled patches, in draw order")]
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
