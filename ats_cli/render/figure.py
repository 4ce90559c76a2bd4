"""The attention figure of one image: what the model looked at and what it drew.

Everything is drawn in **full-resolution pixel coordinates**: the image and the attention
map are stretched over the image's extent (the map over the low-res view less the
attention net's margin), so patch offsets and recorded boxes are drawn as they are, and
the axes tell where to look in the original file.

The figure stays readable at any patch count: the image under the heat is the file at
display resolution (a low-res view is too coarse to make out what is in it), the heat is
smooth and patch-sized (:func:`_heat`), there is one box per *distinct* patch location,
brighter and thicker for a larger share of the prediction (with a key), only the
:data:`MAX_STRIP` largest are numbered, with labels placed so that none covers another,
and the strip underneath shows those, largest first, each with its numbers and draw
number. The ranking is the draws' contributions as the model reported them (a patch of
small weight can carry the prediction through what it pooled), else their estimator
weights, else their attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ats_cli.render.draw import (
    CMAP,
    as_image,
    colorbar,
    digit_boxes,
    frame,
    log_norm,
    place_labels,
    save,
    short_number,
)
from ats_cli.render.records import DigitBox, PatchSite, RegionSite

__all__ = ["MAX_STRIP", "AttentionFigure", "FigureResult", "draw_attention"]

REGION_COLOUR = "white"  # a two-level model's drawn regions
BOX_COLOUR = "#00e5ff"  # sampled patches: cyan stands out on black, gray and inferno alike
MAX_STRIP = 16  # patches in the strip under the image (the largest), and boxes numbered on it
STRIP_PER_ROW = 8
HEAT_PX = 720  # the attention map is upsampled smoothly to about this many pixels across
HEAT_ALPHA = 0.6  # opacity of the heat at the top of its scale (it falls with the square of the scale)

# what ranks the patches: (the word in the captions, its short label in the strip, its key)
RANKINGS = {
    "contribution": ("contribution", "c", "c: the draw's contribution to the prediction (estimator weight x what "
                                          "it pooled)"),
    "weight": ("weight", "w", "w: estimator weight"),
    "attention": ("attention", "a", ""),
}


@dataclass
class AttentionFigure:
    """What the figure shows, in numbers and pixels."""

    image_name: str
    size: tuple[int, int]  # (H, W) full-resolution pixels
    background: np.ndarray  # the image at display resolution, [C, h, w] in [0, 1]
    attention: np.ndarray  # [att_h, att_w]
    attention_extent: tuple[float, float, float, float]  # the map's (left, right, bottom, top), full-res pixels
    patch_size: tuple[int, int]  # (h, w)
    sites: list[PatchSite]  # distinct patch locations, ranked (records.patch_sites)
    patches: np.ndarray  # [n, C, h, w] in [0, 1], draw order: the pixels the model read
    prediction: str
    probability: float
    ranking: str = "attention"  # a key of RANKINGS: what ranks the sites
    label: str | None = None
    boxes: Sequence[DigitBox] = field(default_factory=list)
    model_name: str = ""
    sampling: str = ""  # how the patches were drawn, for the subtitle
    entropy: float = float("nan")  # of the attention, nats
    regions: Sequence[RegionSite] = ()  # a two-level model's drawn regions (attention: over its region grid)
    tiles: bool = False  # the attention's cells are tiles the model read, one patch each (tile-mil): drawn as blocks


@dataclass(frozen=True)
class FigureResult:
    """What was drawn: the figure's size in pixels, the sites boxed, those in the strip."""

    size_px: tuple[int, int]
    sites: tuple[PatchSite, ...]
    strip: tuple[PatchSite, ...]


def draw_attention(figure: AttentionFigure, out: str | Path, *, dpi: int = 110) -> FigureResult:
    """The figure: the image under the attention as a smooth, semi-transparent heat (log
    scale, colour bar with the uniform level), one box per distinct sampled location, red
    boxes on the recorded objects, the largest :data:`MAX_STRIP` patches in a strip
    underneath and a title with the prediction and its probability *for this one
    sampling* (the patches shown are the ones the prediction used). Written to ``out`` in
    the format of its suffix."""
    from matplotlib.figure import Figure

    f = figure
    att = f.attention
    H, W = f.size
    ph, pw = f.patch_size
    n = len(f.patches)
    word, short, key_text = RANKINGS[f.ranking]
    # Draws beyond the support (more patches asked than cells that may be sampled) land on
    # probability-0 cells with weight 0: nothing to show, and drawn they would line the
    # image's first row with empty boxes.
    outside = sum(len(s.draws) for s in f.sites if s.attention <= 0)
    sites = [s for s in f.sites if s.attention > 0]
    shown = sites[:MAX_STRIP]
    under_lines = 3 if f.ranking == "contribution" else 2 if f.ranking == "weight" else 1

    # Layout in inches, top to bottom: title lines, the image panel (its aspect kept) with the
    # colour bar and the key on its right, its caption, the strip's heading, the strip.
    fig_w, left, bar_w = 8.0, 0.6, 1.25
    panel_w = fig_w - left - bar_w
    panel_h = panel_w * H / W
    if panel_h > 8.5:  # a tall image: narrower, not taller
        panel_w, panel_h = panel_w * 8.5 / panel_h, 8.5
    panel_h = max(panel_h, 1.5)
    head_h, caption_h, foot_h = 0.72, 0.62 + (0.16 if outside else 0.0) + (0.16 if f.regions else 0.0), 0.1
    strip_head_h = 0.45 if f.ranking == "contribution" else 0.3  # the key on a line of its own
    cell, gap = 0.78, 0.14  # a strip patch and the gap between two
    row_h = 0.2 + cell * ph / pw + 0.06 + 0.13 * max(under_lines, 2) + 0.06  # title, patch, the lines under it
    strip_rows = math.ceil(len(shown) / STRIP_PER_ROW)
    fig_h = head_h + panel_h + caption_h + strip_head_h + strip_rows * row_h + foot_h
    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    panel_bottom = fig_h - head_h - panel_h
    ax = fig.add_axes((left / fig_w, panel_bottom / fig_h, panel_w / fig_w, panel_h / fig_h))
    background, cmap = as_image(f.background)
    ax.imshow(background, cmap=cmap, vmin=0, vmax=1, extent=(0, W, H, 0), interpolation="antialiased", zorder=1,
              aspect="auto")
    norm = log_norm(att.max(), att.size)
    reach = _heat(ax, att, norm, f.attention_extent, (ph, pw), blocks=f.tiles)
    _regions(ax, f.regions, (ph, pw))
    digit_boxes(ax, f.boxes, labels=True)
    frame(ax, H, W)
    colours = _site_boxes(ax, sites, (ph, pw), labelled=len(shown))
    bar_x = (left + panel_w + 0.12) / fig_w
    cax = fig.add_axes((bar_x, (panel_bottom + panel_h * 0.3) / fig_h, 0.16 / fig_w, panel_h * 0.7 / fig_h))
    colorbar(fig, norm, ax, att.size, cax=cax)
    _key(fig, sites, word, (bar_x, panel_bottom / fig_h, (bar_w - 0.15) / fig_w, panel_h * 0.26 / fig_h))

    distinct = f"{len(sites)} distinct places" if len(sites) < n - outside else "each at its own place"
    lines = [f"boxes: the {n} sampled {pw}x{ph} patches ({distinct}), brighter and thicker for more {word}, "
             f"#1-#{len(shown)} numbered by {word}" if len(shown) > 1 else f"box: the sampled {pw}x{ph} patch",
             f"heat: each pixel shows the largest attention of the cells whose patch covers it "
             f"({reach}x{reach} cells of {att.shape[0]}x{att.shape[1]})"
             + ("; red: boxes from the dataset CSV" if f.boxes else "")]
    if f.tiles:
        lines = [f"boxes: the {n} tiles of most attention, brighter and thicker for more, #1-#{len(shown)} numbered "
                 "by attention",
                 f"heat: the attention of each of the {att.shape[0]}x{att.shape[1]} tiles of {pw}x{ph} (0 where not "
                 "tissue)" + ("; red: boxes from the dataset CSV" if f.boxes else "")]
    if f.regions:
        side = f.regions[0].size
        lines[1:2] = [f"heat: the coarse attention over the {att.shape[0]}x{att.shape[1]} regions of {side}x{side}"
                      + ("; red: boxes from the dataset CSV" if f.boxes else ""),
                      f"white: the {len(f.regions)} regions drawn (R1-R{len(f.regions)} in draw order, w: weight), "
                      "each with its own attention on its own scale"]
    if outside:
        lines.append(f"{outside} of the {n} draws fell on probability-0 cells (more draws than cells that may be "
                     "sampled): weight 0, not drawn")
    fig.text(0.5, (panel_bottom - 0.22) / fig_h, "\n".join(lines), ha="center", va="top",
             fontsize=7.5, linespacing=1.4)

    more = f"the {len(shown)} of most {word}" if len(shown) < len(sites) else f"all {len(shown)}"
    key = ", ".join(k for k in (key_text, "w: estimator weight" if f.ranking == "contribution" else "",
                                "a: attention probability") if k)
    strip_top = panel_bottom - caption_h
    heading = f"the sampled patches at full resolution, {more}, largest first"
    fig.text(0.5, (strip_top - 0.05) / fig_h, heading + ("\n" if f.ranking == "contribution" else "  ") + f"({key})",
             ha="center", va="top", fontsize=8, linespacing=1.4)
    strip_left = (fig_w - (STRIP_PER_ROW * cell + (STRIP_PER_ROW - 1) * gap)) / 2
    for i, site in enumerate(shown):
        r, c = divmod(i, STRIP_PER_ROW)
        bottom = strip_top - strip_head_h - r * row_h - 0.2 - cell * ph / pw
        pax = fig.add_axes(((strip_left + c * (cell + gap)) / fig_w, bottom / fig_h, cell / fig_w,
                            cell * ph / pw / fig_h))
        img, pcmap = as_image(f.patches[site.index])
        pax.imshow(img, cmap=pcmap, vmin=0, vmax=1, interpolation="nearest", aspect="auto")
        pax.set_xticks([])
        pax.set_yticks([])
        for spine in pax.spines.values():
            spine.set_edgecolor(colours[i])
            spine.set_linewidth(2.0)
        times = f" (x{len(site.draws)})" if len(site.draws) > 1 else ""
        pax.set_title(f"#{i + 1}  draw {site.draws[0]}{times}", fontsize=6.5, pad=2)
        under = [f"c {short_number(site.contribution)}" if f.ranking == "contribution" else "",
                 f"w {short_number(site.weight)}" if f.ranking in ("contribution", "weight") else "",
                 f"a {short_number(site.attention)}"]
        pax.set_xlabel("\n".join(u for u in under if u), fontsize=6.5, labelpad=1.5, linespacing=1.2)

    truth = "" if f.label is None else (f"  |  label {f.label} " + ("(correct)" if f.label == f.prediction
                                                                     else "(wrong)"))
    fig.text(0.5, 1 - 0.1 / fig_h, f"predicted {f.prediction}  (p = {f.probability:.2f}){truth}", fontsize=14,
             fontweight="bold", ha="center", va="top")
    details = [f"{f.image_name} {W}x{H}", f.model_name, f.sampling,
               f"attention entropy {f.entropy:.2f} nats (uniform {math.log(att.size):.2f})"]
    subtitle = _one_or_two_lines([d for d in details if d], fig.get_figwidth())
    fig.text(0.5, 1 - (0.38 if "\n" in subtitle else 0.45) / fig_h, subtitle, ha="center", va="top", fontsize=7.5,
             color="0.3")
    size = save(fig, out)
    return FigureResult(size, tuple(sites), tuple(shown))


def _one_or_two_lines(parts: list[str], fig_w: float, fontsize: float = 7.5) -> str:
    """``parts`` joined by dots on one line, or split over two where one line would run past
    the figure's edges (a long file or model name): a character of a sans-serif font is
    about 0.6 of its size wide, so a line of ``fig_w`` inches holds ``fig_w * 72 / (0.6 *
    fontsize)`` of them."""
    line = "  ·  ".join(parts)
    if len(line) <= fig_w * 72 / (0.6 * fontsize) or len(parts) < 2:
        return line
    half = max(1, len(parts) // 2)
    return "  ·  ".join(parts[:half]) + "\n" + "  ·  ".join(parts[half:])


def _heat(ax, att: np.ndarray, norm, extent, patch_size: tuple[int, int], *, blocks: bool = False) -> int:
    """Attention as a smooth, semi-transparent heat over the image.

    A trained map is very peaked (a few dozen cells of tens of thousands hold most of it),
    and one cell is a few screen pixels: drawn as it is, the heat is a scatter of dots.
    So each cell shows the largest attention within the reach of a patch (a window of
    about a patch's size in cells): a pixel's colour is then the attention of the
    most-attended cell whose patch would cover it, and a peak reads as a patch-sized blob
    where the model would look. The map is then log-scaled, upsampled bilinearly (about
    :data:`HEAT_PX` across) and coloured, its opacity rising with the square of the scale,
    so the image shows through where attention is low. Returns the window's side in cells.
    ``blocks``: each cell is a tile the model read whole (tile-mil): drawn as its block,
    neither widened nor smoothed."""
    from matplotlib import colormaps

    left, right, bottom, top = extent
    ph, pw = patch_size
    cells = min(pw * att.shape[1] / max(right - left, 1e-9), ph * att.shape[0] / max(bottom - top, 1e-9))
    reach = max(1, int(round(cells)) // 2 * 2 + 1)  # odd, so the window is centred on its cell
    t = np.asarray(norm(np.clip(att, norm.vmin, None)), dtype=np.float64)
    if blocks:
        reach = 1
    if reach > 1:
        t = _max_filter(t, reach)
    factor = 1 if blocks else max(1, math.ceil(HEAT_PX / max(att.shape)))
    if factor > 1:
        t = _upsample(t, factor)
    t = np.clip(t, 0, 1)
    rgba = colormaps[CMAP](t)
    rgba[..., 3] = HEAT_ALPHA * t**2
    ax.imshow(rgba, extent=extent, interpolation="nearest" if blocks else "antialiased", zorder=2, aspect="auto")
    return reach


def _regions(ax, regions: Sequence[RegionSite], patch_size: tuple[int, int]) -> None:
    """A two-level model's drawn regions: each one's fine attention as a heat on its own
    log scale (it sums to 1 within the region), a white box, and ``R<draw> w <weight>``."""
    from matplotlib.patches import Rectangle

    for region in regions:
        _heat(ax, region.fine, log_norm(region.fine.max(), region.fine.size), region.fine_extent, patch_size)
        ax.add_patch(Rectangle((region.col, region.row), region.size, region.size, fill=False, ec=REGION_COLOUR,
                               lw=1.4, ls="--", zorder=5))
        ax.text(region.col + 0.02 * region.size, region.row + 0.03 * region.size,
                f"R{region.draw} w {short_number(region.weight)}", color="black", fontsize=7, va="top", ha="left",
                zorder=5, bbox={"facecolor": REGION_COLOUR, "alpha": 0.8, "pad": 1.2, "lw": 0})


def _max_filter(t: np.ndarray, size: int) -> np.ndarray:
    """The largest value in the ``size`` x ``size`` window centred on each cell (``size``
    odd; the window stops at the map's edge)."""
    pad = size // 2
    padded = np.pad(t, pad, mode="constant", constant_values=-np.inf)
    windows = np.lib.stride_tricks.sliding_window_view(padded, (size, size))
    return windows.max(axis=(-2, -1))


def _upsample(t: np.ndarray, factor: int) -> np.ndarray:
    """Bilinear upsampling by an integer ``factor``, pixel centres aligned (each output
    pixel samples the input at its own centre, clamped at the edges)."""

    def axis(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = np.clip((np.arange(n * factor) + 0.5) / factor - 0.5, 0, n - 1)
        lo = np.floor(src).astype(int)
        hi = np.minimum(lo + 1, n - 1)
        return lo, hi, src - lo

    r0, r1, fr = axis(t.shape[0])
    c0, c1, fc = axis(t.shape[1])
    rows = t[r0] * (1 - fr)[:, None] + t[r1] * fr[:, None]
    return rows[:, c0] * (1 - fc) + rows[:, c1] * fc


def _key(fig, sites: Sequence[PatchSite], word: str, rect) -> None:
    """A small key beside the image: what a box's brightness and thickness say (the
    largest, a middle and the smallest site's number)."""
    from matplotlib.lines import Line2D

    if not sites:
        return
    strength = _box_strength(sites)
    picks = sorted({0, len(sites) // 2, len(sites) - 1})
    handles, seen = [], set()
    for i in picks:
        colour, lw = _box_style(strength[i])
        text = short_number(sites[i].contribution)
        if text not in seen:  # equal numbers: one line
            seen.add(text)
            handles.append(Line2D([], [], color=colour, lw=lw, label=text))
    kax = fig.add_axes(rect)
    kax.set_axis_off()
    kax.set_facecolor("black")
    kax.legend(handles=handles, title=f"box: {word}", loc="lower left", fontsize=7, title_fontsize=7,
               frameon=True, facecolor="black", labelcolor="white", edgecolor="0.5", handlelength=1.6,
               borderaxespad=0).get_title().set_color("white")


def _box_strength(sites: Sequence[PatchSite]) -> list[float]:
    """How strongly each site's box is drawn, in [0, 1]: the square root of its share over
    the largest (the square root keeps light boxes visible next to a dominant one)."""
    top = max((s.contribution for s in sites), default=0.0)
    return [math.sqrt(max(s.contribution, 0.0) / top) if top > 0 else 1.0 for s in sites]


def _box_style(t: float) -> tuple[tuple[float, float, float, float], float]:
    """(edge colour, line width) of a box of strength ``t``: brighter and thicker when heavier."""
    from matplotlib.colors import to_rgba

    return to_rgba(BOX_COLOUR, 0.3 + 0.7 * t), 0.6 + 1.6 * t


def _site_boxes(ax, sites: Sequence[PatchSite], patch_size: tuple[int, int], labelled: int) -> list:
    """One box per distinct patch location, brighter and thicker for a larger share (the
    largest drawn last, on top); the first ``labelled`` sites (the strip's) numbered #1..
    next to their box, each label where it covers no other. Returns the boxes' colours,
    for the strip's frames."""
    from matplotlib.patches import Rectangle

    ph, pw = patch_size
    colours = []
    for order, (site, t) in enumerate(zip(sites, _box_strength(sites), strict=True)):
        colour, lw = _box_style(t)
        colours.append(colour)
        ax.add_patch(Rectangle((site.col, site.row), pw, ph, fill=False, ec=colour, lw=lw,
                               zorder=6 + (len(sites) - order) / max(len(sites), 1)))
    _place_labels(ax, sites[:labelled], (ph, pw))
    return colours


def _place_labels(ax, sites: Sequence[PatchSite], patch_size: tuple[int, int], fontsize: float = 7.5) -> None:
    """Number the sites #1.. beside their boxes so that no label covers another
    (:func:`ats_cli.render.draw.place_labels`; the first spot if none is free)."""
    ph, pw = patch_size
    place_labels(ax, [(s.col, s.row, s.col + pw, s.row + ph) for s in sites], [f"#{k + 1}" for k in range(len(sites))],
                 colour=BOX_COLOUR, fontsize=fontsize)
