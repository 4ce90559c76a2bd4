#!/usr/bin/env python
"""Draw docs/img/megapixel-mnist-example.png: one paper-spec Megapixel MNIST image explained.

Panels: the 1500x1500 image with the recorded digit boxes (``digits`` column) and
classes drawn on it; a full-resolution zoom on a crowded region; the low-resolution view at the recommended
scale 0.12 (what the attention network sees: digits are ~3x3 blobs there); and
full-resolution crops of the five digits and of five noise scribbles (what the feature
network sees). Uses the bundled digits so it runs offline; deterministic.

    PYTHONPATH=. python tools/render_megapixel_example.py [-o docs/img/megapixel-mnist-example.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from PIL import Image  # noqa: E402

from ats_cli.data.megapixel_mnist import TASK_RECIPES, make_config, render_image  # noqa: E402
from ats_cli.data.mnist import load_bundled_digits  # noqa: E402
from ats_cli.recipes import load_recipe  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=Path("docs/img/megapixel-mnist-example.png"))
    parser.add_argument("--index", type=int, default=3, help="which test image (seed 0); 3 has typical-looking digits")
    args = parser.parse_args(argv)

    config = make_config("paper")
    digits = load_bundled_digits()
    image, layout = render_image(config, digits, "test", args.index)
    scale = load_recipe(TASK_RECIPES[config.task]).values["scale"]
    low = Image.fromarray(image).resize((round(config.width * scale), round(config.height * scale)), Image.BILINEAR)
    h, w = layout.box

    # A 320x320 window around the most crowded group of digits, shown at near full resolution.
    zoom = 320
    centres = layout.digit_boxes + np.array([h // 2, w // 2])
    best = max(range(len(centres)), key=lambda i: int((np.abs(centres - centres[i]) < zoom // 2 - w).all(1).sum()))
    r0 = int(np.clip(centres[best, 0] - zoom // 2, 0, config.height - zoom))
    c0 = int(np.clip(centres[best, 1] - zoom // 2, 0, config.width - zoom))

    fig = plt.figure(figsize=(18, 9.2), dpi=100, facecolor="white")
    grid = fig.add_gridspec(2, 10, height_ratios=[1, 0.3], hspace=0.12, wspace=0.1)
    ax_full = fig.add_subplot(grid[0, 0:4])
    ax_zoom = fig.add_subplot(grid[0, 4:7])
    ax_low = fig.add_subplot(grid[0, 7:10])
    ax_full.imshow(image, cmap="gray", vmin=0, vmax=255, interpolation="antialiased")
    ax_full.set_title(f"generated {config.width}x{config.height} image, label = {layout.target}\n"
                      "recorded digit boxes (CSV column 'digits'); noise is not boxed", fontsize=13)
    ax_zoom.imshow(image[r0 : r0 + zoom, c0 : c0 + zoom], cmap="gray", vmin=0, vmax=255, interpolation="nearest",
                   extent=(c0 - 0.5, c0 + zoom - 0.5, r0 + zoom - 0.5, r0 - 0.5))
    ax_zoom.set_title(f"zoom: {zoom}x{zoom} region (yellow square)\nfull resolution", fontsize=13)
    ax_full.add_patch(Rectangle((c0, r0), zoom, zoom, fill=False, lw=1.5, ec="yellow", ls="--"))
    for ax, pad, size in ((ax_full, 6, 15), (ax_zoom, 2, 16)):
        for (r, c), cls in zip(layout.digit_boxes, layout.digit_classes, strict=True):
            if ax is ax_zoom and not (r0 <= r and r + h <= r0 + zoom and c0 <= c and c + w <= c0 + zoom):
                continue
            colour = "#ff3030" if cls == layout.target else "#30a0ff"
            ax.add_patch(Rectangle((c - pad, r - pad), w + 2 * pad, h + 2 * pad, fill=False, lw=2.2, ec=colour))
            ax.text(c + w / 2, r - pad - 4, str(cls), color=colour, fontsize=size, weight="bold", ha="center",
                    va="bottom")
    ax_low.imshow(np.asarray(low), cmap="gray", vmin=0, vmax=255, interpolation="nearest")
    ax_low.set_title(f"what the attention network sees: scale {scale}\n({low.width}x{low.height}, a digit is ~3x3 px)",
                     fontsize=13)

    crops = [(image[r : r + h, c : c + w], f"digit {cls}") for (r, c), cls in zip(layout.digit_boxes,
                                                                                   layout.digit_classes, strict=True)]
    crops += [(image[r : r + h, c : c + w], "noise") for r, c in layout.noise_boxes[: 10 - len(crops)]]
    for k, (crop, title) in enumerate(crops):
        ax = fig.add_subplot(grid[1, k])
        ax.imshow(crop, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
        ax.set_title(title, fontsize=12, color="#c00000" if title == f"digit {layout.target}" else "black")
    for ax in fig.axes:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.text(0.5, 0.06, "bottom: full-resolution 28x28 crops of the 5 digits and of some of the 50 noise scribbles "
             f"(paper spec, seed 0, test image {args.index}, bundled digits); label = the majority digit",
             ha="center", fontsize=12)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=100, bbox_inches="tight", facecolor="white")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
