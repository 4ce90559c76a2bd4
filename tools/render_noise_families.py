#!/usr/bin/env python
"""Draw docs/img/noise-families.png: a few 28x28 patches of every Megapixel MNIST noise
family next to real digits, and a crop of a paper-spec image with the reference noise.
Uses the bundled digits so it runs offline; deterministic.

    PYTHONPATH=. python tools/render_noise_families.py [docs/img/noise-families.png]
"""

from __future__ import annotations

import os
import sys

import numpy as np
from PIL import Image, ImageDraw

from ats_cli.data.megapixel_mnist import make_config, render_image, split_patterns
from ats_cli.data.mnist import load_bundled_digits
from ats_cli.data.noise import FAMILIES, PATCH, NoiseContext
from ats_cli.io import atomic_path


def montage(path: str, examples: int = 5, zoom: int = 3) -> None:
    """Draw docs/img/noise-families.png: ``examples`` patches per family (upscaled) and a
    crop of a paper-spec test image with the reference noise (bundled digits, seed 0)."""
    digits = load_bundled_digits()
    context = NoiseContext(patterns=split_patterns(0, "test"), digits=digits.x_test)
    cell, label_w, pad = PATCH[0] * zoom, 90, 6
    firsts = [int(np.flatnonzero(digits.y_test == d)[0]) for d in (2, 3, 5, 7, 8, 9)[:examples]]
    rows = [("digits", [digits.x_test[i] for i in firsts])]  # for scale
    for name, family in FAMILIES.items():
        rng = np.random.default_rng(2)
        rows.append((name, [family.render(rng, context) for _ in range(examples)]))
    # the crop: among the first test images, the window around a digit holding the most
    # digits, then the most noise patches
    config = make_config("paper")
    crop, best = 300, ((-1, -1), None)
    for index in range(20):
        image, layout = render_image(config, digits, "test", index)
        for r, c in layout.digit_boxes.tolist():
            r0 = min(max(0, r + 14 - crop // 2), config.height - crop)
            c0 = min(max(0, c + 14 - crop // 2), config.width - crop)

            def inside(boxes: np.ndarray) -> int:
                return int(np.sum((boxes[:, 0] >= r0) & (boxes[:, 0] <= r0 + crop - 28)  # noqa: B023
                                  & (boxes[:, 1] >= c0) & (boxes[:, 1] <= c0 + crop - 28)))  # noqa: B023

            score = (inside(layout.digit_boxes), inside(layout.noise_boxes))
            if score > best[0]:
                best = (score, image[r0 : r0 + crop, c0 : c0 + crop])
    view = Image.fromarray(best[1]).resize((crop * 2, crop * 2), Image.NEAREST)

    grid_w = label_w + examples * (cell + pad)
    title_h = 22
    height = max(title_h + len(rows) * (cell + pad), title_h + view.height)
    out = Image.new("L", (grid_w + 2 * pad + view.width, height), 40)
    draw = ImageDraw.Draw(out)
    draw.text((pad, 4), "28x28 patches, upscaled x3", fill=230)
    draw.text((grid_w + 2 * pad, 4), "paper-spec image, reference noise: 300x300 crop, x2", fill=230)
    for i, (name, patches) in enumerate(rows):
        y = title_h + i * (cell + pad)
        draw.text((pad, y + cell // 2 - 6), name, fill=255)
        for j, patch in enumerate(patches):
            tile = Image.fromarray(patch).resize((cell, cell), Image.NEAREST)
            out.paste(tile, (label_w + j * (cell + pad), y))
    out.paste(view, (grid_w + 2 * pad, title_h))
    with atomic_path(path) as tmp:
        # the temporary name hides the suffix PIL picks the format from
        out.save(tmp, format=Image.registered_extensions().get(os.path.splitext(path)[1].lower(), "PNG"), optimize=True)


if __name__ == "__main__":
    montage(sys.argv[1] if len(sys.argv) > 1 else "docs/img/noise-families.png")
