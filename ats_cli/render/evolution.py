"""The attention of one image after successive epochs, side by side (thesis Figure 3.3).

All panels share ONE log colour scale (with the uniform level marked), so a panel that
looks brighter really is more peaked: per-panel normalisation would make the uniform map
of epoch 1 look as confident as a trained one. The model's low-res view lies underneath,
in gray, and the recorded objects are boxed in red on every panel and labelled on the
first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ats_cli.render.draw import as_image, colorbar, digit_boxes, frame, log_norm, overlay, save
from ats_cli.render.records import DigitBox

__all__ = ["EvolutionFigure", "EpochPanel", "draw_evolution"]


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


def draw_evolution(figure: EvolutionFigure, out: str | Path, *, dpi: int = 110) -> tuple[int, int]:
    """The panels in one or two rows on the shared scale; returns the figure's (width,
    height) in pixels. Written to ``out`` in the format of its suffix."""
    from matplotlib.figure import Figure

    f = figure
    H, W = f.size
    maps = [p.attention for p in f.panels]
    n_cells = maps[0].size
    norm = log_norm(max(m.max() for m in maps), n_cells)
    background, cmap = as_image(f.background)

    n = len(f.panels)
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
        bottom = fig_h - head_h - (r + 1) * (title_h + panel_h)
        axes.append(fig.add_axes((left / fig_w, bottom / fig_h, panel_w / fig_w, panel_h / fig_h)))
    for i, (panel, ax) in enumerate(zip(f.panels, axes, strict=True)):
        att = panel.attention
        ax.imshow(background, cmap=cmap, vmin=0, vmax=1, extent=(0, W, H, 0), interpolation="nearest", zorder=1)
        # Linear opacity here: on the shared scale the early, flat maps sit low and would vanish with the
        # single figure's quadratic ramp.
        overlay(ax, att, norm, f.attention_extent, alpha_low=0.1, alpha_high=0.95, power=1.0)
        digit_boxes(ax, f.boxes, labels=i == 0)
        frame(ax, H, W)
        ax.set_xticks([])
        ax.set_yticks([])
        entropy = float(-(att[att > 0] * np.log(att[att > 0])).sum())
        detail = f"max a={att.max():.2g} · H={entropy:.1f}" + (f" · test acc {panel.test_acc:.0%}"
                                                                if panel.test_acc is not None else "")
        ax.set_title(f"epoch {panel.epoch}\n{detail}", fontsize=9)
    bar_top = fig_h - head_h - title_h
    bar_h = min(rows * (title_h + panel_h) - title_h, 5.0)
    cax = fig.add_axes(((fig_w - bar_w + 0.3) / fig_w, (bar_top - bar_h) / fig_h, 0.18 / fig_w, bar_h / fig_h))
    colorbar(fig, norm, axes, n_cells, cax=cax)
    truth = f", label {f.label}" if f.label is not None else ""
    marks = "; red boxes: recorded in the dataset CSV" if f.boxes else ""
    fig.suptitle(f"Attention during training: {f.image_name}{truth}", fontsize=13, fontweight="bold",
                 y=1 - 0.1 / fig.get_figheight(), va="top")
    fig.text(0.5, 1 - 0.45 / fig.get_figheight(),
             f"run {f.run_name}, epochs {', '.join(str(p.epoch) for p in f.panels)}{f.thinned}; one shared log "
             f"colour scale{marks}", ha="center", va="top", fontsize=8, color="0.3")
    return save(fig, out)
