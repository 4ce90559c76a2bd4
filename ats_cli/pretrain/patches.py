"""Labelled patches cut from one image and its regions: stage 1's training examples.

A patch holding one whole object is labelled with its class, a patch that holds no part of
any object -- noise, or background -- with an extra class, "none" (index ``len(classes)``);
patches where an object is cut in half or two objects meet are left out (:func:`patch_label`).
Where they are cut: one around each object (placed at random so that it is whole inside),
LIT_PATCHES centred on random lit pixels (on a black canvas mostly clutter: the negatives
that matter) and RANDOM_PATCHES anywhere (mostly background).

"None" has to hold for clutter the training never showed, and a net that learned it only
from the training's clutter reads an unseen shape that happens to look like a small object
(two stacked bubbles: an 8) as that object. So each image also gives ``shrunken`` "none"
patches holding one or two of its own objects shrunk to SMALL_SCALE of their size, half of
the pairs set side by side (:func:`shrunken_digits`): in Megapixel MNIST every digit comes
at MNIST's size, so a digit-like shape at half that size, or two of them together, is
noise, whatever drew it -- a fact about the task, not about any noise family.
"""

from __future__ import annotations

import numpy as np

NONE = "none"  # the extra patch class: no object in the patch
WHOLE = 0.75  # a digit counts as in the patch when this much of its box is inside ...
TOUCH = 0.10  # ... and as absent when at most this much is: in between, the patch is left out
LIT_PATCHES = 8  # patches per image centred on random lit pixels (mostly noise: 50 noise boxes, 5 digits)
RANDOM_PATCHES = 2  # and anywhere (mostly black)
SMALL_PATCHES = 3  # "none" patches holding shrunken digits of the image (see shrunken_digits)
SMALL_SCALE = (0.3, 0.6)  # their size relative to the digits': a digit at half size is not a digit here
SMALL_ADJACENT = 0.5  # chance that a second small digit is set right beside the first (see shrunken_digits)
SMALL_GAP = (0.75, 1.1)  # then the distance of their centres over the sum of their ink radii (< 1: they touch)
BRIGHT = 127  # an image whose median grey is above this has a bright background (lit_pixels) ...
FOREGROUND = 220  # ... and its foreground is darker than this (glass is about 240)


def patch_label(top: int, left: int, size: int, boxes: list[list[int]], none: int = 10) -> int | None:
    """The class index wholly inside the patch, ``none`` (the index of the none class: 10 on
    MNIST) when no region touches it, None when ambiguous."""
    from ats_cli.data.megapixel_mnist import box_fractions

    frac = box_fractions([top, left], [b[1:] for b in boxes], (size, size))[0]
    inside = {int(b[0]) for b, f in zip(boxes, frac, strict=True) if f >= WHOLE}
    touching = int((frac > TOUCH).sum())
    if touching == 0:
        return none
    if len(inside) == 1 and touching == 1:
        return inside.pop()
    return None


def cut_patches(image: np.ndarray, boxes: list[list[int]], size: int, seed: int,
                shrunken: int = SMALL_PATCHES, none: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Labelled patches [n, size, size] (uint8) and labels [n] from one image [H, W] (uint8),
    or [n, C, size, size] from an image [C, H, W]: one per region (placed at random so that
    it is whole inside), LIT_PATCHES centred on lit pixels (:func:`lit_pixels`) and
    RANDOM_PATCHES anywhere, each labelled by :func:`patch_label` (ambiguous ones dropped),
    then ``shrunken`` "none" patches made by :func:`shrunken_digits` (one channel only)."""
    height, width = image.shape[-2:]
    rng = np.random.default_rng(seed)
    corners = []
    for _, r, col, h, w in boxes:
        corners.append((r - rng.integers(0, max(1, size - h + 1)), col - rng.integers(0, max(1, size - w + 1))))
    lit = lit_pixels(image)
    for i in rng.choice(lit, size=min(LIT_PATCHES, lit.size), replace=False) if lit.size else []:
        corners.append((i // width - size // 2, i % width - size // 2))
    for _ in range(RANDOM_PATCHES):
        corners.append((rng.integers(0, height - size + 1), rng.integers(0, width - size + 1)))
    patches, labels = [], []
    for top, left in corners:
        top, left = int(np.clip(top, 0, height - size)), int(np.clip(left, 0, width - size))
        label = patch_label(top, left, size, boxes, none)
        if label is not None:
            patches.append(image[..., top : top + size, left : left + size])
            labels.append(label)
    for _ in range(shrunken if boxes else 0):  # a base may be an earlier shrunken patch: up to 4 small digits
        nones = [p for p, y in zip(patches, labels, strict=True) if y == none]
        base = nones[int(rng.integers(len(nones)))] if nones else np.zeros((size, size), np.uint8)
        patches.append(shrunken_digits(image, boxes, base, rng))
        labels.append(none)
    return (np.array(patches, dtype=np.uint8).reshape(-1, *image.shape[:-2], size, size),
            np.array(labels, dtype=np.int64))


def lit_pixels(image: np.ndarray) -> np.ndarray:
    """Flat indices of the pixels that hold something, of an image [H, W] or [C, H, W]:
    of one channel (Megapixel MNIST's black canvas) every pixel above 0; of several, on a
    bright background (slides on white glass: the channels' mean has its median above
    BRIGHT) those darker than FOREGROUND -- where the tissue, and the clutter that matters,
    is -- else every pixel above 0."""
    grey = image if image.ndim == 2 else image.mean(0)
    if image.ndim == 2 or np.median(grey) <= BRIGHT:
        return np.flatnonzero(grey > 0)
    return np.flatnonzero(grey < FOREGROUND)


def shrunken_digits(image: np.ndarray, boxes: list[list[int]], base: np.ndarray,
                    rng: np.random.Generator, count: int | None = None, adjacent: bool | None = None) -> np.ndarray:
    """``base`` (a "none" patch) with ``count`` (default: one or two) of the image's digits
    pasted in, each shrunk to SMALL_SCALE of its size: a negative labelled "none".

    Why: in Megapixel MNIST every digit is drawn at MNIST's own size, so a digit-like shape
    at half that size is noise, whatever made it. Without this the feature net learns
    "none" only from the noise families it is trained on, and an unseen family whose
    shapes happen to look like a small digit (two stacked circles, an 8) is read as that
    digit. A property of the task, not of any noise family: it teaches nothing about a
    particular held-out family's look.

    ``adjacent`` (default: with probability SMALL_ADJACENT): the second digit is set right
    beside the first, in a random direction, touching it or a pixel or two away (centres
    SMALL_GAP times the sum of their ink radii apart), instead of anywhere. Why: two small
    shapes side by side or stacked span a whole digit's height, and a net taught only with
    scattered small digits still read two small 0s stacked as an 8
    (benchmarks/accuracy.md#side-by-side-pairs-and-the-object-prior). Two small digits next
    to each other are two small digits, not one of the usual size: again a fact of the task,
    made from the image's own digits."""
    from PIL import Image

    out = base.copy()
    size = out.shape[0]
    n = int(rng.integers(1, 3)) if count is None else count
    beside = bool(rng.random() < SMALL_ADJACENT) if adjacent is None else adjacent
    previous = (0.0, 0.0, 0.0)  # (centre row, centre col, ink radius) of the last digit pasted
    for k in range(n):
        _, r, c, h, w = boxes[int(rng.integers(len(boxes)))]
        digit = image[r : r + h, c : c + w]
        s = rng.uniform(*SMALL_SCALE)
        sh, sw = max(1, round(h * s)), max(1, round(w * s))
        small = np.asarray(Image.fromarray(digit).resize((sw, sh), Image.Resampling.BILINEAR, reducing_gap=2.0))
        rows, cols = np.flatnonzero(small.any(1)), np.flatnonzero(small.any(0))
        if rows.size:  # the ink's centre and radius inside the small box
            ink = ((rows[0] + rows[-1]) / 2, (cols[0] + cols[-1]) / 2,
                   max(rows[-1] - rows[0], cols[-1] - cols[0]) / 2 + 0.5)
        else:
            ink = (sh / 2, sw / 2, 0.0)
        if k and beside:  # beside the digit pasted before (previous)
            angle = rng.uniform(0.0, 2 * np.pi)
            dist = (previous[2] + ink[2]) * rng.uniform(*SMALL_GAP)
            top = round(previous[0] + dist * np.sin(angle) - ink[0])
            left = round(previous[1] + dist * np.cos(angle) - ink[1])
            top, left = int(np.clip(top, 0, size - sh)), int(np.clip(left, 0, size - sw))
        else:
            top, left = int(rng.integers(0, size - sh + 1)), int(rng.integers(0, size - sw + 1))
        out[top : top + sh, left : left + sw] = np.maximum(out[top : top + sh, left : left + sw], small)
        previous = (top + ink[0], left + ink[1], ink[2])
    return out
