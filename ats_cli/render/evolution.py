"""The attention of one image after successive epochs, side by side (thesis Figure 3.3).

All panels share ONE log colour scale (with the uniform level marked), so a panel that
looks brighter really is more peaked: per-panel normalisation would make the uniform map
of epoch 1 look as confident as a trained one. The model's low-res view lies underneath,
in gray, and the recorded objects are boxed in red on every panel and labelled on the
first.

Under each later epoch a second panel shows what changed since the first one drawn: the
ratio of each cell's attention to its attention then, on a diverging log scale (red: more,
blue: less). On the shared scale alone the panels of a run looked alike: the attention
finds the bright objects within an epoch, and what training then changes is how it shares
itself among them (digits gaining on noise by factors of 2 to 8), which is a fraction of a
decade on a scale of three. Each title gives the epoch, the entropy H of the map (lower:
more peaked) and, when the dataset records the objects, the share of the attention that
lies on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ats_cli.render.draw import as_image, colorbar, digit_boxes, frame, log_norm, overlay, save
from ats_cli.render.records import DigitBox

__all__ = ["EvolutionFigure", "EpochPanel", "draw_evolution", "entropy", "on_objects"]


@dataclass(frozen=True)
class EpochPanel:
    """One epoch's attention map, and its test accuracy when the run recorded one."""

    epoch: int
    attention: np.ndarray  # [att_h, att_w]
    test_acc: float | None = None


@dataclass
class EvolutionFigure:
    """What the strip of epochs shows."""

    image_name: str
    size: tuple[int, int]  # (H, W) full-resolution pixels
    background: np.ndarray  # the low-res view the attention net saw, [C, h, w] in [0, 1]
    attention_extent: tuple[float, float, float, float]  # the maps' (left, right, bottom, top), full-res pixels
    panels: list[EpochPanel]
    run_name: str = ""
    thinned: str = ""  # how the epochs were chosen, when not all are drawn
    label: str | None = None
    boxes: Sequence[DigitBox] = field(default_factory=list)


CHANGE_CMAP = "RdBu_r"
MAX_FOLD = 4.0  # the change scale's ends: 4 times more or less attention than at the first epoch


def on_objects(att: np.ndarray, extent: tuple[float, float, float, float], boxes: Sequence[DigitBox]) -> float | None:
    """The share of ``att`` (cells spread over ``extent``, full-res pixels) in the cells whose
    centre lies in one of ``boxes``; None without boxes."""
    if not boxes:
        return None
    left, right, bottom, top = extent
    h, w = att.shape
    ys = top + (np.arange(h) + 0.5) * (bottom - top) / h
    xs = left + (np.arange(w) + 0.5) * (right - left) / w
    inside = np.zeros((h, w), dtype=bool)
    for b in boxes:
        rows = (ys >= b.row) & (ys < b.row + b.h)
        cols = (xs >= b.col) & (xs < b.col + b.w)
        inside |= rows[:, None] & cols[None, :]
    return float(att[inside].sum() / max(att.sum(), 1e-30))


def entropy(att: np.ndarray) -> float:
    """The entropy of a map in nats: log(cells) when uniform, 0 when on one cell."""
    p = att[att > 0]
    return float(-(p * np.log(p)).sum())


def _change(ax, att: np.ndarray, first: np.ndarray, norm, extent) -> None:
    """``att / first`` per cell on a diverging log scale, opaque where either map holds
    attention on the shared scale (where both are below its floor, the ratio of two
    negligible values is left out)."""
    from matplotlib import colormaps

    floor = norm.vmin
    fold = np.log2(np.maximum(att, floor) / np.maximum(first, floor))
    t = np.clip(fold / math.log2(MAX_FOLD), -1, 1) * 0.5 + 0.5
    rgba = colormaps[CHANGE_CMAP](t)
    weight = np.asarray(norm(np.clip(np.maximum(att, first), floor, None)), dtype=float)
    rgba[..., 3] = 0.95 * weight
    ax.imshow(rgba, extent=extent, interpolation="nearest", zorder=2)


def _change_bar(fig, cax) -> None:
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    top = math.log2(MAX_FOLD)
    bar = fig.colorbar(ScalarMappable(norm=Normalize(-top, top), cmap=colormaps[CHANGE_CMAP]), cax=cax)
    ticks = list(range(-int(top), int(top) + 1))
    bar.set_ticks(ticks, labels=[f"÷{2 ** -k:g}" if k < 0 else ("same" if k == 0 else f"×{2 ** k:g}") for k in ticks])
    bar.set_label("attention per cell\nvs the first epoch drawn", fontsize=9)
    bar.ax.tick_params(labelsize=8)


def draw_evolution(figure: EvolutionFigure, out: str | Path, *, dpi: int = 110) -> tuple[int, int]:
    """The panels in one or two rows on the shared scale, each later one above its change
    since the first; returns the figure's (width, height) in pixels. Written to ``out`` in
    the format of its suffix."""
    from matplotlib.figure import Figure

    f = figure
    H, W = f.size
    maps = [p.attention for p in f.panels]
    n_cells = maps[0].size
    norm = log_norm(max(m.max() for m in maps), n_cells)
    background, cmap = as_image(f.background)
    first = f.panels[0]

    n = len(f.panels)
    rows = 1 if n <= 5 else 2
    cols = math.ceil(n / rows)
    changes = n > 1
    # Sizes in inches: panels, gaps for their titles, a fixed strip on the right for the colour bars.
    panel_w = 3.2
    panel_h = min(max(panel_w * H / W, 1.5), 6.0)
    gap_w, title_h, head_h, foot_h, bar_w = 0.25, 0.5, 0.7, 0.15, 1.9
    band_h = (title_h + panel_h) * (2 if changes else 1)  # an epoch's panel and the change under it
    fig_w = 0.25 + cols * panel_w + (cols - 1) * gap_w + bar_w
    fig_h = head_h + rows * band_h + foot_h
    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)

    def place(i: int, lower: bool):
        r, c = divmod(i, cols)
        left = 0.25 + c * (panel_w + gap_w)
        bottom = fig_h - head_h - r * band_h - (title_h + panel_h) * (2 if lower else 1)
        ax = fig.add_axes((left / fig_w, bottom / fig_h, panel_w / fig_w, panel_h / fig_h))
        ax.imshow(background, cmap=cmap, vmin=0, vmax=1, extent=(0, W, H, 0), interpolation="nearest", zorder=1)
        return ax

    axes = []
    for i, panel in enumerate(f.panels):
        att = panel.attention
        ax = place(i, lower=False)
        axes.append(ax)
        # Linear opacity here: on the shared scale the early, flat maps sit low and would vanish with the
        # single figure's quadratic ramp.
        overlay(ax, att, norm, f.attention_extent, alpha_low=0.1, alpha_high=0.95, power=1.0)
        digit_boxes(ax, f.boxes, labels=i == 0)
        frame(ax, H, W)
        ax.set_xticks([])
        ax.set_yticks([])
        share = on_objects(att, f.attention_extent, f.boxes)
        detail = f"H={entropy(att):.2f}" + (f" · on objects {share:.0%}" if share is not None else "") \
            + (f" · test acc {panel.test_acc:.0%}" if panel.test_acc is not None else "")
        ax.set_title(f"epoch {panel.epoch}\n{detail}", fontsize=9)
        if changes and i > 0:
            low = place(i, lower=True)
            _change(low, att, first.attention, norm, f.attention_extent)
            digit_boxes(low, f.boxes, labels=False)
            frame(low, H, W)
            low.set_xticks([])
            low.set_yticks([])
            fold = np.log2(np.maximum(att, norm.vmin) / np.maximum(first.attention, norm.vmin))
            low.set_title(f"epoch {panel.epoch} vs {first.epoch}: cells up to ×{2 ** float(fold.max()):.2g}, "
                          f"down to ÷{2 ** -float(fold.min()):.2g}", fontsize=9)
    if changes:  # where the first epoch's change would be: what the row below shows
        fig.text((0.25 + panel_w / 2) / fig_w, (fig_h - head_h - (title_h + panel_h) * 1.5) / fig_h,
                 f"below each later epoch:\nits attention per cell\ndivided by epoch {first.epoch}'s\n"
                 "(red: more, blue: less;\nfaint: little attention in both)", ha="center", va="center", fontsize=9,
                 color="0.25")
    bar_top = fig_h - head_h - title_h
    bar_h = min(panel_h, 5.0)
    cax = fig.add_axes(((fig_w - bar_w + 0.3) / fig_w, (bar_top - bar_h) / fig_h, 0.18 / fig_w, bar_h / fig_h))
    colorbar(fig, norm, axes, n_cells, cax=cax)
    if changes:
        low_top = bar_top - title_h - panel_h
        cax2 = fig.add_axes(((fig_w - bar_w + 0.3) / fig_w, (low_top - bar_h) / fig_h, 0.18 / fig_w, bar_h / fig_h))
        _change_bar(fig, cax2)
    truth = f", label {f.label}" if f.label is not None else ""
    marks = "; red boxes: recorded in the dataset CSV" if f.boxes else ""
    fig.suptitle(f"Attention during training: {f.image_name}{truth}", fontsize=13, fontweight="bold",
                 y=1 - 0.1 / fig.get_figheight(), va="top")
    fig.text(0.5, 1 - 0.45 / fig.get_figheight(),
             f"run {f.run_name}, epochs {', '.join(str(p.epoch) for p in f.panels)}{f.thinned}; one shared log "
             f"colour scale{marks}", ha="center", va="top", fontsize=8, color="0.3")
    return save(fig, out)
