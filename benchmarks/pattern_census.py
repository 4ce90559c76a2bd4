"""Which Megapixel MNIST splits hold ``reference`` noise patterns that look like a 1.

Each split of ``ats make-dataset megapixel-mnist`` draws its own 50 noise patterns
(``ats_cli.data.megapixel_mnist.split_patterns``): thin "/", "V" and "X" shapes anchored at a
top corner. A pattern whose two lines nearly coincide is one thin line, and when that line is
near vertical it is drawn as a 1 is. Image labels can only teach a model that such a line is
noise if the training split's patterns hold one. This script reads each pattern's pixels (not
the generator's internals) and lists the split's lone lines and their angle from the vertical.

A pattern counts as one line when a single straight segment from one top corner passes within
``--tolerance`` pixels of every lit pixel. Printed per split: the angles, and how many are
within ``--vertical`` degrees of the vertical.

    python benchmarks/pattern_census.py       # train splits of seeds 0 and 2, test of 0, 11, 13, 17, 19, 23
    python benchmarks/pattern_census.py --splits train:2 test:13

benchmarks/accuracy.md ("Noise read as a 1") holds what it printed.
"""

from __future__ import annotations

import argparse

import numpy as np

from ats_cli.data.megapixel_mnist import split_patterns

DEFAULT_SPLITS = ("train:0", "train:2", "test:0", "test:11", "test:13", "test:17", "test:19", "test:23")


def lone_line_angle(pattern: np.ndarray, tolerance: float) -> float | None:
    """The angle from the vertical (degrees) of the one line ``pattern`` draws, or None if it draws two.

    Lines start at a top corner (row 0, column 0 or the last column). For each corner, the best
    angle is the one that leaves the largest distance of a lit pixel from the line smallest; a
    pattern is one line when that distance is at most ``tolerance`` for one corner.
    """
    rows, cols = np.nonzero(pattern)
    if rows.size == 0:
        return None
    best = None
    angles = np.radians(np.arange(0.0, 90.0, 0.25))
    for corner_col, sign in ((0.0, 1.0), (pattern.shape[1] - 1.0, -1.0)):
        x, y = rows.astype(float), sign * (cols - corner_col)
        # distance of each pixel (x down, y across) from the line through the corner at each angle
        dist = np.abs(x[None, :] * np.sin(angles)[:, None] - y[None, :] * np.cos(angles)[:, None])
        worst = dist.max(axis=1)
        i = int(worst.argmin())
        if worst[i] <= tolerance and (best is None or worst[i] < best[0]):
            best = (worst[i], float(np.degrees(angles[i])))
    return None if best is None else best[1]


def split_seed(text: str) -> tuple[str, int]:
    """``SPLIT:SEED`` (e.g. ``test:13``) as (split, seed); argparse reports a bad one in one line."""
    split, _, seed = text.partition(":")
    if split not in ("train", "test") or not seed.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected train:SEED or test:SEED, e.g. test:13")
    return split, int(seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--splits", nargs="+", type=split_seed, default=[split_seed(s) for s in DEFAULT_SPLITS],
                        help="SPLIT:SEED, e.g. train:0 test:13")
    parser.add_argument("--tolerance", type=float, default=1.5, help="pixels a lit pixel may lie off the line")
    parser.add_argument("--vertical", type=float, default=25.0, help="degrees from vertical that read as a 1")
    args = parser.parse_args()
    print(f"| split | seed | lone lines (degrees from vertical) | within {args.vertical:g} degrees |")
    print("|---|---:|---|---:|")
    for split, seed in args.splits:
        angles = [lone_line_angle(p, args.tolerance) for p in split_patterns(seed, split)]
        lone = sorted(round(a) for a in angles if a is not None)
        steep = sum(a <= args.vertical for a in lone)
        print(f"| {split} | {seed} | {', '.join(map(str, lone)) or 'none'} | {steep} |")


if __name__ == "__main__":
    main()
