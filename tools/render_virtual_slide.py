"""Render docs/img/virtual-slide.png: one 100k x 100k virtual slide, its thumbnail, and a
nest next to a decoy at level 0 (they differ) and at downsample 16 (the same dot).

Usage: python tools/render_virtual_slide.py [OUT.png]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ats_cli.data.slides import open_image  # noqa: E402
from ats_cli.data.virtual_slides import VirtualSlideSpec, default_downsamples, write_spec  # noqa: E402

SIDE, CELL = 100_000, 192  # slide side; each panel's side in the figure


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "slide.vslide.json"
        write_spec(path, VirtualSlideSpec(width=SIDE, height=SIDE, seed=7, nests=2, decoys=6,
                                          downsamples=tuple(default_downsamples(SIDE, SIDE))))
        slide = open_image(path)
        nest = next(s for s in slide.slide.spots if s.nest)
        decoy = next(s for s in slide.slide.spots if not s.nest)
        panels = [("100k x 100k, thumbnail", slide.thumbnail(CELL))]
        for level, what in ((0, "level 0"), (4, "1/16")):
            d = slide.spec.downsamples[level]
            for name, s in (("nest", nest), ("decoy", decoy)):
                half = 48 // d if d > 1 else 48  # a 96-pixel window at level 0, 96 level-0 pixels at 1/16 too
                crop = slide.read_region(int(s.row // d) - half, int(s.col // d) - half, 2 * half, 2 * half, level)
                big = Image.fromarray(crop).resize((CELL, CELL), Image.NEAREST)
                panels.append((f"{name}, {what}", np.asarray(big)))
    fig = Image.new("RGB", (len(panels) * (CELL + 8) + 8, CELL + 30), "white")
    draw = ImageDraw.Draw(fig)
    for i, (title, img) in enumerate(panels):
        x = 8 + i * (CELL + 8)
        fig.paste(Image.fromarray(img), (x, 24))
        draw.text((x, 6), title, fill="black")
    fig.save(out, optimize=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "img" / "virtual-slide.png")
