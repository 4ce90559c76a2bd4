"""Synthetic whole slides: pyramidal tiled TIFFs where the label hides in small, rare spots.

Why: the whole-slide path (lazy readers, tissue mask, patches read at sampled
positions) has to be trained and tested for real without downloading a slide. The
task is built so that attention sampling is *needed*, as in pathology:

* **Tissue.** Irregular pink "tissue" (low-frequency noise, thresholded) with a fibre
  texture and scattered purple nuclei, on near-white glass; Otsu on saturation
  (``tissue_mask``) separates the two, as on real H&E slides.
* **Spots.** Every slide carries ``n_spots`` round cell clusters of radius
  ``spot_radius``. A *decoy* (in every slide) is a dense aggregate of small round nuclei;
  a *target* (only in ``tumor`` slides, 1 to ``max_targets`` of the spots) is a nest of
  large irregular nuclei. Both cover the same fraction of their disc with the same
  colour, so in the low-resolution view (scale ~1/32) they are the same dark dot: the
  attention can learn *where* the spots are, but only the full-resolution patch tells a
  target from a decoy. Label: ``tumor`` if any target, else ``normal`` (alternating with
  the image index, so both classes have equal counts).
* **Stain.** ``stain_jitter`` S > 0 varies the colours from slide to slide as stains vary
  between labs and batches: each slide's haematoxylin and eosin amounts are multiplied by
  factors drawn from U(1 - S, 1 + S) (the colour-deconvolution model of
  :mod:`ats_cli.augment`, Ruifrok & Johnston 2001). Amounts, not offsets, so that the glass
  (almost no stain) stays white as on a real slide. The factors come from a stream of their
  own, so a slide's layout, label and noise are those of the same slide at S = 0; only its
  colours differ. A model trained at S = 0 and tested at S > 0 measures what
  ``ats train --augment`` is for (docs/training.md).
* **File.** RGB, JPEG-compressed 256x256 tiles, a pyramid of separate IFDs down by 4x
  (reduced levels marked ``subfiletype=1``, which OpenSlide and tifffile both read as
  levels) and the resolution tags set to ``mpp`` microns per pixel.

Every image draws its randomness from ``SeedSequence(seed + 1 (train) or seed (test),
spawn_key=(index,))`` like Megapixel MNIST; the run machinery (parallel, atomic,
resumable) is :mod:`ats_cli.data.generation`. The CSVs carry a ``boxes`` column with the
targets as ``[["tumor", row, col, h, w], ...]`` (``ats visualize`` draws them).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ats_cli.data.generation import GenerationReport, check_output, run_generation
from ats_cli.io import atomic_path

__all__ = ["SyntheticSlidesConfig", "generate_synthetic_slides", "render_slide", "render_slide_bands",
           "write_pyramid", "write_pyramid_bands", "band_rows", "CLASSES",
           "GENERATOR_NAME", "check_slides_output"]

GENERATOR_NAME = "synthetic-slides"
GENERATOR_VERSION = 1
CLASSES = ["normal", "tumor"]
# the recipe ats train reads these slides with, at any size (ats_cli/recipes/synthetic-slides.toml);
# synthetic-slides-100k and -12k are the two-level ones, named with --recipe
RECIPE = "synthetic-slides"
TILE = 256
JPEG_QUALITY = 90
GLASS = np.array([243, 241, 245], np.float32)
STROMA = np.array([232, 160, 196], np.float32)
NUCLEUS = np.array([92, 52, 132], np.float32)
SPOT_BACKGROUND = np.array([214, 138, 186], np.float32)


@dataclass(frozen=True)
class SyntheticSlidesConfig:
    """Everything that determines the files (the worker count does not)."""

    n_train: int = 240
    n_test: int = 80
    size: int = 3072  # side of the square slide at level 0, pixels
    n_spots: int = 8  # cell clusters per slide (decoys, plus targets in tumor slides)
    max_targets: int = 3  # a tumor slide has 1..max_targets target spots
    spot_radius: int = 28  # pixels at level 0
    mpp: float = 0.5  # microns per pixel written to the file
    seed: int = 0
    stain_jitter: float = 0.0  # per-slide H and E amounts x U(1 - S, 1 + S); 0 = every slide alike

    def validate(self) -> SyntheticSlidesConfig:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("mpp", "stain_jitter") and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
        if self.n_train < 1 or self.n_test < 1:
            raise ValueError("n_train and n_test must be at least 1 (both splits are required)")
        if self.size < 512:
            raise ValueError(f"size must be at least 512 pixels, got {self.size}")
        if not 1 <= self.max_targets <= self.n_spots:
            raise ValueError(f"max_targets must be in 1..n_spots ({self.n_spots}), got {self.max_targets}")
        if not 4 <= self.spot_radius <= self.size // 16:
            raise ValueError(f"spot_radius must be in 4..size/16 ({self.size // 16}), got {self.spot_radius}")
        if not self.mpp > 0:
            raise ValueError(f"mpp must be > 0, got {self.mpp}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not 0 <= self.stain_jitter < 1:
            raise ValueError(f"stain_jitter must be in [0, 1), got {self.stain_jitter}")
        return self

    def summary(self) -> str:
        """What this config makes, in the words ``ats make-dataset`` prints before it starts."""
        return (f"{self.n_train} train + {self.n_test} test slides, {self.size}x{self.size}, {self.n_spots} clusters, "
                f"up to {self.max_targets} targets, {self.mpp} um/px, seed {self.seed}"
                + (f", stain jitter {self.stain_jitter:g}" if self.stain_jitter else ""))

    def params(self) -> dict[str, Any]:
        """The parameters ``dataset.json`` records. ``stain_jitter`` only when it is on: at 0
        the files are those of the generator before the option existed, and so are the
        records, so a directory generated then is resumed, not refused as different."""
        params = asdict(self)
        if not self.stain_jitter:
            del params["stain_jitter"]
        return params

    def hints(self) -> dict[str, Any]:
        """The facts of the slides ``dataset.json`` records as hints: RGB, their size and
        microns per pixel. What training reads them with is :data:`RECIPE`."""
        return {"channels": 3, "image_size": [self.size, self.size], "mpp": self.mpp}


# ---------------------------------------------------------------------------- one slide


def _rng(seed: int, split: str, index: int, stream: int | None = None) -> np.random.Generator:
    """Slide ``index``'s generator; ``stream``: another, independent one of the same slide."""
    entropy = seed + 1 if split == "train" else seed
    key = (index,) if stream is None else (index, stream)
    return np.random.default_rng(np.random.SeedSequence(entropy=entropy, spawn_key=key))


STAIN_STREAM = 1  # the stream of the stain factors (_rng): the layout's stream is untouched by them


def _stain(image: np.ndarray, factors: np.ndarray, rows: int = 256) -> None:
    """Scale the haematoxylin, eosin and DAB amounts of ``image`` [H, W, 3] (float, 0..255)
    by ``factors`` [3], in place, a band of ``rows`` at a time (bounded memory)."""
    from ats_cli.augment import hed_jitter

    alpha = torch.from_numpy(factors.astype(np.float32))[None]
    for r in range(0, image.shape[0], rows):
        band = torch.from_numpy(image[r:r + rows].clip(0, 255) / 255.0).float().permute(2, 0, 1)[None]
        image[r:r + rows] = 255.0 * hed_jitter(band, alpha, torch.zeros(1, 3))[0].permute(1, 2, 0).numpy()


def _smooth_noise(rng: np.random.Generator, size: int, cells: int) -> np.ndarray:
    """[size, size] float32 noise with features about size/cells wide (bicubic upsampling)."""
    coarse = torch.from_numpy(rng.standard_normal((1, 1, cells + 3, cells + 3)).astype(np.float32))
    big = F.interpolate(coarse, size=(size + size * 3 // cells,) * 2, mode="bicubic", align_corners=False)
    off = size * 3 // cells // 2
    return big[0, 0, off:off + size, off:off + size].numpy()


class _WholeNoise:
    """:func:`_smooth_noise` computed whole, rows sliced from it: sides up to ONE_SHOT_MAX."""

    def __init__(self, rng: np.random.Generator, size: int, cells: int):
        self.full = _smooth_noise(rng, size, cells)

    def rows(self, r0: int, r1: int, step: int = 1) -> np.ndarray:
        return self.full[r0:r1:step]


def _cubic_weights(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """Input rows [n_out, 4] and weights [n_out, 4] of bicubic upsampling (A = -0.75,
    align_corners=False, indices clamped at the edges), as ``F.interpolate`` computes them
    up to rounding (float32 here; torch's differ by ~1e-7)."""
    a = np.float32(-0.75)
    real = np.float32(n_in) / np.float32(n_out) * (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) \
        - np.float32(0.5)
    idx = np.floor(real).astype(np.int64)
    t = np.clip(real - idx, 0, 1).astype(np.float32)

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], 1).astype(np.float32)
    return np.clip(idx[:, None] + np.arange(-1, 3), 0, n_in - 1), weights


class _BandNoise:
    """The same noise as :func:`_smooth_noise` (the same draws, the same bicubic
    upsampling), computed for the rows asked for only: memory is that of the rows, not of
    the slide. Across a row the upsampling is ``F.interpolate``'s own (rows are
    independent there); down the columns it is a 4-tap sum with :func:`_cubic_weights`,
    which torch's own computation matches to ~1e-5, not bit for bit: sides above
    ONE_SHOT_MAX therefore have their own files (``fingerprint`` says so)."""

    def __init__(self, rng: np.random.Generator, size: int, cells: int):
        self.coarse = torch.from_numpy(rng.standard_normal((1, 1, cells + 3, cells + 3)).astype(np.float32))
        self.size, self.big, self.off = size, size + size * 3 // cells, size * 3 // cells // 2
        self.index, self.weight = _cubic_weights(cells + 3, self.big)

    def rows(self, r0: int, r1: int, step: int = 1) -> np.ndarray:
        out_rows = np.arange(r0, r1, step) + self.off
        if len(out_rows) == 0:
            return np.zeros((0, self.size), np.float32)
        index, weight = self.index[out_rows], torch.from_numpy(self.weight[out_rows])
        lo, hi = int(index.min()), int(index.max()) + 1
        across = F.interpolate(self.coarse[:, :, lo:hi], size=(hi - lo, self.big), mode="bicubic",
                               align_corners=False)[0, 0, :, self.off:self.off + self.size]
        out = across[index[:, 0] - lo] * weight[:, :1]
        for j in range(1, 4):
            out = out + across[index[:, j] - lo] * weight[:, j:j + 1]
        return out.numpy()


def _disc(radius: float) -> tuple[np.ndarray, np.ndarray]:
    r = int(np.ceil(radius))
    dy, dx = np.mgrid[-r:r + 1, -r:r + 1]
    keep = dy * dy + dx * dx <= radius * radius
    return dy[keep], dx[keep]


@dataclass
class _Stamps:
    """Discs of ``radius`` at ``centres`` [n, 2] (row, col), one ``shade`` [n, 3] each, to be
    painted into whichever band of rows they touch (later discs over earlier ones)."""

    centres: np.ndarray
    radius: float
    shade: np.ndarray

    def paint(self, band: np.ndarray, r0: int, size: int) -> None:
        """Paint into ``band`` = rows r0.. of the slide, exactly as painting the whole slide
        would (discs clipped at the slide's edges; overlaps: the later disc wins)."""
        dy, dx = _disc(self.radius)
        r1, reach = r0 + band.shape[0], int(np.ceil(self.radius))
        near = np.flatnonzero((self.centres[:, 0] >= r0 - reach) & (self.centres[:, 0] < r1 + reach))
        if len(near) == 0:
            return
        rows = np.clip(self.centres[near, :1] + dy[None], 0, size - 1)
        cols = np.clip(self.centres[near, 1:] + dx[None], 0, size - 1)
        inside = (rows >= r0) & (rows < r1)
        shade = np.repeat(self.shade[near][:, None, :], len(dy), axis=1)
        band[rows[inside] - r0, cols[inside]] = shade[inside]


def _stamps(centres: np.ndarray, radius: float, colour: np.ndarray, rng: np.random.Generator,
            jitter: float = 12.0) -> list[_Stamps]:
    """Discs of ``radius`` at ``centres`` [n, 2] (row, col), colour +- ``jitter`` (drawn now)."""
    if len(centres) == 0:
        return []
    shade = colour[None] + rng.uniform(-jitter, jitter, size=(len(centres), 1)).astype(np.float32)
    return [_Stamps(centres, radius, shade)]


def _cluster(rng: np.random.Generator, centre: tuple[int, int], radius: int, spacing: float) -> np.ndarray:
    """Centres on a jittered grid of ``spacing`` inside the disc (row, col)."""
    r = np.arange(-radius, radius + 1, spacing)
    gy, gx = np.meshgrid(r, r, indexing="ij")
    pts = np.stack([gy.ravel(), gx.ravel()], 1) + rng.uniform(-spacing / 4, spacing / 4, size=(gy.size, 2))
    pts = pts[(pts ** 2).sum(1) <= (radius - spacing / 3) ** 2]
    return (pts + np.array(centre)).round().astype(np.int64)


@dataclass(frozen=True)
class SlideLayout:
    label: int
    targets: list[tuple[int, int]]  # spot centres (row, col) that are targets
    decoys: list[tuple[int, int]]

    def row(self, path: str, radius: int) -> dict[str, str]:
        boxes = [["tumor", r - radius, c - radius, 2 * radius, 2 * radius] for r, c in sorted(self.targets)]
        return {"path": path, "label": CLASSES[self.label], "boxes": json.dumps(boxes, separators=(",", ":")),
                "n_targets": str(len(self.targets))}


ONE_SHOT_MAX = 4096  # sides up to this are rendered whole: generator version 1's files, byte for byte
BAND_PIXELS = 8_000_000  # larger sides: rendered this many pixels (>= TILE rows) at a time


def band_rows(size: int) -> int:
    """Rows rendered at a time: the whole slide up to ONE_SHOT_MAX, else ~BAND_PIXELS
    pixels, a multiple of TILE (the file's tiles and the stain's bands are TILE rows)."""
    return size if size <= ONE_SHOT_MAX else max(TILE, BAND_PIXELS // size // TILE * TILE)


class _Slide:
    """One slide, planned: every random draw but the sensor noise is made here, in the
    order generator version 1 made them, so that :meth:`bands` paints any band of rows
    on its own, in bounded memory. Tissue is a threshold on a smooth field the rows are
    recomputed from (``noise``: :class:`_WholeNoise` up to ONE_SHOT_MAX, else
    :class:`_BandNoise`); the slide-wide statistics (threshold, tissue fraction, spot
    candidates) come from passes over the field band by band. Above ONE_SHOT_MAX they are
    taken on a grid ``coarsen`` = size // ONE_SHOT_MAX times sparser, so they stay small
    (the threshold from ~512x512 samples, spot candidates every 16 x coarsen pixels)."""

    def __init__(self, config: SyntheticSlidesConfig, split: str, index: int, *, rows: int | None = None,
                 noise: type | None = None):
        n = self.size = config.size
        self.rows = rows or band_rows(n)
        if self.rows < n and self.rows % TILE:
            raise ValueError(f"bands must be a multiple of {TILE} rows, got {self.rows}")
        noise = noise or (_WholeNoise if n <= ONE_SHOT_MAX else _BandNoise)
        coarsen = max(1, n // ONE_SHOT_MAX)
        rng = self.rng = _rng(config.seed, split, index)
        label = index % 2
        # tissue: smooth noise, tapered towards the border, the top ~55% kept
        self.axis = np.arange(n, dtype=np.float32) / n - 0.5
        self.field_noise = noise(rng, n, 6)
        step = 8 * coarsen
        samples = np.concatenate([self._field(r0 + (-r0) % step, min(r0 + self.rows, n), step)[:, ::step].copy()
                                  for r0 in range(0, n, self.rows)])
        self.threshold = np.quantile(samples, 0.45)
        del samples
        self.fibre = noise(rng, n, max(8, n // 48))
        # scattered nuclei in the tissue, one per ~700 px^2; spot candidates on a grid
        grid = 16 * coarsen
        count, coarse = 0, []
        for r0, tissue in self._tissue_bands():
            count += int(tissue.sum())
            coarse.append(tissue[(-r0) % grid::grid, ::grid].copy())  # a copy: not the band
        k = int(count / (n * n) * n * n / 700)  # = int(tissue.mean() * n * n / 700)
        pts = rng.integers(0, n, size=(k, 2))
        keep = np.zeros(len(pts), bool)
        for r0, tissue in self._tissue_bands():
            here = np.flatnonzero((pts[:, 0] >= r0) & (pts[:, 0] < r0 + len(tissue)))
            keep[here] = tissue[pts[here, 0] - r0, pts[here, 1]]
        self.stamps = _stamps(pts[keep], 3.0, NUCLEUS, rng, jitter=18.0)
        # spots: centres in tissue, away from the border and from each other
        rad = config.spot_radius
        cand = np.argwhere(np.concatenate(coarse)) * grid + grid // 2
        cand = cand[(cand.min(1) > 2 * rad) & (cand.max(1) < n - 2 * rad)]
        if len(cand) == 0:
            cand = np.array([[n // 2, n // 2]])
        centres: list[tuple[int, int]] = []
        for i in rng.permutation(len(cand)):
            c = tuple(int(v) for v in cand[i])
            if all((c[0] - d[0]) ** 2 + (c[1] - d[1]) ** 2 > (6 * rad) ** 2 for d in centres):
                centres.append(c)
            if len(centres) == config.n_spots:
                break
        n_targets = int(rng.integers(1, config.max_targets + 1)) if label else 0
        n_targets = min(n_targets, len(centres))
        targets, decoys = centres[:n_targets], centres[n_targets:]
        self.stamps += [_Stamps(np.array([c]), rad, SPOT_BACKGROUND[None]) for c in centres]
        # same coverage (~50% of the disc) and colour: decoys = many small round nuclei,
        # targets = fewer, large, irregular ones; alike at 1/32 scale, unlike at full scale
        for c in decoys:
            self.stamps += _stamps(_cluster(rng, c, rad, 5.0), 2.0, NUCLEUS, rng, jitter=10.0)
        for c in targets:
            for p in _cluster(rng, c, rad, 12.0):
                self.stamps += _stamps(p[None], float(rng.uniform(4.2, 5.6)), NUCLEUS, rng, jitter=10.0)
                self.stamps += _stamps(p[None] + rng.integers(-3, 4, size=(1, 2)), 2.5, NUCLEUS, rng, jitter=10.0)
        self.stain = None
        if config.stain_jitter:  # the stain is in the tissue, the noise in the camera: stain first
            s = config.stain_jitter
            h_e = _rng(config.seed, split, index, STAIN_STREAM).uniform(1 - s, 1 + s, size=2)
            self.stain = np.array([*h_e, 1.0])
        self.layout = SlideLayout(label, targets, decoys)

    def _field(self, r0: int, r1: int, step: int = 1) -> np.ndarray:
        axis = self.axis
        return self.field_noise.rows(r0, r1, step) - 6.0 * (axis[r0:r1:step, None] ** 2 + axis[None, :] ** 2)

    def _tissue_bands(self):
        for r0 in range(0, self.size, self.rows):
            yield r0, self._field(r0, min(r0 + self.rows, self.size)) > self.threshold

    def bands(self):
        """The slide's rows, [rows, size, 3] uint8, top to bottom; the sensor noise is drawn
        band after band (numpy draws the same numbers in pieces as at once). Once only."""
        n = self.size
        for r0, tissue in self._tissue_bands():
            image = np.empty((len(tissue), n, 3), np.float32)
            image[:] = GLASS
            image[tissue] = STROMA
            image += (4.0 + 10.0 * tissue[..., None]) * self.fibre.rows(r0, r0 + len(tissue))[..., None]
            del tissue
            for stamps in self.stamps:
                stamps.paint(image, r0, n)
            if self.stain is not None:
                _stain(image, self.stain)
            image += self.rng.normal(0.0, 3.0, size=(len(image), n, 1)).astype(np.float32)  # sensor noise
            yield image.clip(0, 255).astype(np.uint8)


def render_slide_bands(config: SyntheticSlidesConfig, split: str, index: int, *, rows: int | None = None,
                       noise: type | None = None) -> tuple[SlideLayout, Iterator[np.ndarray]]:
    """Slide ``index`` of ``split``: where its spots are (at once) and its pixels as bands of
    ``rows`` rows (default :func:`band_rows`), [rows, size, 3] uint8, rendered lazily
    (one band in memory at a time). ``noise``: tests force the whole or the banded noise."""
    slide = _Slide(config, split, index, rows=rows, noise=noise)
    return slide.layout, slide.bands()


def render_slide(config: SyntheticSlidesConfig, split: str, index: int) -> tuple[np.ndarray, SlideLayout]:
    """Slide ``index`` of ``split``: [size, size, 3] uint8 and where its spots are."""
    layout, bands = render_slide_bands(config, split, index)
    parts = list(bands)
    return (parts[0] if len(parts) == 1 else np.concatenate(parts)), layout


# ---------------------------------------------------------------------------- the file


def _halve_twice(image: np.ndarray) -> np.ndarray:
    """4x area downsampling (the pyramid's next level); odd edges are cropped."""
    h, w = image.shape[0] // 4 * 4, image.shape[1] // 4 * 4
    return image[:h, :w].reshape(h // 4, 4, w // 4, 4, -1).mean((1, 3)).round().astype(np.uint8)


def write_pyramid(path: str | os.PathLike[str], image: np.ndarray, *, mpp: float = 0.5, tile: int = TILE,
                  min_side: int = 128) -> None:
    """Write ``image`` [H, W, 3] uint8 as a pyramidal tiled TIFF (JPEG tiles, levels down by
    4x as separate IFDs, reduced ones ``subfiletype=1``), atomically (temp file + rename)."""
    write_pyramid_bands(path, [image], image.shape[:2], mpp=mpp, tile=tile, min_side=min_side)


def write_pyramid_bands(path: str | os.PathLike[str], bands: Iterable[np.ndarray], shape: Sequence[int], *,
                        mpp: float = 0.5, tile: int = TILE, min_side: int = 128) -> None:
    """:func:`write_pyramid` of the image whose rows ``bands`` yields top to bottom (each
    [rows, W, 3] uint8, rows a multiple of ``tile`` but the last), in bounded memory: level
    0 is encoded tile row by tile row as the bands come, and each next level (4x smaller)
    goes to a raw temporary file beside the output, read back band by band when its turn
    comes. The same bytes as writing the whole image at once."""
    import tifffile

    H, W = int(shape[0]), int(shape[1])
    res = (1e4 / mpp, 1e4 / mpp)  # pixels per centimetre
    raws: list[Path] = []
    try:
        with atomic_path(path) as tmp, tifffile.TiffWriter(tmp, bigtiff=H * W * 3 > 2**31) as tif:
            level, sub, source = (H, W), 0, iter(bands)
            while True:
                last = min(level) // 4 < min_side
                raw = None if last else tmp.with_name(f"{tmp.name[:-4]}.level{len(raws) + 1}.tmp")
                with contextlib.ExitStack() as stack:
                    down = None
                    if raw is not None:
                        raws.append(raw)
                        down = stack.enter_context(open(raw, "wb"))
                    tif.write(_tiles(source, level, tile, down), shape=(*level, 3), dtype=np.uint8,
                              tile=(tile, tile), photometric="rgb", compression="jpeg",
                              compressionargs={"level": JPEG_QUALITY}, subfiletype=sub, resolution=res,
                              resolutionunit="CENTIMETER", metadata=None)
                if last:
                    break
                level, sub = (level[0] // 4, level[1] // 4), 1
                res = (res[0] / 4, res[1] / 4)
                source = _raw_bands(raw, level, tile * max(1, BAND_PIXELS // (tile * max(level[1], 1))))
    finally:
        for raw in raws:
            raw.unlink(missing_ok=True)


def _tiles(bands: Iterator[np.ndarray], shape: tuple[int, int], tile: int, down) -> Iterator[np.ndarray]:
    """The tiles of the image ``bands`` make up, row-major, edge tiles padded with zeros
    (as tifffile pads an array); with ``down`` (a file), the next level's rows written there."""
    H, W = shape
    seen = 0
    for band in bands:
        if band.shape[1:] != (W, 3) or (seen + len(band) < H and len(band) % tile):
            raise ValueError(f"band of shape {band.shape} at row {seen} of a {H}x{W} image (tile {tile})")
        if down is not None:
            down.write(np.ascontiguousarray(_halve_twice(band)).tobytes())
        for t in range(0, len(band), tile):
            strip = band[t:t + tile]
            for c in range(0, W, tile):
                part = strip[:, c:c + tile]
                if part.shape[:2] != (tile, tile):
                    padded = np.zeros((tile, tile, 3), np.uint8)
                    padded[:part.shape[0], :part.shape[1]] = part
                    part = padded
                yield part
        seen += len(band)
    if seen != H:
        raise ValueError(f"the bands gave {seen} rows of {H}")


def _raw_bands(path: Path, shape: tuple[int, int], rows: int) -> Iterator[np.ndarray]:
    """Bands of ``rows`` rows of the raw [H, W, 3] uint8 image in ``path``."""
    H, W = shape
    with open(path, "rb") as f:
        for r0 in range(0, H, rows):
            n = min(rows, H - r0)
            yield np.frombuffer(f.read(n * W * 3), np.uint8).reshape(n, W, 3)


def _is_complete(path: Path) -> bool:
    """Written files appear by rename, so one that opens and whose last tile lies inside
    the file is complete (a power cut can leave it shorter: then it is rewritten)."""
    import tifffile

    try:
        size = path.stat().st_size
        with tifffile.TiffFile(path) as tif:
            page = tif.pages[-1]
            return int(page.dataoffsets[-1]) + int(page.databytecounts[-1]) <= size
    except Exception:  # missing, truncated or not a TIFF: write it again
        return False


# ---------------------------------------------------------------------------- the run


@dataclass
class _Job:
    config: SyntheticSlidesConfig
    out: Path
    name_width: int

    def run_chunk(self, split: str, indices: Sequence[int]) -> list[tuple[int, dict[str, str], bool]]:
        torch.set_num_threads(1)  # one process per core already
        results = []
        for index in indices:
            rel = f"{split}/{index:0{self.name_width}d}.tif"
            path = self.out / rel
            # planned even when the file exists: the CSV row needs the layout; painted only to be written
            layout, bands = render_slide_bands(self.config, split, index)
            wrote = not _is_complete(path)
            if wrote:
                write_pyramid_bands(path, bands, (self.config.size, self.config.size), mpp=self.config.mpp)
            results.append((index, layout.row(rel, self.config.spot_radius), wrote))
        return results


def fingerprint(config: SyntheticSlidesConfig) -> dict[str, Any]:
    """What ``dataset.json`` records of the generator. Sides above ONE_SHOT_MAX are rendered
    in bands (:class:`_Slide`), whose files are not those version 1 made whole at those
    sides (it needed ~40 bytes of RAM per pixel): the record says so, so that a directory
    begun by the whole-image renderer is refused, not finished with other slides."""
    record = {"name": GENERATOR_NAME, "version": GENERATOR_VERSION, "params": config.params(),
              "seeding": "image i of a split: numpy SeedSequence(entropy=seed+1 for train / seed for test, "
                         "spawn_key=(i,))", "tile": TILE, "jpeg_quality": JPEG_QUALITY}
    if config.size > ONE_SHOT_MAX:
        sparser = config.size // ONE_SHOT_MAX
        record["rendering"] = f"bands (sides above {ONE_SHOT_MAX}; statistics on a grid {sparser}x sparser)"
    return record


def check_slides_output(out: str | os.PathLike[str], config: SyntheticSlidesConfig) -> None:
    """Refuse early (DatasetError) an output directory that cannot receive this run."""
    check_output(out, fingerprint(config))


def generate_synthetic_slides(out: str | os.PathLike[str], config: SyntheticSlidesConfig, *,
                              workers: int | None = None,
                              progress: Callable[[str, int, int], None] | None = None) -> GenerationReport:
    """Generate (or finish generating) a synthetic-slides dataset in ``out``."""
    config.validate()
    out = Path(out).expanduser()
    job = _Job(config, out, max(4, len(str(max(config.n_train, config.n_test) - 1))))
    return run_generation(
        out, fingerprint(config), job, {"train": config.n_train, "test": config.n_test},
        dataset={"classes": CLASSES, "hints": config.hints(), "recipe": RECIPE,
                 "description": f"synthetic slides ({config.size}x{config.size} pyramidal TIFF, {config.n_spots} "
                                f"cell clusters; tumor = 1-{config.max_targets} of them are tumour nests)"},
        workers=workers, chunk_size=1, progress=progress, source="generated",
    )
