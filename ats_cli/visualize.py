"""Pictures of what the model looks at: one image's attention and sampled patches, and
the attention of successive training epochs (thesis Figure 3.3).

Conventions shared by both figures, chosen so that they read at a glance:

* everything is drawn in **full-resolution pixel coordinates**: the image and the
  attention map are stretched over the image's extent (the attention map over the
  low-res view less the attention net's margin), so patch offsets and digit boxes are
  drawn as they are, and the axes tell where to look in the original file;
* attention is coloured on a **log scale** spanning three decades below its maximum, with
  an opacity ramp (low attention almost transparent): a trained attention map is very
  peaked, and on a linear scale everything but the top cell would be black, while the
  log scale also shows where the second-best candidates are. A tick on the colour bar
  marks the uniform level 1/N, so "more or less than uniform" can be read off directly.
* figures are drawn with matplotlib's object API (no pyplot state; safe in a library) and
  written atomically.

The single-image figure (:func:`render_attention`) stays readable at any patch count:
the image under the heat is the file at display resolution (the low-res view is too
coarse to make out digits), the heat is smooth and patch-sized (:func:`_heat`), there is
one box per *distinct* patch location, brighter and thicker for more estimator weight
(with a key), only the :data:`MAX_STRIP` heaviest are numbered, with labels placed so
that none covers another, and the strip underneath shows those, heaviest first, each
with its weight, attention and draw number. The evolution figure draws the model's
low-res view, in gray, under each epoch's map.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ats_cli.checkpoint import CheckpointError
from ats_cli.data.dataset import KNOWN_SPLITS
from ats_cli.io import atomic_write_bytes
from ats_cli.predict import OpenedImage, Predictor, load_predictor, read_inputs_csv

__all__ = [
    "DigitBox",
    "ImageInfo",
    "RenderSummary",
    "epoch_checkpoints",
    "find_image_info",
    "render_attention",
    "render_evolution",
    "select_epochs",
]

DECADES = 3.0  # the colour scale spans max / 10**DECADES .. max
CMAP = "inferno"
BOX_COLOUR = "#00e5ff"  # sampled patches: cyan stands out on black, gray and inferno alike
DIGIT_COLOUR = "#ff2a2a"  # ground-truth objects (the thesis's red dots)
MAX_PANELS = 8
MAX_STRIP = 16  # patches in the strip under the image (the heaviest), and boxes numbered on it
STRIP_PER_ROW = 8
DISPLAY_SIDE = 1000  # the image under the heat is read at about this many pixels on its long side
HEAT_PX = 720  # the attention map is upsampled smoothly to about this many pixels across
HEAT_ALPHA = 0.6  # opacity of the heat at the top of its scale (it falls with the square of the scale)
_EPOCH_FILE = re.compile(r"epoch_(\d+)\.pt$")


# ---------------------------------------------------------------------------- ground truth


@dataclass(frozen=True)
class DigitBox:
    """An object recorded by a generator: class and box (top-left row, col; h, w) in full-res pixels."""

    cls: str
    row: int
    col: int
    h: int
    w: int


@dataclass(frozen=True)
class ImageInfo:
    """What a dataset CSV knows about an image: its label and its ``digits`` boxes (may be empty)."""

    csv: Path
    label: str | None
    boxes: list[DigitBox]


def _parse_boxes(text: str | None) -> list[DigitBox]:
    """``[[class, row, col, h, w], ...]`` (Megapixel MNIST's ``digits`` column, synthetic slides' ``boxes``);
    [] if absent or malformed (:func:`ats_cli.geojson.parse_boxes` reads it)."""
    from ats_cli.geojson import parse_boxes

    return [DigitBox(*box) for box in parse_boxes(text)]


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
                return ImageInfo(csv_path, item.label, _parse_boxes(boxes))
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


# ---------------------------------------------------------------------------- drawing helpers


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
    reading: str | None = None  # how a slide was read (ats_cli.data.magnification.describe_reading)


@dataclass(frozen=True)
class PatchSite:
    """One distinct sampled patch location: its top-left (row, col) in full-res pixels, the
    draws that chose it (1-based draw numbers), its attention probability, its total
    estimator weight (the attention when the weights are unknown) and the index of its
    first draw in the model's outputs."""

    row: int
    col: int
    draws: tuple[int, ...]
    attention: float
    weight: float
    index: int


def patch_sites(offsets: Sequence[Sequence[int]], attention: Sequence[float],
                weights: Sequence[float] | None = None) -> list[PatchSite]:
    """The sampled patches grouped by location (with replacement a location can be drawn
    several times; its weight is then the sum of its draws'), heaviest first; ties keep
    draw order. Without ``weights`` the attention ranks them."""
    sites: dict[tuple[int, int], dict] = {}
    for i, (r, c) in enumerate(offsets):
        w = float(attention[i] if weights is None else weights[i])
        site = sites.setdefault((int(r), int(c)), {"draws": [], "weight": 0.0, "index": i,
                                                   "attention": float(attention[i])})
        site["draws"].append(i + 1)
        site["weight"] += w if weights is not None or len(site["draws"]) == 1 else 0.0
    ordered = sorted(sites.items(), key=lambda kv: (-kv[1]["weight"], kv[1]["index"]))
    return [PatchSite(r, c, tuple(v["draws"]), v["attention"], v["weight"], v["index"]) for (r, c), v in ordered]


def sample_attention(predictor: Predictor, opened: OpenedImage, *, n_patches: int | None, seed: int,
                     return_patches: bool = False):
    """One seeded sampling of ``opened``: the forward pass both the figure and the GeoJSON
    (ats_cli.geojson) draw, so the same seed shows the same patches in both."""
    generator = torch.Generator(device=predictor.device).manual_seed(seed)
    mask = None if opened.support is None else opened.support[None]  # a slide's tissue mask, as in predict
    with torch.no_grad():
        return predictor.model(opened.low[None].to(predictor.device), [opened.source], n_patches=n_patches,
                               generator=generator, return_patches=return_patches, support_mask=mask)


def _extents(model, opened: OpenedImage):
    """(image extent, attention extent) in full-res pixel coordinates, imshow order (l, r, b, t)."""
    H, W = opened.source.size
    low_h, low_w = opened.low.shape[-2:]
    margin = getattr(getattr(model, "attention_net", None), "margin", 0)  # Deep MIL: its grid spans the image
    ry, rx = H / low_h, W / low_w
    return (0, W, H, 0), (margin * rx, (low_w - margin) * rx, (low_h - margin) * ry, margin * ry)


def _per_weight(result) -> torch.Tensor:
    """Each draw's contribution per unit of estimator weight [B, n] (0 where the weight is 0),
    from the model's output (ATSOutput.contributions / .weights)."""
    w = result.weights.double().cpu()
    return torch.where(w > 0, result.contributions.cpu() / w.clamp_min(torch.finfo(torch.float64).tiny), 0.0)


def _gains(model, result) -> torch.Tensor | None:
    """Each drawn patch's learned gain [B, n] (``--patch-gain``), None for a model without
    one. With a gain, a patch's share of the pooled feature is its estimator weight times
    its gain, not its weight alone: a nest patch of small weight can carry the prediction,
    and the figure ranks and draws the patches by that product."""
    if getattr(model, "gain", None) is None or getattr(result, "contributions", None) is None:
        return None
    return _per_weight(result)


def _count_shares(model, result, opened: OpenedImage) -> torch.Tensor | None:
    """For a model that pools counts, each drawn patch's count per unit of estimator weight
    [B, n]: its vote's total (below 1 where a none logit takes part of it) over
    ``max(M, floor)`` (ats_cli.extensions.pooling_counts); None for other models. Weight times
    this is what the draw adds to the class counts, so the figure ranks the patches as the
    prediction weighs them: a digit drawn many times (a bold one, much attention) counts
    once in both, and noise read as none adds (almost) nothing."""
    from ats_cli.extensions.pooling_counts import CountPooling

    if not isinstance(getattr(model, "pooling", None), CountPooling) or result.contributions is None:
        return None
    return _per_weight(result)


def _weights(model, result, seed: int) -> torch.Tensor | None:
    """The estimator weights [B, n] of this sampling (replayed, see
    :func:`ats_cli.geojson.replay_weights`), or None where they cannot be recovered."""
    from ats_cli.geojson import replay_weights

    try:
        weights = replay_weights(model, result, seed=seed)
    except (AttributeError, RuntimeError, ValueError):  # not an attention-sampling model
        return None
    return None if weights is None else weights.cpu()


def _display_image(image, opened: OpenedImage, reading: Mapping[str, object] | None) -> tuple[np.ndarray, str | None]:
    """The image as it is drawn under the heat: the file at about :data:`DISPLAY_SIDE`
    pixels (the low-res view the attention net sees is often too coarse to make out what
    is in it: 180x180 for a 1500x1500 Megapixel MNIST image), read from the smallest
    pyramid level that suffices; the low-res view when that cannot be read."""
    from ats_cli.data.slides import open_image

    reading = reading or {}
    try:
        with open_image(image, reader=str(reading.get("reader") or "auto"),
                        max_pixels=reading.get("max_pixels")) as slide:  # type: ignore[arg-type]
            thumb = slide.thumbnail(DISPLAY_SIDE)
    except Exception:  # noqa: BLE001 - a picture of the low-res view is still a picture
        return _gray(opened.low)
    arr = thumb.astype(np.float32) / 255.0
    if arr.shape[2] == 1:
        return arr[..., 0], "gray"
    return arr[..., :3], None


def _gray(low: torch.Tensor) -> tuple[np.ndarray, str | None]:
    arr = low.detach().cpu().float().clamp(0, 1).numpy()
    return (arr[0], "gray") if arr.shape[0] == 1 else (arr.transpose(1, 2, 0), None)


def _norm(vmax: float, n_cells: int):
    from matplotlib.colors import LogNorm

    vmax = max(float(vmax), 10.0 / n_cells)  # a uniform map sits a decade below the top, not at it
    return LogNorm(vmin=vmax / 10**DECADES, vmax=vmax, clip=True)


def _overlay(ax, att: np.ndarray, norm, extent, *, alpha_low: float = 0.05, alpha_high: float = 0.9,
             power: float = 2.0):
    """Attention as RGBA: colour from the log norm, opacity rising with it (by default with
    its square, so that the image stays visible under a flat, untrained map and is covered
    only where the attention is high)."""
    from matplotlib import colormaps

    t = np.asarray(norm(np.clip(att, norm.vmin, None)), dtype=float)
    rgba = colormaps[CMAP](t)
    rgba[..., 3] = alpha_low + (alpha_high - alpha_low) * t**power
    ax.imshow(rgba, extent=extent, interpolation="nearest", zorder=2)


def _heat(ax, att: np.ndarray, norm, extent, patch_size: tuple[int, int]) -> int:
    """Attention as a smooth, semi-transparent heat over the image.

    A trained map is very peaked (a few dozen cells of tens of thousands hold most of it),
    and one cell is a few screen pixels: drawn as it is, the heat is a scatter of dots.
    So each cell shows the largest attention within the reach of a patch (a window of
    about a patch's size in cells): a pixel's colour is then the attention of the
    most-attended cell whose patch would cover it, and a peak reads as a patch-sized blob
    where the model would look. The map is then log-scaled, upsampled bilinearly (about
    :data:`HEAT_PX` across) and coloured, its opacity rising with the square of the scale,
    so the image shows through where attention is low. Returns the window's side in cells."""
    import torch.nn.functional as F
    from matplotlib import colormaps

    left, right, bottom, top = extent
    ph, pw = patch_size
    cells = min(pw * att.shape[1] / max(right - left, 1e-9), ph * att.shape[0] / max(bottom - top, 1e-9))
    reach = max(1, int(round(cells)) // 2 * 2 + 1)  # odd, so the window is centred on its cell
    t = torch.from_numpy(np.asarray(norm(np.clip(att, norm.vmin, None)), dtype=np.float32))[None, None]
    if reach > 1:
        t = F.max_pool2d(t, reach, stride=1, padding=reach // 2)
    factor = max(1, math.ceil(HEAT_PX / max(att.shape)))
    if factor > 1:
        t = F.interpolate(t, scale_factor=factor, mode="bilinear", align_corners=False)
    t = t[0, 0].clamp(0, 1).numpy()
    rgba = colormaps[CMAP](t)
    rgba[..., 3] = HEAT_ALPHA * t**2
    ax.imshow(rgba, extent=extent, interpolation="antialiased", zorder=2, aspect="auto")
    return reach


def _weight_key(fig, sites: Sequence[PatchSite], what: str, rect) -> None:
    """A small key beside the image: what a box's brightness and thickness say (the
    heaviest, a middle and the lightest site's weight)."""
    from matplotlib.lines import Line2D

    if not sites:
        return
    strength = _box_strength(sites)
    picks = sorted({0, len(sites) // 2, len(sites) - 1})
    handles, seen = [], set()
    for i in picks:
        colour, lw = _box_style(strength[i])
        if _short_prob(sites[i].weight) not in seen:  # equal weights: one line
            seen.add(_short_prob(sites[i].weight))
            handles.append(Line2D([], [], color=colour, lw=lw, label=_short_prob(sites[i].weight)))
    kax = fig.add_axes(rect)
    kax.set_axis_off()
    kax.set_facecolor("black")
    kax.legend(handles=handles, title=f"box: {what}", loc="lower left", fontsize=7, title_fontsize=7,
               frameon=True, facecolor="black", labelcolor="white", edgecolor="0.5", handlelength=1.6,
               borderaxespad=0).get_title().set_color("white")


def _box_strength(sites: Sequence[PatchSite]) -> list[float]:
    """How strongly each site's box is drawn, in [0, 1]: the square root of its weight over
    the largest (the square root keeps light boxes visible next to a dominant one)."""
    top = max((s.weight for s in sites), default=0.0)
    return [math.sqrt(max(s.weight, 0.0) / top) if top > 0 else 1.0 for s in sites]


def _box_style(t: float) -> tuple[tuple[float, float, float, float], float]:
    """(edge colour, line width) of a box of strength ``t``: brighter and thicker when heavier."""
    from matplotlib.colors import to_rgba

    return to_rgba(BOX_COLOUR, 0.3 + 0.7 * t), 0.6 + 1.6 * t


def _site_boxes(ax, sites: Sequence[PatchSite], patch_size: tuple[int, int], labelled: int) -> list:
    """One box per distinct patch location, brighter and thicker for more weight (the
    heaviest drawn last, on top); the first ``labelled`` sites (the strip's) numbered
    #1.. next to their box, each label where it covers no other. Returns the boxes'
    colours, for the strip's frames."""
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
    """Number the sites #1.. beside their boxes so that no label covers another: for each
    (heaviest first) the first free spot of the box's four outer corners and its sides,
    then the same further out with a leader line; the first spot if none is free."""
    ph, pw = patch_size
    ax.apply_aspect()
    box = ax.get_position()
    fig_w, fig_h = ax.figure.get_size_inches()
    x0, x1 = ax.get_xlim()
    y1, y0 = ax.get_ylim()  # rows grow downwards
    per_pt_x = (x1 - x0) / (box.width * fig_w * 72)
    per_pt_y = (y1 - y0) / (box.height * fig_h * 72)
    placed: list[tuple[float, float, float, float]] = []

    def free(rect) -> bool:
        a0, a1, b0, b1 = rect
        inside = a0 >= x0 and a1 <= x1 and b0 >= y0 and b1 <= y1
        return inside and all(a1 <= c0 or a0 >= c1 or b1 <= d0 or b0 >= d1 for c0, c1, d0, d1 in placed)

    for k, site in enumerate(sites):
        text = f"#{k + 1}"
        w = (len(text) * 0.62 * fontsize + 3) * per_pt_x
        h = (fontsize * 1.25 + 2) * per_pt_y
        r, c = site.row, site.col
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
        if choice is None:
            left, upper = c, r - h
            choice = ((left, left + w, upper, upper + h), 0)
        (a0, a1, b0, b1), step = choice
        placed.append((a0, a1, b0, b1))
        if step:  # a leader from the label to the box's nearest corner
            lx, ly = (a0 + a1) / 2, (b0 + b1) / 2
            cx, cy = min(max(lx, c), c + pw), min(max(ly, r), r + ph)
            ax.plot([lx, cx], [ly, cy], color=BOX_COLOUR, lw=0.7, alpha=0.8, zorder=8, clip_on=True)
        ax.text((a0 + a1) / 2, (b0 + b1) / 2, text, color=BOX_COLOUR, fontsize=fontsize, fontweight="bold",
                ha="center", va="center", zorder=9, clip_on=True,
                bbox={"boxstyle": "square,pad=0.12", "fc": "black", "ec": "none", "alpha": 0.6})


def _colorbar(fig, norm, axes, n_cells: int, **kwargs):
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


def _digit_boxes(ax, boxes: Sequence[DigitBox], *, labels: bool):
    from matplotlib.patches import Rectangle

    for b in boxes:
        ax.add_patch(Rectangle((b.col, b.row), b.w, b.h, fill=False, ec=DIGIT_COLOUR, lw=1.3, zorder=4))
        if labels:
            ax.text(b.col + b.w, b.row + b.h, b.cls, color=DIGIT_COLOUR, fontsize=8, fontweight="bold",
                    ha="left", va="top", zorder=5)


def _short_prob(p: float) -> str:
    """0.13 -> '0.13', 0.057 -> '0.057', 0.00028 -> '2.8e-4': two significant digits, short."""
    if p >= 0.1:
        return f"{p:.2f}"
    if p >= 0.001:
        return f"{p:.2g}"
    mantissa, exponent = f"{p:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _save(fig, out: Path) -> tuple[int, int]:
    fmt = out.suffix.lstrip(".").lower() or "png"
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=fig.dpi, facecolor="white")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, buffer.getvalue())
    w, h = fig.get_size_inches() * fig.dpi
    return int(round(w)), int(round(h))


def _frame(ax, H: int, W: int):
    ax.set_xlim(0, W)
    ax.set_ylim(H, 0)
    ax.tick_params(labelsize=7, length=2)


# ---------------------------------------------------------------------------- figures


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
    """One figure for one image, made to read at a glance at any patch count: the image
    (at display resolution) under the attention as a smooth, semi-transparent heat (log
    scale, colour bar with the uniform level), one box per distinct sampled patch location
    (brighter and thicker = more estimator weight; the heaviest :data:`MAX_STRIP` numbered
    by weight, labels kept apart), red boxes on the recorded digits when a dataset CSV
    knows the image, the heaviest patches at full resolution in a strip underneath
    (heaviest first, each with its weight, attention and draw number) and a title with the
    predicted class and its probability *for this one sampling* (the patches shown are
    the ones the prediction used). Raises CheckpointError (model) or ImageReadError
    (image), both naming the file. ``reading``: reader/level/mpp/tissue overrides, as for
    ``ats predict`` (default: the model's training settings)."""
    from matplotlib.figure import Figure

    predictor = model if isinstance(model, Predictor) else load_predictor(model, device)
    net = predictor.model
    opened = predictor.opener(**(reading or {}))(image, channels=predictor.channels, scale=net.scale,
                                                 patch_size=net.patch_size)
    result = sample_attention(predictor, opened, n_patches=n_patches, seed=seed, return_patches=True)
    probs = torch.softmax(result.logits[0].float(), 0).cpu()
    k = int(probs.argmax())
    prediction, probability = predictor.classes[k], float(probs[k])
    att = result.attention[0].cpu().double().numpy()
    weights = _weights(net, result, seed)
    gains = _gains(net, result)
    if weights is not None and gains is not None:  # a patch's share of the pooled feature: w g
        weights = weights * gains
    shares = _count_shares(net, result, opened)
    if weights is not None and shares is not None:  # what a draw adds to the counts: w (sum of vote) / M
        weights = weights * shares
    sites = patch_sites(result.offsets[0].cpu().tolist(), result.sampled_probs[0].cpu().tolist(),
                        None if weights is None else weights[0].tolist())
    # Draws beyond the support (more patches asked than cells that may be sampled) land on
    # probability-0 cells with weight 0 (ats_cli.core.sampling.sample): nothing to show, and
    # drawn they would line the image's first row with empty boxes.
    outside = sum(len(s.draws) for s in sites if s.attention <= 0)
    sites = [s for s in sites if s.attention > 0]
    patches = result.patches[0].cpu()
    info = find_image_info(image, data)
    H, W = opened.source.size
    ph, pw = net.patch_size
    n = int(result.offsets.shape[1])
    shown = sites[:MAX_STRIP]
    what = ("weight x gain" if gains is not None else "count" if shares is not None else "weight") \
        if weights is not None else "attention"

    # Layout in inches, top to bottom: title lines, the image panel (its aspect kept) with the
    # colour bar and the weight key on its right, its caption, the strip's heading, the strip.
    fig_w, left, bar_w = 8.0, 0.6, 1.25
    panel_w = fig_w - left - bar_w
    panel_h = panel_w * H / W
    if panel_h > 8.5:  # a tall image: narrower, not taller
        panel_w, panel_h = panel_w * 8.5 / panel_h, 8.5
    panel_h = max(panel_h, 1.5)
    head_h, caption_h, strip_head_h, foot_h = 0.72, 0.62 + (0.16 if outside else 0.0), 0.3, 0.1
    cell, gap = 0.78, 0.14  # a strip patch and the gap between two
    row_h = 0.2 + cell * ph / pw + 0.38  # title, patch, two lines under it
    strip_rows = math.ceil(len(shown) / STRIP_PER_ROW)
    fig_h = head_h + panel_h + caption_h + strip_head_h + strip_rows * row_h + foot_h
    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    panel_bottom = fig_h - head_h - panel_h
    ax = fig.add_axes((left / fig_w, panel_bottom / fig_h, panel_w / fig_w, panel_h / fig_h))
    img_extent, att_extent = _extents(net, opened)
    background, cmap = _display_image(image, opened, reading)
    ax.imshow(background, cmap=cmap, vmin=0, vmax=1, extent=img_extent, interpolation="antialiased", zorder=1,
              aspect="auto")
    norm = _norm(att.max(), att.size)
    reach = _heat(ax, att, norm, att_extent, (ph, pw))
    if info:
        _digit_boxes(ax, info.boxes, labels=True)
    _frame(ax, H, W)
    colours = _site_boxes(ax, sites, (ph, pw), labelled=len(shown))
    bar_x = (left + panel_w + 0.12) / fig_w
    cax = fig.add_axes((bar_x, (panel_bottom + panel_h * 0.3) / fig_h, 0.16 / fig_w, panel_h * 0.7 / fig_h))
    _colorbar(fig, norm, ax, att.size, cax=cax)
    _weight_key(fig, sites, what, (bar_x, panel_bottom / fig_h, (bar_w - 0.15) / fig_w, panel_h * 0.26 / fig_h))

    distinct = f"{len(sites)} distinct places" if len(sites) < n - outside else "each at its own place"
    lines = [f"boxes: the {n} sampled {pw}x{ph} patches ({distinct}), brighter and thicker for more {what}, "
             f"#1-#{len(shown)} numbered by {what}" if len(shown) > 1 else f"box: the sampled {pw}x{ph} patch",
             f"heat: each pixel shows the largest attention of the cells whose patch covers it "
             f"({reach}x{reach} cells of {att.shape[0]}x{att.shape[1]})"
             + ("; red: boxes from the dataset CSV" if info and info.boxes else "")]
    if outside:
        lines.append(f"{outside} of the {n} draws fell on probability-0 cells (more draws than cells that may be "
                     "sampled): weight 0, not drawn")
    fig.text(0.5, (panel_bottom - 0.22) / fig_h, "\n".join(lines), ha="center", va="top",
             fontsize=7.5, linespacing=1.4)

    more = f"the {len(shown)} of most {what}" if len(shown) < len(sites) else f"all {len(shown)}"
    key = ("a: attention probability" if weights is None else
           "wg: estimator weight x learned gain, a: attention probability" if gains is not None else
           "count: what the draw adds to the class counts, a: attention probability" if shares is not None else
           "w: estimator weight, a: attention probability")
    strip_top = panel_bottom - caption_h
    fig.text(0.5, (strip_top - 0.05) / fig_h, f"the sampled patches at full resolution, {more}, heaviest first  "
             f"({key})", ha="center", va="top", fontsize=8)
    strip_left = (fig_w - (STRIP_PER_ROW * cell + (STRIP_PER_ROW - 1) * gap)) / 2
    for i, site in enumerate(shown):
        r, c = divmod(i, STRIP_PER_ROW)
        bottom = strip_top - strip_head_h - r * row_h - 0.2 - cell * ph / pw
        pax = fig.add_axes(((strip_left + c * (cell + gap)) / fig_w, bottom / fig_h, cell / fig_w,
                            cell * ph / pw / fig_h))
        img, pcmap = _gray(patches[site.index])
        pax.imshow(img, cmap=pcmap, vmin=0, vmax=1, interpolation="nearest", aspect="auto")
        pax.set_xticks([])
        pax.set_yticks([])
        for spine in pax.spines.values():
            spine.set_edgecolor(colours[i])
            spine.set_linewidth(2.0)
        times = f" (x{len(site.draws)})" if len(site.draws) > 1 else ""
        pax.set_title(f"#{i + 1}  draw {site.draws[0]}{times}", fontsize=6.5, pad=2)
        w = "wg" if gains is not None else "count" if shares is not None else "w"
        under = (f"{w} {_short_prob(site.weight)}\na {_short_prob(site.attention)}" if weights is not None
                 else f"a {_short_prob(site.attention)}")
        pax.set_xlabel(under, fontsize=6.5, labelpad=1.5, linespacing=1.2)

    label = info.label if info else None
    truth = "" if label is None else (f"  |  label {label} " + ("(correct)" if label == prediction else "(wrong)"))
    fig.text(0.5, 1 - 0.1 / fig_h, f"predicted {prediction}  (p = {probability:.2f}){truth}", fontsize=14,
             fontweight="bold", ha="center", va="top")
    estimator = getattr(net, "active_estimator", None)  # Deep MIL: no sampling, no estimator
    sampling = f"{n} patches, seed {seed}" + (", with replacement" if getattr(net, "replace", False) else
                                              f", {estimator} estimator" if weights is not None and estimator
                                              else "")
    fig.text(0.5, 1 - 0.45 / fig_h,
             f"{Path(image).name} {W}x{H}  ·  {predictor.path.name}  ·  {sampling}  ·  attention entropy "
             f"{float(result.entropy[0]):.2f} nats (uniform {math.log(att.size):.2f})",
             ha="center", va="top", fontsize=7.5, color="0.3")
    size = _save(fig, Path(out))
    return RenderSummary(Path(out), size, prediction=prediction, probability=probability, label=label,
                         n_boxes=len(info.boxes) if info else 0, n_sites=len(sites),
                         strip=tuple((s.row, s.col) for s in shown), reading=opened.reading)


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
    """The attention of one image after successive epochs, side by side (thesis Figure
    3.3), from ``RUN_DIR/epochs/epoch_NNN.pt``.

    All panels share ONE log colour scale (with the uniform level marked), so a panel
    that looks brighter really is more peaked: per-panel normalisation would make the
    uniform map of epoch 1 look as confident as a trained one. The low-res view lies
    underneath, and the recorded digits (when a dataset CSV knows the image) are boxed in
    red on every panel and labelled on the first. Attention does not depend on the
    sampling seed, so there is none. ``epochs``: see :func:`select_epochs`."""
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    files = epoch_checkpoints(run_dir)
    chosen = select_epochs(epochs, list(files), max_panels)
    metrics = _metrics(run_dir)
    info = find_image_info(image, data)

    maps, opened, net = [], None, None
    for epoch in chosen:
        predictor = load_predictor(files[epoch], device)
        net = predictor.model
        if opened is None:  # every epoch of a run shares channels, scale and patch size
            opened = predictor.opener(**(reading or {}))(image, channels=predictor.channels, scale=net.scale,
                                                         patch_size=net.patch_size)
        result = sample_attention(predictor, opened, n_patches=1, seed=0, return_patches=False)
        maps.append(result.attention[0].cpu().double().numpy())
    assert opened is not None and net is not None
    H, W = opened.source.size
    n_cells = maps[0].size
    norm = _norm(max(m.max() for m in maps), n_cells)
    img_extent, att_extent = _extents(net, opened)
    background, cmap = _gray(opened.low)

    n = len(chosen)
    rows = 1 if n <= 5 else 2
    cols = math.ceil(n / rows)
    # Sizes in inches: panels, gaps for their titles, a fixed strip on the right for the colour bar.
    panel_w = 3.2
    panel_h = min(max(panel_w * H / W, 1.5), 6.0)
    gap_w, title_h, head_h, foot_h, bar_w = 0.25, 0.5, 0.7, 0.15, 1.9
    fig_w = 0.25 + cols * panel_w + (cols - 1) * gap_w + bar_w
    fig_h = head_h + rows * (title_h + panel_h) + foot_h
    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    axes = []
    for i in range(n):
        r, c = divmod(i, cols)
        left = 0.25 + c * (panel_w + gap_w)
        bottom = fig_h - head_h - (r + 1) * (title_h + panel_h) + 0.0
        axes.append(fig.add_axes((left / fig_w, bottom / fig_h, panel_w / fig_w, panel_h / fig_h)))
    for i, (epoch, att, ax) in enumerate(zip(chosen, maps, axes, strict=True)):
        ax.imshow(background, cmap=cmap, vmin=0, vmax=1, extent=img_extent, interpolation="nearest", zorder=1)
        # Linear opacity here: on the shared scale the early, flat maps sit low and would vanish with the
        # single figure's quadratic ramp.
        _overlay(ax, att, norm, att_extent, alpha_low=0.1, alpha_high=0.95, power=1.0)
        if info:
            _digit_boxes(ax, info.boxes, labels=i == 0)
        _frame(ax, H, W)
        ax.set_xticks([])
        ax.set_yticks([])
        acc = metrics.get(epoch, {}).get("test_acc")
        entropy = float(-(att[att > 0] * np.log(att[att > 0])).sum())
        detail = f"max a={att.max():.2g} · H={entropy:.1f}" + (f" · test acc {acc:.0%}" if acc is not None else "")
        ax.set_title(f"epoch {epoch}\n{detail}", fontsize=9)
    bar_top = fig_h - head_h - title_h
    bar_h = min(rows * (title_h + panel_h) - title_h, 5.0)
    cax = fig.add_axes(((fig_w - bar_w + 0.3) / fig_w, (bar_top - bar_h) / fig_h, 0.18 / fig_w, bar_h / fig_h))
    _colorbar(fig, norm, axes, n_cells, cax=cax)
    thinned = "" if len(chosen) == len(files) or epochs not in (None, "all") else f" ({len(files)} saved; evenly " \
                                                                                 "spaced)"
    truth = f", label {info.label}" if info and info.label is not None else ""
    marks = "; red boxes: recorded in the dataset CSV" if info and info.boxes else ""
    fig.suptitle(f"Attention during training: {Path(image).name}{truth}", fontsize=13, fontweight="bold",
                 y=1 - 0.1 / fig.get_figheight(), va="top")
    fig.text(0.5, 1 - 0.45 / fig.get_figheight(),
             f"run {run_dir}, epochs {', '.join(map(str, chosen))}{thinned}; one shared log colour scale{marks}",
             ha="center", va="top", fontsize=8, color="0.3")
    size = _save(fig, Path(out))
    return RenderSummary(Path(out), size, label=info.label if info else None, epochs=tuple(chosen),
                         n_boxes=len(info.boxes) if info else 0)
