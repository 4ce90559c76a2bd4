"""Noise families of Megapixel MNIST: what fills the canvas besides the digits.

The benchmark is only as hard as its distractors: at the low-resolution scale a digit
and a noise patch are both a 3x3 smudge, so the attention network has to learn which
smudges are worth a full-resolution look. A model trained on one kind of noise may also
have learned that kind's quirks, so the generator offers several kinds ("families"), to
train on one and measure on the others (benchmarks/accuracy.md#noise-robustness).

Each family is one function ``render(rng, context) -> uint8 [28, 28]`` registered by name
in :data:`FAMILIES`; ``context`` carries the split-level material a family may need (the
split's reference patterns, the split's digit images). Families:

* ``reference`` -- the noise of the 2019 reference generator (idiap/attention-sampling,
  ``scripts/make_mnist.py``, the data of the ICML 2019 paper and of the thesis §3.4.2),
  reproduced recipe for recipe because a benchmark called "paper" must be the paper's.
  Once per split, 50 *patterns* are made from a split-level generator: pattern i is a
  1-pixel straight line from the box's top-left corner with slope ``tan(u * pi/2.5)``,
  ``u ~ U(0, 1)`` (56 points, rounded to pixels), united with the line of another
  pattern (a shuffled copy of the 50) that is mirrored left-right with probability 0.33,
  twice, independently (net ~0.44; the reference flips twice along the same axis, and
  we keep its distribution rather than "fix" it); each lit pixel gets its own gain
  ``U(0.8, 1)``. The gain is drawn with the pattern, not per occurrence, as in the
  reference: the 50 patterns are the split's whole noise vocabulary, repeated verbatim
  across its images. Each noise patch of an image is one of the 50, picked uniformly.
  Result: thin "/", "V" and "X" shapes anchored at a top corner.
* ``strokes`` -- version 1 of this generator's noise: two random segments (each at least
  10 px long) drawn as ~3 px anti-aliased strokes, intensity times ``U(0.8, 1)``. Kept
  on the exact same code path, so ``--noise strokes`` reproduces version-1 images.
* ``fragments`` -- two pieces (at most 13x13, rotated by a multiple of 90 degrees) cut from
  random digits of the split: real pen strokes that are not a digit. Under half a digit
  box per side, and rotated, so a patch never holds a readable whole digit (which would
  change the label); test images only cut test digits.
* ``blobs`` -- one to three filled ellipses with soft edges: bright mass without strokes.
* ``rings`` -- two to four small, nearly circular outlines (radius 2-4.5 px, at most half
  a digit's height, so that each reads as a bubble rather than a zero; two stacked can still
  pass for an 8).
* ``waves`` -- one or two thin wavy lines ("~~~"), each a sine of at least 1.8 periods at a
  random angle, 3-7 px from crest to trough: a smooth curve, which no other family draws,
  and flat enough never to read as an S or a 2. Kept out of every training recipe and
  every choice made on held-out data, so that one held-out figure stays clean.
* ``grid`` -- a patch of parallel 1-px lines at a random angle, crossed into a grid half of
  the time: texture instead of shape.
* ``glyphs`` -- one or two printed letters or symbols (side by side) in Pillow's built-in
  font (no font file to download); characters that resemble digits (O, I, l, f, t, S, Z, B, g, ...) are
  left out. The pixels depend on the FreeType that Pillow was built with, so this family is
  the one whose bytes may differ between machines.

**Mixing.** A comma-separated list (``--noise strokes,blobs,rings``) gives each noise
patch of an image a family drawn uniformly from the list (one draw per patch, from the
image's own generator), so every image mixes the families in random proportions.

**Overlap with digits.** Two placements exist. *Overlapping*: the patch's top-left corner
is uniform in ``[28, H-28)`` per axis, independent of the digits, and the whole 28x28 box
(black included) is pasted after the digits, so it can hide part or all of a digit --
exactly what the reference does. *Non-overlapping*: boxes are rejection-sampled so no
noise box meets a digit box or another such noise box (version 1's rule). The default is
per family: ``reference`` overlaps (the paper's data, with the paper's occasional hidden
digit), every other family does not, because their purpose is to measure whether a model
is fooled by unfamiliar distractors, and a patch that erases a digit would change the
true answer instead and blur that measurement. ``--noise-overlap`` /
``--no-noise-overlap`` force one rule for every family.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "FAMILIES",
    "NoiseContext",
    "NoiseFamily",
    "parse_families",
    "reference_patterns",
]

PATCH = (28, 28)  # every family renders a digit-sized patch

# The reference generator's constants (idiap/attention-sampling, scripts/make_mnist.py).
REFERENCE_PATTERNS = 50  # patterns per split
REFERENCE_MAX_ANGLE = np.pi / 2.5  # slope = tan(u * this), u ~ U(0, 1): up to 72 degrees
REFERENCE_POINTS = 56  # points along each line before rounding (2 per pixel)
REFERENCE_EXTENT = 27.49  # the line ends where a coordinate would round to 28
REFERENCE_FLIP_P = 0.33  # probability of each of the two mirrorings of the partner line
REFERENCE_GAIN = (0.8, 1.0)  # per lit pixel, drawn with the pattern
REFERENCE_MARGIN = 28  # overlapping noise: top-left corner uniform in [28, H - 28)

STROKES_GAIN = (0.8, 1.0)
STROKES_MIN_LENGTH = 10.0  # shorter segments look like dots, not strokes
STROKES_HALF_WIDTH = 1.0  # full intensity within 1 px of the segment, fading to 0 at 2 px

FRAGMENT_SIDE = (8, 13)  # piece height and width, inclusive: under half a digit box per side
FRAGMENT_MIN_INK = 20  # pixels above 127: a piece of stroke, not blank margin
RING_COUNT = (2, 4)  # inclusive
RING_RADIUS = (2.0, 4.5)  # at most 9 px across, half a digit's height: bubbles, not zeros
WAVE_COUNT = (1, 2)  # inclusive
WAVE_LENGTH = (16.0, 26.0)  # px along the wave's axis
WAVE_PERIOD = (5.0, 9.0)  # px: at least 16 / 9 = 1.8 periods, a wave rather than an S
WAVE_AMPLITUDE = (1.5, 3.5)  # px: 3-7 px crest to trough, far under a digit's height
GLYPH_CHARS = "ACEFHKMNPRUVWXYachkmnpruvwxy#%&@*+=?<>"  # no digit look-alikes
GLYPH_SIZE = (14, 22)  # font size in pixels, inclusive


@dataclass(frozen=True)
class NoiseContext:
    """Split-level material: the split's 50 reference patterns and its digit images."""

    patterns: np.ndarray | None = None  # [50, 28, 28] uint8
    digits: np.ndarray | None = None  # [n, 28, 28] uint8, the split's digit pool


@dataclass(frozen=True)
class NoiseFamily:
    """A registered family: its renderer, its default placement and what ``dataset.json`` records."""

    name: str
    render: Callable[[np.random.Generator, NoiseContext], np.ndarray]
    overlap: bool  # default placement: may the patch cover digits?
    looks: str  # one line for docs and --help
    params: Mapping[str, Any] = field(default_factory=dict)
    # n patches at once, for a family whose draw order must stay that of an older version
    render_many: Callable[[np.random.Generator, NoiseContext, int], list[np.ndarray]] | None = None

    def many(self, rng: np.random.Generator, context: NoiseContext, n: int) -> list[np.ndarray]:
        if self.render_many is not None:
            return self.render_many(rng, context, n)
        return [self.render(rng, context) for _ in range(n)]


# ---------------------------------------------------------------------------- reference


def reference_patterns(rng: np.random.Generator) -> np.ndarray:
    """The split's 50 noise patterns, uint8 [50, 28, 28], made as the reference generator makes them."""
    n, (h, w) = REFERENCE_PATTERNS, PATCH
    slopes = np.tan(rng.random(n) * REFERENCE_MAX_ANGLE)
    lines = np.zeros((n, h, w), dtype=bool)
    for i, m in enumerate(slopes):
        # x runs along the first (row) axis, y = m x along the second, as in the reference
        x = np.linspace(0.0, REFERENCE_EXTENT if m <= 1.0 else REFERENCE_EXTENT / m, REFERENCE_POINTS)
        lines[i, np.rint(x).astype(np.int64), np.rint(m * x).astype(np.int64)] = True
    partners = lines[rng.permutation(n)]
    for _ in range(2):
        flip = rng.random(n) < REFERENCE_FLIP_P
        partners[flip] = partners[flip][:, :, ::-1]
    gain = rng.uniform(*REFERENCE_GAIN, size=(n, h, w))
    return np.where(lines | partners, np.floor(255.0 * gain), 0.0).astype(np.uint8)


def _reference(rng: np.random.Generator, context: NoiseContext) -> np.ndarray:
    if context.patterns is None:
        raise ValueError("the reference noise needs the split's patterns (NoiseContext.patterns)")
    return context.patterns[int(rng.integers(len(context.patterns)))]


# ---------------------------------------------------------------------------- strokes (version 1)


def stroke_lines(rng: np.random.Generator, n: int) -> np.ndarray:
    """Two segments (r0, c0, r1, c1) per patch, [n, 2, 4], each at least 10 px long."""
    h, w = PATCH
    lines = np.empty((n, 2, 4), dtype=np.float64)
    for i in range(n):
        for j in range(2):
            while True:
                r0, r1 = rng.uniform(1.0, h - 2.0, size=2)
                c0, c1 = rng.uniform(1.0, w - 2.0, size=2)
                if np.hypot(r1 - r0, c1 - c0) >= min(STROKES_MIN_LENGTH, 0.5 * min(h, w)):
                    break
            lines[i, j] = (r0, c0, r1, c1)
    return lines


def draw_strokes(lines: np.ndarray, gain: float) -> np.ndarray:
    """Rasterise segments as thick strokes (anti-aliased by distance) into a uint8 patch."""
    h, w = PATCH
    rr, cc = np.mgrid[0:h, 0:w].astype(np.float64)
    out = np.zeros((h, w), dtype=np.float64)
    for r0, c0, r1, c1 in lines:
        dr, dc = r1 - r0, c1 - c0
        t = np.clip(((rr - r0) * dr + (cc - c0) * dc) / (dr * dr + dc * dc), 0.0, 1.0)
        dist = np.hypot(rr - (r0 + t * dr), cc - (c0 + t * dc))
        out = np.maximum(out, np.clip(2.0 * STROKES_HALF_WIDTH - dist, 0.0, 1.0))
    return np.rint(out * (255.0 * gain)).astype(np.uint8)


def _strokes_many(rng: np.random.Generator, context: NoiseContext, n: int) -> list[np.ndarray]:
    # Version 1 drew every patch's segments first, then every gain: same order here.
    lines = stroke_lines(rng, n)
    gains = rng.uniform(*STROKES_GAIN, size=n)
    return [draw_strokes(lines[i], float(gains[i])) for i in range(n)]


def _strokes(rng: np.random.Generator, context: NoiseContext) -> np.ndarray:
    return _strokes_many(rng, context, 1)[0]


# ---------------------------------------------------------------------------- other families


def _grid() -> tuple[np.ndarray, np.ndarray]:
    rr, cc = np.mgrid[0 : PATCH[0], 0 : PATCH[1]].astype(np.float64)
    return rr, cc


def _fragments(rng: np.random.Generator, context: NoiseContext) -> np.ndarray:
    if context.digits is None or len(context.digits) == 0:
        raise ValueError("the fragments noise needs the split's digits (NoiseContext.digits)")
    h, w = PATCH
    out = np.zeros(PATCH, dtype=np.uint8)
    for _ in range(2):
        for _ in range(100):  # a blank crop (margin of the digit) is retried
            digit = context.digits[int(rng.integers(len(context.digits)))]
            ph, pw = (int(v) for v in rng.integers(FRAGMENT_SIDE[0], FRAGMENT_SIDE[1] + 1, size=2))
            r0, c0 = int(rng.integers(h - ph + 1)), int(rng.integers(w - pw + 1))
            piece = digit[r0 : r0 + ph, c0 : c0 + pw]
            if int((piece > 127).sum()) >= FRAGMENT_MIN_INK:
                break
        piece = np.rot90(piece, int(rng.integers(4)))
        ph, pw = piece.shape
        r, c = int(rng.integers(h - ph + 1)), int(rng.integers(w - pw + 1))
        out[r : r + ph, c : c + pw] = np.maximum(out[r : r + ph, c : c + pw], piece)
    return out


def _ellipse_radius(rng: np.random.Generator, centre: tuple[float, float], axes: tuple[float, float]
                    ) -> np.ndarray:
    """Normalised elliptic radius (1 on the outline) of every pixel, for a randomly rotated ellipse."""
    rr, cc = _grid()
    theta = rng.uniform(0.0, np.pi)
    dr, dc = rr - centre[0], cc - centre[1]
    u = dr * np.cos(theta) + dc * np.sin(theta)
    v = -dr * np.sin(theta) + dc * np.cos(theta)
    return np.hypot(u / axes[0], v / axes[1])


def _blobs(rng: np.random.Generator, context: NoiseContext) -> np.ndarray:
    out = np.zeros(PATCH, dtype=np.float64)
    for _ in range(int(rng.integers(1, 4))):
        centre = (rng.uniform(7.0, 20.0), rng.uniform(7.0, 20.0))
        axes = (rng.uniform(2.5, 7.0), rng.uniform(2.5, 7.0))
        rho = _ellipse_radius(rng, centre, axes)
        # full inside, fading to 0 over the outer ~third of the radius: a soft edge
        out = np.maximum(out, np.clip((1.0 - rho) * 3.0, 0.0, 1.0) * rng.uniform(0.6, 1.0))
    return np.rint(out * 255.0).astype(np.uint8)


def _rings(rng: np.random.Generator, context: NoiseContext) -> np.ndarray:
    out = np.zeros(PATCH, dtype=np.float64)
    for _ in range(int(rng.integers(RING_COUNT[0], RING_COUNT[1] + 1))):
        centre = (rng.uniform(5.0, 22.0), rng.uniform(5.0, 22.0))
        radius = rng.uniform(*RING_RADIUS)
        axes = (radius, radius * rng.uniform(0.85, 1.15))  # near-circles: an elongated ring reads as a 0
        rho = _ellipse_radius(rng, centre, axes)
        dist = np.abs(rho - 1.0) * np.sqrt(axes[0] * axes[1])  # ~ pixels from the outline
        out = np.maximum(out, np.clip(1.2 - dist, 0.0, 1.0) * rng.uniform(0.7, 1.0))
    return np.rint(out * 255.0).astype(np.uint8)


def _waves(rng: np.random.Generator, context: NoiseContext) -> np.ndarray:
    rr, cc = _grid()
    out = np.zeros(PATCH, dtype=np.float64)
    for _ in range(int(rng.integers(WAVE_COUNT[0], WAVE_COUNT[1] + 1))):
        length, period = rng.uniform(*WAVE_LENGTH), rng.uniform(*WAVE_PERIOD)
        amplitude, phase, angle = rng.uniform(*WAVE_AMPLITUDE), rng.uniform(0.0, 2 * np.pi), rng.uniform(0.0, np.pi)
        centre = rng.uniform(9.0, 19.0, size=2)
        t = np.linspace(-length / 2, length / 2, int(length * 4) + 1)  # points every 0.25 px along the axis
        y = amplitude * np.sin(2 * np.pi * t / period + phase)
        pr = centre[0] + t * np.sin(angle) + y * np.cos(angle)
        pc = centre[1] + t * np.cos(angle) - y * np.sin(angle)
        dist = np.sqrt((rr[..., None] - pr) ** 2 + (cc[..., None] - pc) ** 2).min(-1)  # to the curve
        out = np.maximum(out, np.clip(1.3 - dist, 0.0, 1.0) * rng.uniform(0.7, 1.0))  # a ~2.5 px pen
    return np.rint(out * 255.0).astype(np.uint8)


def _parallel_lines(rng: np.random.Generator, context: NoiseContext) -> np.ndarray:
    rr, cc = _grid()
    spacing = rng.uniform(4.0, 7.0)
    angles = [rng.uniform(0.0, np.pi)]
    if rng.random() < 0.5:
        angles.append(angles[0] + np.pi / 2)
    out = np.zeros(PATCH, dtype=np.float64)
    for a in angles:
        t = rr * np.cos(a) + cc * np.sin(a) + rng.uniform(0.0, spacing)
        dist = np.abs(t - spacing * np.round(t / spacing))  # to the nearest line of the family
        out = np.maximum(out, np.clip(1.0 - dist, 0.0, 1.0))
    # a random rectangle of the patch, so the texture does not always fill the box
    h, w = PATCH
    ph, pw = (int(v) for v in rng.integers(14, 29, size=2))
    r0, c0 = int(rng.integers(h - ph + 1)), int(rng.integers(w - pw + 1))
    mask = np.zeros(PATCH, dtype=bool)
    mask[r0 : r0 + ph, c0 : c0 + pw] = True
    return np.rint(np.where(mask, out, 0.0) * 255.0 * rng.uniform(0.7, 1.0)).astype(np.uint8)


@functools.lru_cache(maxsize=16)
def _font(size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def _glyphs(rng: np.random.Generator, context: NoiseContext) -> np.ndarray:
    from PIL import Image, ImageDraw

    h, w = PATCH
    out = np.zeros(PATCH, dtype=np.uint8)
    count = int(rng.integers(1, 3))
    for k in range(count):
        char = GLYPH_CHARS[int(rng.integers(len(GLYPH_CHARS)))]
        font = _font(int(rng.integers(GLYPH_SIZE[0], GLYPH_SIZE[1] + 1)))
        gain = rng.uniform(0.7, 1.0)
        canvas = Image.new("L", (w, h), 0)
        draw = ImageDraw.Draw(canvas)
        left, top, right, bottom = draw.textbbox((0, 0), char, font=font)
        # glyph k of `count` sits in its own vertical strip (clamped when the glyph is wider),
        # so two glyphs stay two readable symbols rather than one tangle
        lo, hi = k * w / count, (k + 1) * w / count
        x = rng.uniform(lo, max(lo, hi - (right - left))) - left
        y = rng.uniform(0.0, max(0.0, h - (bottom - top))) - top
        draw.text((round(x), round(y)), char, fill=255, font=font)
        out = np.maximum(out, np.rint(np.asarray(canvas, dtype=np.float64) * gain).astype(np.uint8))
    return out


# ---------------------------------------------------------------------------- registry


FAMILIES: dict[str, NoiseFamily] = {
    f.name: f
    for f in (
        NoiseFamily(
            "reference", _reference, overlap=True,
            looks="thin 1-px '/', 'V', 'X' lines from a top corner; 50 patterns per split (the paper's noise)",
            params={"patterns_per_split": REFERENCE_PATTERNS, "slope": "tan(u * pi/2.5), u ~ U(0,1)",
                    "points": REFERENCE_POINTS, "extent": REFERENCE_EXTENT,
                    "partner_flip_p": [REFERENCE_FLIP_P, REFERENCE_FLIP_P], "gain": list(REFERENCE_GAIN),
                    "gain_drawn": "per pattern and pixel", "source": "idiap/attention-sampling scripts/make_mnist.py"},
        ),
        NoiseFamily(
            "strokes", _strokes, overlap=False, render_many=_strokes_many,
            looks="two thick (~3 px) random segments (version 1's noise)",
            params={"gain": list(STROKES_GAIN), "min_length": STROKES_MIN_LENGTH,
                    "stroke_half_width": STROKES_HALF_WIDTH},
        ),
        NoiseFamily(
            "fragments", _fragments, overlap=False,
            looks="two rotated pieces (<= 13x13) cut from the split's own digits",
            params={"pieces": 2, "side": list(FRAGMENT_SIDE), "min_ink": FRAGMENT_MIN_INK,
                    "rotation": "multiple of 90 degrees"},
        ),
        NoiseFamily(
            "blobs", _blobs, overlap=False, looks="1-3 filled soft ellipses",
            params={"count": [1, 3], "semi_axes": [2.5, 7.0], "gain": [0.6, 1.0]},
        ),
        NoiseFamily(
            "rings", _rings, overlap=False, looks="2-4 small circle outlines (radius 2-4.5 px)",
            params={"count": list(RING_COUNT), "radius": list(RING_RADIUS), "aspect": [0.85, 1.15],
                    "gain": [0.7, 1.0]},
        ),
        NoiseFamily(
            "waves", _waves, overlap=False, looks="1-2 thin wavy lines (>= 1.8 periods, 3-7 px high)",
            params={"count": list(WAVE_COUNT), "length": list(WAVE_LENGTH), "period": list(WAVE_PERIOD),
                    "amplitude": list(WAVE_AMPLITUDE), "gain": [0.7, 1.0]},
        ),
        NoiseFamily(
            "grid", _parallel_lines, overlap=False, looks="parallel 1-px lines, crossed half of the time",
            params={"spacing": [4.0, 7.0], "crossed_p": 0.5, "rectangle_side": [14, 28], "gain": [0.7, 1.0]},
        ),
        NoiseFamily(
            "glyphs", _glyphs, overlap=False, looks="1-2 printed letters or symbols (Pillow's built-in font)",
            params={"count": [1, 2], "chars": GLYPH_CHARS, "font": "PIL.ImageFont.load_default(size)",
                    "size": list(GLYPH_SIZE), "gain": [0.7, 1.0]},
        ),
    )
}


def parse_families(spec: str | Sequence[str]) -> tuple[str, ...]:
    """``"strokes, blobs"`` or ``["strokes", "blobs"]`` -> ``("strokes", "blobs")``; ValueError
    naming an unknown or repeated family (a repeat would silently change the mixing weights)."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    if not names or any(not n for n in names):
        raise ValueError(f"noise must name one or more families separated by commas, got {spec!r}")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown noise family {unknown[0]!r}; choose from {', '.join(FAMILIES)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"noise family {repeated[0]!r} is listed twice")
    return tuple(names)
