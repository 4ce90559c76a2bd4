"""How dark a tumour nest is at each pyramid level of a synthetic slide, against the tissue
around it: the resolution a coarse view needs for an attention to see nests at all.

    python benchmarks/coarse_visibility.py DATA [--slides 20] [--split test]

DATA: an ``ats make-dataset synthetic-slides`` set (virtual slides or TIFFs). For every
target box of the first ``--slides`` tumour slides, and every level of the slide, a 25x25
window around the nest's centre: the nest's darkest pixel (the mean of the RGB channels in
its 3x3 centre) against the window's median, in units of the window's standard deviation
outside that centre. Prints one row per downsample (those where the window's rim lies
outside the nest): the median, the lowest and the highest contrast over the nests, and the
share of nests darker than every pixel of the window's rim (a nest an attention could pick
out of the tissue by darkness alone).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np

from ats_cli.data.slides import open_image

WINDOW = 12  # pixels each side of the nest's centre, at every level


def contrasts(data: Path, split: str, slides: int) -> dict[float, list[tuple[float, bool]]]:
    rows = [r for r in csv.DictReader(open(data / f"{split}.csv")) if json.loads(r["boxes"] or "[]")][:slides]
    out: dict[float, list[tuple[float, bool]]] = {}
    for row in rows:
        reader = open_image(data / row["path"])
        for _, top, left, h, w in json.loads(row["boxes"]):
            cy, cx = top + h / 2, left + w / 2
            for level, d in enumerate(reader.downsamples):
                if (WINDOW - 3) * d < max(h, w):  # the rim would fall inside the nest
                    continue
                y, x = int(cy / d), int(cx / d)
                win = reader.read_region(y - WINDOW, x - WINDOW, 2 * WINDOW + 1, 2 * WINDOW + 1, level)
                grey = win.astype(np.float64).mean(-1)
                centre = grey[WINDOW - 1:WINDOW + 2, WINDOW - 1:WINDOW + 2]
                rim = np.ones_like(grey, bool)
                rim[WINDOW - 3:WINDOW + 4, WINDOW - 3:WINDOW + 4] = False
                around = grey[rim]
                z = (np.median(around) - centre.min()) / max(around.std(), 1e-6)
                out.setdefault(float(d), []).append((float(z), bool(centre.min() < around.min())))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("--slides", type=int, default=20)
    ap.add_argument("--split", default="test")
    a = ap.parse_args()
    table = contrasts(a.data, a.split, a.slides)
    n = len(next(iter(table.values()), []))
    print(f"{n} nests in the first {a.slides} tumour slides of {a.data / a.split}.csv")
    print("| downsample | nest contrast, median (sd of the tissue) | lowest | highest | darker than its whole rim |")
    print("|---:|---:|---:|---:|---:|")
    for d in sorted(table):
        z = np.array([c for c, _ in table[d]])
        darkest = np.mean([b for _, b in table[d]])
        print(f"| 1/{d:g} | {np.median(z):.1f} | {z.min():.1f} | {z.max():.1f} | {100 * darkest:.0f}% |")


if __name__ == "__main__":
    main()
