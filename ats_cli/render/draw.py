"""What the attention figures share: one log colour scale with the uniform level marked,
the attention as an overlay, recorded boxes, numbers beside boxes that cover no other,
pixels as matplotlib wants them, and an atomic save.

Attention is coloured on a **log scale** spanning three decades below its maximum: a
trained attention map is very peaked, and on a linear scale everything but the top cell
would be black, while the log scale also shows where the second-best candidates are. A
tick on the colour bar marks the uniform level 1/N, so "more or less than uniform" can be
read off directly. Figures are drawn with matplotlib's object API (no pyplot state; safe
in a library), imported where a figure is drawn, so that importing this package stays
cheap.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ats_cli.io import atomic_write_bytes
from ats_cli.render.records import DigitBox

DECADES = 3.0  # the colour scale spans max / 10**DECADES .. max
CMAP = "inferno"
DIGIT_COLOUR = "#ff2a2a"  # ground-truth objects (the thesis's red dots)


def log_norm(vmax: float, n_cells: int):
    """The log colour scale over DECADES below ``vmax``, whose top is never below ten
    times uniform: a uniform map sits a decade below the top, not at it."""
    from matplotlib.colors import LogNorm

    vmax = max(float(vmax), 10.0 / n_cells)
    return LogNorm(vmin=vmax / 10**DECADES, vmax=vmax, clip=True)


def overlay(ax, att: np.ndarray, norm, extent, *, alpha_low: float = 0.05, alpha_high: float = 0.9,
            power: float = 2.0):
    """Attention as RGBA: colour from the log norm, opacity rising with it (by default with
    its square, so that the image stays visible under a flat, untrained map and is covered
    only where the attention is high)."""
    from matplotlib import colormaps

    t = np.asarray(norm(np.clip(att, norm.vmin, None)), dtype=float)
    rgba = colormaps[CMAP](t)
    rgba[..., 3] = alpha_low + (alpha_high - alpha_low) * t**power
    ax.imshow(rgba, extent=extent, interpolation="nearest", zorder=2)


def colorbar(fig, norm, axes, n_cells: int, **kwargs):
    """A log colour bar whose ticks are the decades plus the uniform level 1/N (the
    attention of an untrained model), labelled, so "sharper than uniform" reads directly."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.ticker import NullLocator

    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=colormaps[CMAP]), ax=axes, **kwargs)
    uniform = 1.0 / n_cells
    bar.set_label(f"attention probability per cell\n(log scale; uniform = 1/{n_cells})", fontsize=9)
    lo, hi = math.ceil(math.log10(norm.vmin) - 1e-9), math.floor(math.log10(norm.vmax) + 1e-9)
    ticks = {10.0**e: f"$10^{{{e}}}$" for e in range(lo, hi + 1)}
    if norm.vmin <= uniform <= norm.vmax:
        ticks = {v: t for v, t in ticks.items() if not 0.5 < v / uniform < 2}  # keep labels apart
        ticks[uniform] = "uniform"
        bar.ax.axhline(uniform, color="white", lw=1.2)
    bar.ax.yaxis.set_minor_locator(NullLocator())
    bar.set_ticks(sorted(ticks), labels=[ticks[v] for v in sorted(ticks)])
    bar.ax.tick_params(labelsize=8)
    return bar


def digit_boxes(ax, boxes: Sequence[DigitBox], *, labels: bool):
    """The objects a dataset CSV records, boxed in red (and labelled with their class)."""
    from matplotlib.patches import Rectangle

    for b in boxes:
        ax.add_patch(Rectangle((b.col, b.row), b.w, b.h, fill=False, ec=DIGIT_COLOUR, lw=1.3, zorder=4))
        if labels:
            ax.text(b.col + b.w, b.row + b.h, b.cls, color=DIGIT_COLOUR, fontsize=8, fontweight="bold",
                    ha="left", va="top", zorder=5)


def as_image(pixels: np.ndarray) -> tuple[np.ndarray, str | None]:
    """[C, h, w] pixels in [0, 1] as imshow takes them: (gray [h, w], "gray") or ([h, w, 3], None)."""
    arr = np.clip(np.asarray(pixels, dtype=np.float32), 0, 1)
    return (arr[0], "gray") if arr.shape[0] == 1 else (arr[:3].transpose(1, 2, 0), None)


def frame(ax, H: int, W: int):
    """Full-resolution pixel axes, rows growing downwards."""
    ax.set_xlim(0, W)
    ax.set_ylim(H, 0)
    ax.tick_params(labelsize=7, length=2)


def place_labels(ax, boxes: Sequence[tuple[float, float, float, float]], texts: Sequence[str], *, colour,
                 fontsize: float = 7.5, skip: bool = False) -> list[bool]:
    """Write ``texts[k]`` beside ``boxes[k]`` (x0, y0, x1, y1 in data units, rows growing
    downwards) so that no label covers another or runs past the axes: for each, in order,
    the first free spot of the box's four outer corners and its sides, then the same
    further out with a leader line to the box. Where none is free the label goes to the
    first spot (``skip`` False) or is left out (``skip`` True: a crowded slide's numbers
    would otherwise pile up into an unreadable smear). Returns which were written."""
    ax.apply_aspect()
    box = ax.get_position()
    fig_w, fig_h = ax.figure.get_size_inches()
    x0, x1 = ax.get_xlim()
    y1, y0 = ax.get_ylim()  # rows grow downwards
    per_pt_x = (x1 - x0) / (box.width * fig_w * 72)
    per_pt_y = (y1 - y0) / (box.height * fig_h * 72)
    placed: list[tuple[float, float, float, float]] = []
    written = []

    def free(rect) -> bool:
        a0, a1, b0, b1 = rect
        inside = a0 >= x0 and a1 <= x1 and b0 >= y0 and b1 <= y1
        return inside and all(a1 <= c0 or a0 >= c1 or b1 <= d0 or b0 >= d1 for c0, c1, d0, d1 in placed)

    for (c, r, c1, r1), text in zip(boxes, texts, strict=True):
        pw, ph = c1 - c, r1 - r
        w = (len(text) * 0.62 * fontsize + 3) * per_pt_x
        h = (fontsize * 1.25 + 2) * per_pt_y
        choice = None
        for step in range(4):
            gx, gy = step * w * 0.6, step * h
            # (left, top) of the label: above-left, above-right, below-left, below-right, then the sides
            spots = [(c - gx, r - h - gy), (c + pw - w + gx, r - h - gy), (c - gx, r + ph + gy),
                     (c + pw - w + gx, r + ph + gy), (c - w - gx, r), (c + pw + gx, r),
                     (c - w - gx, r + ph - h), (c + pw + gx, r + ph - h)]
            for left, upper in spots:
                rect = (left, left + w, upper, upper + h)
                if free(rect):
                    choice = (rect, step)
                    break
            if choice:
                break
        if choice is None and skip:
            written.append(False)
            continue
        if choice is None:
            left, upper = c, r - h
            choice = ((left, left + w, upper, upper + h), 0)
        (a0, a1, b0, b1), step = choice
        placed.append((a0, a1, b0, b1))
        written.append(True)
        if step:  # a leader from the label to the box's nearest corner
            lx, ly = (a0 + a1) / 2, (b0 + b1) / 2
            cx, cy = min(max(lx, c), c + pw), min(max(ly, r), r + ph)
            ax.plot([lx, cx], [ly, cy], color=colour, lw=0.7, alpha=0.8, zorder=8, clip_on=True)
        ax.text((a0 + a1) / 2, (b0 + b1) / 2, text, color=colour, fontsize=fontsize, fontweight="bold",
                ha="center", va="center", zorder=9, clip_on=True,
                bbox={"boxstyle": "square,pad=0.12", "fc": "black", "ec": "none", "alpha": 0.6})
    return written


def short_number(p: float) -> str:
    """0.13 -> '0.13', 0.057 -> '0.057', 0.00028 -> '2.8e-4': two significant digits, short."""
    if p >= 0.1:
        return f"{p:.2f}"
    if p >= 0.001:
        return f"{p:.2g}"
    mantissa, exponent = f"{p:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def save(fig, out: str | Path) -> tuple[int, int]:
    """Write ``fig`` atomically in the format of ``out``'s suffix (PNG by default);
    returns its (width, height) in pixels."""
    out = Path(out)
    fmt = out.suffix.lstrip(".").lower() or "png"
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=fig.dpi, facecolor="white")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, buffer.getvalue())
    if fmt == "png":  # the pixels matplotlib wrote, not the inches times dpi, which it rounds its own way
        from PIL import Image

        buffer.seek(0)
        with Image.open(buffer) as im:
            return im.size
    w, h = fig.get_size_inches() * fig.dpi
    return int(round(w)), int(round(h))
