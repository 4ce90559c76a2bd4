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

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ats_cli.data.generation import GenerationReport, check_output, run_generation
from ats_cli.io import atomic_path

__all__ = ["SyntheticSlidesConfig", "generate_synthetic_slides", "render_slide", "write_pyramid", "CLASSES",
           "GENERATOR_NAME", "check_slides_output"]

GENERATOR_NAME = "synthetic-slides"
GENERATOR_VERSION = 1
CLASSES = ["normal", "tumor"]
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

    def params(self) -> dict[str, Any]:
        """The parameters ``dataset.json`` records. ``stain_jitter`` only when it is on: at 0
        the files are those of the generator before the option existed, and so are the
        records, so a directory generated then is resumed, not refused as different."""
        params = asdict(self)
        if not self.stain_jitter:
            del params["stain_jitter"]
        return params

    def hints(self) -> dict[str, Any]:
        """Training hints for ``dataset.json``: a spot is ~2 low-res pixels at scale 1/32,
        and a 64x64 patch holds a whole spot."""
        return {"channels": 3, "image_size": [self.size, self.size], "scale": 1 / 32, "patch_size": [64, 64],
                "n_patches": 12, "mpp": self.mpp}


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


def _disc(radius: float) -> tuple[np.ndarray, np.ndarray]:
    r = int(np.ceil(radius))
    dy, dx = np.mgrid[-r:r + 1, -r:r + 1]
    keep = dy * dy + dx * dx <= radius * radius
    return dy[keep], dx[keep]


def _stamp(image: np.ndarray, centres: np.ndarray, radius: float, colour: np.ndarray,
           rng: np.random.Generator, jitter: float = 12.0) -> None:
    """Paint discs of ``radius`` at ``centres`` [n, 2] (row, col), colour +- ``jitter``."""
    if len(centres) == 0:
        return
    dy, dx = _disc(radius)
    rows = np.clip(centres[:, :1] + dy[None], 0, image.shape[0] - 1)
    cols = np.clip(centres[:, 1:] + dx[None], 0, image.shape[1] - 1)
    shade = colour[None] + rng.uniform(-jitter, jitter, size=(len(centres), 1)).astype(np.float32)
    image[rows, cols] = np.repeat(shade[:, None, :], len(dy), axis=1)


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


def render_slide(config: SyntheticSlidesConfig, split: str, index: int) -> tuple[np.ndarray, SlideLayout]:
    """Slide ``index`` of ``split``: [size, size, 3] uint8 and where its spots are."""
    rng = _rng(config.seed, split, index)
    n = config.size
    label = index % 2
    # tissue: smooth noise, tapered towards the border, the top ~55% kept
    axis = np.arange(n, dtype=np.float32) / n - 0.5  # broadcast, not two full [n, n] grids
    field = _smooth_noise(rng, n, 6) - 6.0 * (axis[:, None] ** 2 + axis[None, :] ** 2)
    tissue = field > np.quantile(field[:: 8, :: 8], 0.45)
    fibre = _smooth_noise(rng, n, max(8, n // 48))
    image = np.empty((n, n, 3), np.float32)
    image[:] = GLASS
    image[tissue] = STROMA
    image += (4.0 + 10.0 * tissue[..., None]) * fibre[..., None]
    # scattered nuclei in the tissue, one per ~700 px^2
    k = int(tissue.mean() * n * n / 700)
    pts = rng.integers(0, n, size=(k, 2))
    pts = pts[tissue[pts[:, 0], pts[:, 1]]]
    _stamp(image, pts, 3.0, NUCLEUS, rng, jitter=18.0)
    # spots: centres in tissue, away from the border and from each other
    rad = config.spot_radius
    coarse = tissue[:: 16, :: 16]
    cand = np.argwhere(coarse) * 16 + 8
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
    dy, dx = _disc(rad)
    for c in centres:
        image[np.clip(c[0] + dy, 0, n - 1), np.clip(c[1] + dx, 0, n - 1)] = SPOT_BACKGROUND
    # same coverage (~50% of the disc) and colour: decoys = many small round nuclei,
    # targets = fewer, large, irregular ones; alike at 1/32 scale, unlike at full scale
    for c in decoys:
        _stamp(image, _cluster(rng, c, rad, 5.0), 2.0, NUCLEUS, rng, jitter=10.0)
    for c in targets:
        for p in _cluster(rng, c, rad, 12.0):
            _stamp(image, p[None], float(rng.uniform(4.2, 5.6)), NUCLEUS, rng, jitter=10.0)
            _stamp(image, p[None] + rng.integers(-3, 4, size=(1, 2)), 2.5, NUCLEUS, rng, jitter=10.0)
    if config.stain_jitter:  # the stain is in the tissue, the noise in the camera: stain first
        s = config.stain_jitter
        h_e = _rng(config.seed, split, index, STAIN_STREAM).uniform(1 - s, 1 + s, size=2)
        _stain(image, np.array([*h_e, 1.0]))
    image += rng.normal(0.0, 3.0, size=(n, n, 1)).astype(np.float32)  # sensor noise
    return image.clip(0, 255).astype(np.uint8), SlideLayout(label, targets, decoys)


# ---------------------------------------------------------------------------- the file


def _halve_twice(image: np.ndarray) -> np.ndarray:
    """4x area downsampling (the pyramid's next level); odd edges are cropped."""
    h, w = image.shape[0] // 4 * 4, image.shape[1] // 4 * 4
    return image[:h, :w].reshape(h // 4, 4, w // 4, 4, -1).mean((1, 3)).round().astype(np.uint8)


def write_pyramid(path: str | os.PathLike[str], image: np.ndarray, *, mpp: float = 0.5, tile: int = TILE,
                  min_side: int = 128) -> None:
    """Write ``image`` [H, W, 3] uint8 as a pyramidal tiled TIFF (JPEG tiles, levels down by
    4x as separate IFDs, reduced ones ``subfiletype=1``), atomically (temp file + rename)."""
    import tifffile

    res = (1e4 / mpp, 1e4 / mpp)  # pixels per centimetre
    with atomic_path(path) as tmp, tifffile.TiffWriter(tmp, bigtiff=image.nbytes > 2**31) as tif:
        level, sub = image, 0
        while True:
            tif.write(level, photometric="rgb", tile=(tile, tile), compression="jpeg",
                      compressionargs={"level": JPEG_QUALITY}, subfiletype=sub, resolution=res,
                      resolutionunit="CENTIMETER", metadata=None)
            if min(level.shape[:2]) // 4 < min_side:
                break
            level, sub = _halve_twice(level), 1
            res = (res[0] / 4, res[1] / 4)


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
            # rendered even when the file exists: the CSV row needs the layout (about 1 s)
            image, layout = render_slide(self.config, split, index)
            wrote = not _is_complete(path)
            if wrote:
                write_pyramid(path, image, mpp=self.config.mpp)
            results.append((index, layout.row(rel, self.config.spot_radius), wrote))
        return results


def fingerprint(config: SyntheticSlidesConfig) -> dict[str, Any]:
    return {"name": GENERATOR_NAME, "version": GENERATOR_VERSION, "params": config.params(),
            "seeding": "image i of a split: numpy SeedSequence(entropy=seed+1 for train / seed for test, "
                       "spawn_key=(i,))", "tile": TILE, "jpeg_quality": JPEG_QUALITY}


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
        dataset={"classes": CLASSES, "hints": config.hints(),
                 "description": f"synthetic slides ({config.size}x{config.size} pyramidal TIFF, {config.n_spots} "
                                f"cell clusters; tumor = 1-{config.max_targets} of them are tumour nests)"},
        workers=workers, chunk_size=1, progress=progress, source="generated",
    )
