"""Pictures of what the model looks at: one image's attention and sampled patches, and
the attention of successive training epochs (thesis Figure 3.3).

Conventions shared by both figures, chosen so that they read at a glance:

* everything is drawn in **full-resolution pixel coordinates**: the low-res view and the
  attention map are stretched over the image's extent (the attention map over the
  low-res view less the attention net's margin), so patch offsets and digit boxes are
  drawn as they are, and the axes tell where to look in the original file;
* the image is the model's **low-res view** (what the attention network sees), in gray;
* attention is coloured on a **log scale** spanning three decades below its maximum, with
  an opacity ramp (low attention almost transparent): a trained attention map is very
  peaked, and on a linear scale everything but the top cell would be black, while the
  log scale also shows where the second-best candidates are. A tick on the colour bar
  marks the uniform level 1/N, so "more or less than uniform" can be read off directly.
* figures are drawn with matplotlib's object API (no pyplot state; safe in a library) and
  written atomically.
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
from ats_cli.data.dataset import KNOWN_SPLITS, atomic_write_bytes
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
PATCHES_PER_ROW = 10
MAX_PATCHES_SHOWN = 40  # the strip under the image; boxes are drawn for all
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
    [] if absent or malformed."""
    if not text:
        return []
    try:
        return [DigitBox(str(c), int(r), int(k), int(h), int(w)) for c, r, k, h, w in json.loads(text)]
    except (ValueError, TypeError):
        return []


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


def _attention(predictor: Predictor, opened: OpenedImage, *, n_patches: int | None, seed: int,
               return_patches: bool):
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
    """0.13 -> '0.13', 0.00028 -> '2.8e-4': fits under a patch 10 to a row."""
    if p >= 0.01:
        return f"{p:.2f}"
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
    """One figure for one image: the low-res view with the attention overlaid (log scale,
    colour bar), cyan numbered boxes on the sampled patches at their full-res positions,
    red boxes on the recorded digits when a dataset CSV knows the image, the patches
    themselves in a strip underneath (labelled with their attention probability) and a
    title with the predicted class and its probability *for this one sampling* (the
    patches shown are the ones the prediction used). Raises CheckpointError (model) or
    ImageReadError (image), both naming the file. ``reading``: reader/level/mpp/tissue
    overrides, as for ``ats predict`` (default: the model's training settings)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    predictor = model if isinstance(model, Predictor) else load_predictor(model, device)
    net = predictor.model
    opened = predictor.opener(**(reading or {}))(image, channels=predictor.channels, scale=net.scale,
                                                 patch_size=net.patch_size)
    result = _attention(predictor, opened, n_patches=n_patches, seed=seed, return_patches=True)
    probs = torch.softmax(result.logits[0].float(), 0).cpu()
    k = int(probs.argmax())
    prediction, probability = predictor.classes[k], float(probs[k])
    att = result.attention[0].cpu().double().numpy()
    offsets = result.offsets[0].cpu().tolist()
    sampled = result.sampled_probs[0].cpu().tolist()
    patches = result.patches[0].cpu()
    info = find_image_info(image, data)
    H, W = opened.source.size
    ph, pw = net.patch_size
    n = len(offsets)

    # Layout: main panel (its height follows the image's aspect), then rows of patches.
    width_in = 8.0
    main_h = min(max(width_in * 0.86 * H / W, 3.0), 10.0)
    shown = min(n, MAX_PATCHES_SHOWN)
    strip_rows = math.ceil(shown / PATCHES_PER_ROW)
    strip_h = strip_rows * (width_in / PATCHES_PER_ROW) * (ph / pw) * 1.25
    fig = Figure(figsize=(width_in, main_h + strip_h + 0.9), dpi=dpi)
    grid = fig.add_gridspec(2, 1, height_ratios=[main_h, strip_h], hspace=0.14, top=1 - 0.75 / fig.get_figheight(),
                            bottom=0.02, left=0.07, right=0.88)
    ax = fig.add_subplot(grid[0])
    img_extent, att_extent = _extents(net, opened)
    background, cmap = _gray(opened.low)
    ax.imshow(background, cmap=cmap, vmin=0, vmax=1, extent=img_extent, interpolation="nearest", zorder=1)
    norm = _norm(att.max(), att.size)
    _overlay(ax, att, norm, att_extent)
    if info:
        _digit_boxes(ax, info.boxes, labels=True)
    for i, (r, c) in enumerate(offsets):
        ax.add_patch(Rectangle((c, r), pw, ph, fill=False, ec=BOX_COLOUR, lw=1.4, zorder=6))
        at_c, at_r = min(max(c, 0), W * 0.97) + 2, min(max(r, 0), H * 0.96) + 2  # in view for edge patches
        ax.text(at_c, at_r, str(i + 1), color=BOX_COLOUR, fontsize=7, fontweight="bold", ha="left", va="top",
                zorder=7, clip_on=True)
    _frame(ax, H, W)
    _colorbar(fig, norm, ax, att.size, fraction=0.046, pad=0.02)
    legend = f"cyan: the {n} sampled {pw}x{ph} patches, numbered in draw order"
    if info and info.boxes:
        legend += "; red: boxes from the dataset CSV"
    ax.set_xlabel(f"{legend}\nbelow: the patches at full resolution, titled 'draw number: attention "
                  "probability'   [axes: full-resolution pixels]"
                  + (f" (the first {shown} of {n})" if shown < n else ""), fontsize=8)

    sub = grid[1].subgridspec(strip_rows, PATCHES_PER_ROW, wspace=0.08, hspace=0.35)
    for i in range(shown):
        pax = fig.add_subplot(sub[i // PATCHES_PER_ROW, i % PATCHES_PER_ROW])
        img, pcmap = _gray(patches[i])
        pax.imshow(img, cmap=pcmap, vmin=0, vmax=1, interpolation="nearest")
        pax.set_xticks([])
        pax.set_yticks([])
        for spine in pax.spines.values():
            spine.set_edgecolor(BOX_COLOUR)
            spine.set_linewidth(1.5)
        pax.set_title(f"{i + 1}: {_short_prob(sampled[i])}", fontsize=7, pad=2)

    label = info.label if info else None
    truth = "" if label is None else (f"  |  label {label} " + ("(correct)" if label == prediction else "(wrong)"))
    fig.suptitle(f"predicted {prediction}  (p = {probability:.2f}){truth}", fontsize=14, fontweight="bold",
                 y=1 - 0.12 / fig.get_figheight(), va="top")
    fig.text(0.5, 1 - 0.47 / fig.get_figheight(),
             f"{Path(image).name}  {W}x{H}  ·  model {predictor.path.name}  ·  {n} patches, seed {seed}  ·  "
             f"attention entropy {float(result.entropy[0]):.2f} nats (uniform {math.log(att.size):.2f})",
             ha="center", va="top", fontsize=8, color="0.3")
    size = _save(fig, Path(out))
    return RenderSummary(Path(out), size, prediction=prediction, probability=probability, label=label,
                         n_boxes=len(info.boxes) if info else 0)


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
        result = _attention(predictor, opened, n_patches=1, seed=0, return_patches=False)
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
