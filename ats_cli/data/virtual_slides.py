"""Virtual slides: a whole slide of any size as a few hundred bytes of JSON, rendered on demand.

Why: training and benchmarking at 100k x 100k or 200k x 200k pixels (a large resection at
40x) would otherwise need tens of gigabytes of TIFF per slide. A virtual slide is a spec
file, ``NAME.vslide.json``, that the slide readers open like any slide
(:class:`ats_cli.data.slides.VirtualSlideReader`, chosen by that suffix in
:mod:`ats_cli.data.dataset`):
``ats predict``, ``ats train`` and ``ats visualize`` read its levels, regions, low-res view
and tissue mask through the same :class:`~ats_cli.data.slides.SlideReader` API as a real
pyramidal TIFF. The double suffix: it is JSON (any tool reads and edits it), and a folder
scan (``ats predict DIR``, ``make-dataset from-folder``) takes it for a slide while never
taking another ``.json`` (``dataset.json``) for one.

The content is that of ``ats make-dataset synthetic-slides`` (:mod:`ats_cli.data.synthetic_slides`):
pink tissue with a fibre texture and scattered nuclei on glass; ``nests`` (tumour nests of
large irregular nuclei: the slide is ``tumor`` if it has one) and ``decoys`` (aggregates of
small round nuclei, which cover the same fraction of their disc with the same colour),
discs of ``spot_radius`` level-0 pixels that are the same dark dot at low resolution and
differ only at full resolution. The patterns are new (procedural, below), not that
generator's pixels.

**A pixel depends only on the spec, the level and its position.** Every value is a
function of absolute coordinates: smooth fields are value noise whose lattice values are
hashes of (seed, lattice point) (:func:`hash32`), interpolated separably; the sensor noise
is a hash of (seed, level, row, column); scattered nuclei sit one per cell of a fixed grid
at a hashed offset (present when the offset falls in tissue), so a region finds the ones
that touch it by looking at the cells it overlaps: O(shapes nearby), never O(slide). The
few nests and decoys are placed once, when the spec is opened, by a seeded generator
(O(their number)), and indexed by a coarse grid. Per-pixel arithmetic is elementwise
``+ - * /``, ``sqrt`` and comparisons (exactly rounded in IEEE arithmetic, so numpy's
vector and scalar loops agree; no ``exp`` or ``sin``, whose vector versions may differ in
the last bit) and no reduction runs over pixels. The colour is the tissue's or the
glass's plus a grey term (texture and sensor noise); nuclei and spots are then composited
over it as ``colour + (below - colour) * prod(1 - coverage)``, the product taken in the
shapes' global order. So a read of any region gives, bit for bit, the pixels of any other read
that overlaps it (tests/test_virtual_slides.py shifts and splits reads to check).

**Levels are rendered at their own resolution.** Level L (downsample d, an integer of the
spec's ``downsamples``; size ``floor(side / d)``) has the pixel (r, c) centred on
level-0 point ((r + 0.5) d, (c + 0.5) d). Smooth fields are evaluated there; the fibre
texture's amplitude falls as 1 / sqrt(1 + (d / cell)^2) (its average over a pixel wider
than its cells tends to zero); a disc of radius r at distance ``dist`` from a pixel's
centre covers ``clip((R - dist) / d + 1/2, 0, 1) (r/d)^2 / ((R/d)^2 + 1/12)`` of it,
R = max(r, d / 2): the antialiased edge of a disc wider than the pixel, a disc narrower
than it spread over a pixel's width, both scaled to keep the disc's area (the ramp
integrates to ``pi ((R/d)^2 + 1/12)`` pixels; a box filter keeps ``pi (r/d)^2``: without
the factor a nucleus one pixel wide came out a third too large, and a nest darker at 1/8
than its own level 0 box-filtered). A family of shapes whose grid cells are narrower than
one pixel (``MEAN_BELOW``) at that level is drawn as its mean coverage instead (scattered
nuclei: ``pi r^2 / cell^2`` of tissue; the nuclei of nests and decoys: half their disc,
alike, which is the point). Why one pixel, not two: a family drawn as its mean loses its
texture, and a box filter keeps it while the cells are a pixel wide (a nest's 12-pixel
grid is 1.5 pixels at 1/8: the box-filtered level 0 still shows its nuclei, the mean
drawing a flat disc), so under two pixels nests and decoys were alike at 1/8, where a
real pyramid tells them apart. A level is thus the level-0 pattern
box-filtered approximately, computed directly, so
its cost is that of its own pixels. A pyramidal TIFF written from a virtual slide
(:func:`write_virtual_tiff`) renders every level with the same function, losslessly
compressed: its pixels are the virtual slide's exactly, at every level, through OpenSlide
and through tifffile (the test that keeps the readers honest).

**Bounded memory.** Nothing slide-sized exists: the spec is validated (sizes, counts,
levels; :class:`VirtualSlideError`, one line naming the file, the limit and the value) and
a read is bounded by the pixel budget of :mod:`ats_cli.data.slides` like any other read.
Nothing spot-sized exists either: a read makes only the nuclei and the disc pixels of a
spot that its window holds (:meth:`VirtualSlide._spot_nuclei`, :func:`_discs`, in blocks
of ``DISC_BLOCK``), so a 64x64 patch on a spot of the largest radius a spec allows costs
a 64x64 patch (it made the whole spot: memory with the spot's area, terabytes at the limit).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ats_cli.data.dataset import VIRTUAL_SUFFIX
from ats_cli.data.images import ImageReadError

__all__ = ["VirtualSlideError", "VirtualSlideSpec", "VirtualSlide", "VIRTUAL_SUFFIX", "FORMAT", "load_spec",
           "write_spec", "write_virtual_tiff", "RENDERER", "hash32", "default_downsamples", "level_sizes"]

FORMAT = "ats-virtual-slide"
VERSION = 1
MAX_SIDE = 10_000_000  # 10^14 pixels: far past any scanner; the lattice indices stay in 32 bits
MAX_SPOTS = 100_000  # nests + decoys: placed and indexed in memory when the spec is opened
MAX_LEVELS = 32
MIN_SIDE = 512
GLASS = (243.0, 241.0, 245.0)
STROMA = (232.0, 160.0, 196.0)
NUCLEUS = (92.0, 52.0, 132.0)
SPOT_BACKGROUND = (214.0, 138.0, 186.0)
NUCLEUS_CELL = 26  # scattered nuclei: one per 26 x 26 cell of tissue (~ one per 700 px^2)
NUCLEUS_RADIUS = 3.0
FIBRE_CELL = 40.0  # level-0 pixels between the fibre texture's lattice points
SENSOR_SIGMA = 3.0
DECOY_SPACING, DECOY_RADIUS = 5.0, 2.0
NEST_SPACING, NEST_RADII, SATELLITE_RADIUS = 12.0, (4.2, 5.6), 2.5
SPOT_COVERAGE = 0.5  # nuclei's share of a nest's or decoy's disc, both kinds (mean drawing)
DISC_BLOCK = 1 << 20  # pixels x discs that _discs computes at a time (a few 4 MiB arrays)
MEAN_BELOW = 1.0  # a family of nuclei whose grid cells are narrower than this many pixels is drawn as its mean
RENDERER = 2  # bump when a spec's pixels change: cached views of the older rendering then stop matching
TISSUE_THRESHOLD = -0.45  # the tissue field (noise minus a border taper) above this is tissue
# salts: one independent hash stream per use
_S_TISSUE, _S_TISSUE2, _S_FIBRE, _S_SENSOR, _S_NUCLEI, _S_SPOT = 1, 2, 3, 4, 5, 6


class VirtualSlideError(ImageReadError):
    """A spec file that is not a valid virtual slide; the message names the file. (An
    ImageReadError, as :class:`~ats_cli.data.slides.SlideReadError` is: caught alike.)"""


# ---------------------------------------------------------------------------- hashing


def _mix(h: np.ndarray) -> np.ndarray:
    """A 32-bit integer finaliser (lowbias32, C. Wellons): every input bit flips about
    half the output bits; uint32 arithmetic wraps, as the finaliser intends."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> np.uint32(15))
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> np.uint32(16))


def _u32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).astype(np.uint32) if not isinstance(x, np.ndarray) or x.dtype != np.uint32 \
        else x


def hash32(seed: int, salt: int, *keys) -> np.ndarray:
    """uint32 hash of (seed, salt, keys...): keys broadcast (integers, possibly negative)."""
    with np.errstate(over="ignore"):
        h = _mix(np.uint32((seed ^ (salt * 0x9E3779B9)) & 0xFFFFFFFF) + np.zeros((), np.uint32))
        for k in keys:
            h = _mix(h ^ _u32(k))
    return h


def _unit(h: np.ndarray) -> np.ndarray:
    """uint32 hashes -> float32 uniforms in [0, 1) (24 bits: exact in float32)."""
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)


# ---------------------------------------------------------------------------- the spec


def default_downsamples(height: int, width: int, smallest: int = 256) -> list[int]:
    """Powers of 2 while the level's shorter side is at least ``smallest``: a level within
    2x of any view, so a thumbnail or a view at a fixed pixel count costs about the same
    whatever the slide's size."""
    out, d = [1], 2
    while min(height, width) // d >= smallest and len(out) < MAX_LEVELS:
        out.append(d)
        d *= 2
    return out


@dataclass(frozen=True)
class VirtualSlideSpec:
    """What a ``.vslide.json`` holds: everything the pixels depend on."""

    width: int
    height: int
    seed: int
    mpp: float = 0.5
    downsamples: tuple[int, ...] = ()
    tissue_cells: float = 6.0  # tissue blobs: value noise with this many lattice cells across the slide
    nests: int = 0  # tumour nests (the slide is tumor if > 0)
    decoys: int = 8
    spot_radius: float = 28.0  # nests and decoys, level-0 pixels
    stain: tuple[float, float] = (1.0, 1.0)  # haematoxylin and eosin amounts x these
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # e.g. the dataset's split and index

    def to_json(self) -> dict[str, Any]:
        record = {"format": FORMAT, "version": VERSION, "width": self.width, "height": self.height,
                  "seed": self.seed, "mpp": self.mpp, "downsamples": list(self.downsamples),
                  "tissue_cells": self.tissue_cells, "nests": self.nests, "decoys": self.decoys,
                  "spot_radius": self.spot_radius, "stain": list(self.stain)}
        record.update(self.extra)
        return record


_KNOWN = {"format", "version", "width", "height", "seed", "mpp", "downsamples", "tissue_cells", "nests", "decoys",
          "spot_radius", "stain"}


def _problem(record: dict[str, Any]) -> str | None:  # noqa: C901 - one check per field, in order
    def integer(name, lo, hi):
        v = record.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            return f"{name} must be an integer in {lo}..{hi:,}, got {v!r}"
        return None

    def number(name, lo, hi):
        v = record.get(name)
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
            return f"{name} must be a number in {lo}..{hi}, got {v!r}"
        return None

    if record.get("format") != FORMAT:
        return f"format must be {FORMAT!r}, got {record.get('format')!r}"
    if record.get("version") != VERSION:
        return f"version {record.get('version')!r} is not {VERSION} (written by another ats?)"
    for check in (integer("width", MIN_SIDE, MAX_SIDE), integer("height", MIN_SIDE, MAX_SIDE),
                  integer("seed", 0, 2**32 - 1), number("mpp", 0.01, 100.0), number("tissue_cells", 1, 10_000),
                  integer("nests", 0, MAX_SPOTS), integer("decoys", 0, MAX_SPOTS)):
        if check:
            return check
    if record["nests"] + record["decoys"] > MAX_SPOTS:
        return f"nests + decoys must be at most {MAX_SPOTS:,}, got {record['nests'] + record['decoys']:,}"
    side = min(record["width"], record["height"])
    if problem := number("spot_radius", 4, side / 16):
        return problem
    room = int(record["width"] * record["height"] / (100 * record["spot_radius"] ** 2))
    if record["nests"] + record["decoys"] > room:  # spots keep 6 radii apart, in tissue: far fewer fit
        return (f"nests + decoys ({record['nests'] + record['decoys']:,}) must be at most one per 100 spot_radius² "
                f"of slide ({room:,} here)")
    stain = record.get("stain")
    if not (isinstance(stain, list) and len(stain) == 2
            and all(isinstance(s, int | float) and not isinstance(s, bool) and 0.05 <= s <= 20 for s in stain)):
        return f"stain must be two factors (haematoxylin, eosin) in 0.05..20, got {stain!r}"
    ds = record.get("downsamples")
    if not (isinstance(ds, list) and 1 <= len(ds) <= MAX_LEVELS
            and all(isinstance(d, int) and not isinstance(d, bool) for d in ds)):
        return f"downsamples must be a list of 1..{MAX_LEVELS} integers, got {ds!r}"
    if ds[0] != 1 or any(b <= a for a, b in zip(ds[:-1], ds[1:], strict=True)) or side // ds[-1] < 1:
        return f"downsamples must start at 1 and increase, each level at least 1 pixel wide, got {ds}"
    return None


def load_spec(path: str | os.PathLike[str]) -> VirtualSlideSpec:
    """Read and validate a spec file; :class:`VirtualSlideError` naming it otherwise."""
    path = Path(path)
    try:
        if path.stat().st_size > 1 << 20:
            raise VirtualSlideError(path, f"is {path.stat().st_size:,} bytes; a virtual slide spec is a small JSON "
                                    "object (at most 1 MiB)")
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VirtualSlideError(path, f"not a readable virtual slide spec ({type(e).__name__}: {e})") from e
    if not isinstance(record, dict):
        raise VirtualSlideError(path, f"a virtual slide spec is a JSON object, got {type(record).__name__}")
    record = dict(record)
    if "downsamples" not in record and isinstance(record.get("width"), int) and isinstance(record.get("height"), int):
        record["downsamples"] = default_downsamples(record["height"], record["width"])
    record.setdefault("stain", [1.0, 1.0])
    for key, value in (("mpp", 0.5), ("tissue_cells", 6.0), ("nests", 0), ("decoys", 8), ("spot_radius", 28.0)):
        record.setdefault(key, value)
    if problem := _problem(record):
        raise VirtualSlideError(path, problem)
    return VirtualSlideSpec(width=record["width"], height=record["height"], seed=record["seed"],
                            mpp=float(record["mpp"]), downsamples=tuple(record["downsamples"]),
                            tissue_cells=float(record["tissue_cells"]), nests=record["nests"],
                            decoys=record["decoys"], spot_radius=float(record["spot_radius"]),
                            stain=(float(record["stain"][0]), float(record["stain"][1])),
                            extra={k: v for k, v in record.items() if k not in _KNOWN})


def write_spec(path: str | os.PathLike[str], spec: VirtualSlideSpec) -> None:
    """Write ``spec`` to ``path`` atomically, after checking it as :func:`load_spec` would."""
    from ats_cli.io import atomic_write_text

    record = spec.to_json()
    if problem := _problem(record):
        raise VirtualSlideError(path, problem)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")


# ---------------------------------------------------------------------------- fields


def _fade(t: np.ndarray) -> np.ndarray:
    return t * t * t * (t * (t * 6.0 - 15.0) + 10.0)


def _axis(coords: np.ndarray, cell: float) -> tuple[np.ndarray, np.ndarray]:
    """Lattice index (int64) and faded fraction (float32) of level-0 coordinates (1-D, float64)."""
    scaled = coords / cell
    index = np.floor(scaled)
    return index.astype(np.int64), _fade(scaled - index).astype(np.float32)


def _lattice(seed: int, salt: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Lattice values in [-1, 1) at (rows x cols), float32."""
    return _unit(hash32(seed, salt, rows[:, None], cols[None, :])) * np.float32(2.0) - np.float32(1.0)


def _grid_noise(seed: int, salt: int, ys: np.ndarray, xs: np.ndarray, cell: float) -> np.ndarray:
    """Value noise [len(ys), len(xs)] float32 at the grid of level-0 points ys x xs:
    interpolated across first (on the lattice rows needed), then down. Only the lattice
    points next to a pixel are hashed (a level coarser than the lattice skips the rest), so
    the cost is that of the pixels; a pixel's value depends on its point only."""
    iy, fy = _axis(ys, cell)
    ix, fx = _axis(xs, cell)
    rows, cols = np.unique(np.concatenate([iy, iy + 1])), np.unique(np.concatenate([ix, ix + 1]))
    lat = _lattice(seed, salt, rows, cols)
    j0, j1 = np.searchsorted(cols, ix), np.searchsorted(cols, ix + 1)
    left = lat[:, j0]
    across = left + (lat[:, j1] - left) * fx  # [lattice rows, len(xs)]
    out = np.take(across, np.searchsorted(rows, iy + 1), axis=0)
    top = np.take(across, np.searchsorted(rows, iy), axis=0)
    out -= top
    out *= fy[:, None]
    out += top
    return out


def _point_noise(seed: int, salt: int, ys: np.ndarray, xs: np.ndarray, cell: float) -> np.ndarray:
    """Value noise at scattered points (ys[k], xs[k]), float32, equal to :func:`_grid_noise`
    at the same point (the same lattice values and weights, the same order of operations)."""
    iy, fy = _axis(ys, cell)
    ix, fx = _axis(xs, cell)

    def lat(a, b):
        return _unit(hash32(seed, salt, a, b)) * np.float32(2.0) - np.float32(1.0)

    top, bottom = lat(iy, ix), lat(iy + 1, ix)
    top = top + (lat(iy, ix + 1) - top) * fx
    bottom = bottom + (lat(iy + 1, ix + 1) - bottom) * fx
    return top + (bottom - top) * fy


# ---------------------------------------------------------------------------- the slide


@dataclass(frozen=True)
class Spot:
    row: float
    col: float
    nest: bool


class VirtualSlide:
    """A spec made ready to render: the spots placed and indexed, the palette stained."""

    def __init__(self, spec: VirtualSlideSpec):
        self.spec = spec
        self.seed = spec.seed
        self.tissue_cell = max(spec.width, spec.height) / spec.tissue_cells
        self.palette = _palette(spec.stain)
        self.spots = self._place_spots()
        self.bucket = max(4.0 * spec.spot_radius, 256.0)
        self._rows = np.array([p.row for p in self.spots], np.float64)
        self._cols = np.array([p.col for p in self.spots], np.float64)
        self.index: dict[tuple[int, int], list[int]] = {}
        for k, s in enumerate(self.spots):
            self.index.setdefault((int(s.row // self.bucket), int(s.col // self.bucket)), []).append(k)

    # -- tissue --------------------------------------------------------------------------
    def _field_parts(self, noise1, noise2, ys, xs):
        ay = (ys / self.spec.height - 0.5).astype(np.float32)
        ax = (xs / self.spec.width - 0.5).astype(np.float32)
        return noise1 + noise2 * np.float32(0.5), ay * ay, ax * ax

    def tissue_grid(self, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
        """Bool [len(ys), len(xs)]: tissue at the grid of level-0 points ys x xs."""
        c = self.tissue_cell
        n1 = _grid_noise(self.seed, _S_TISSUE, ys, xs, c)
        n2 = _grid_noise(self.seed, _S_TISSUE2, ys, xs, c / 2.5)
        noise, ay2, ax2 = self._field_parts(n1, n2, ys, xs)
        return noise - np.float32(6.0) * (ay2[:, None] + ax2[None, :]) > np.float32(TISSUE_THRESHOLD)

    def tissue_points(self, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
        """Bool: tissue at the points (ys[k], xs[k]) (== :meth:`tissue_grid` there)."""
        c = self.tissue_cell
        n1 = _point_noise(self.seed, _S_TISSUE, ys, xs, c)
        n2 = _point_noise(self.seed, _S_TISSUE2, ys, xs, c / 2.5)
        noise, ay2, ax2 = self._field_parts(n1, n2, ys, xs)
        return noise - np.float32(6.0) * (ay2 + ax2) > np.float32(TISSUE_THRESHOLD)

    # -- spots ---------------------------------------------------------------------------
    def _place_spots(self) -> list[Spot]:
        """``nests + decoys`` centres in tissue, 2 radii from the border and 6 from each other
        (as the synthetic-slides generator), drawn by rejection from a seeded generator:
        O(spots) time and memory. Nests come first; when the tissue cannot take them all,
        fewer decoys (then fewer nests) are placed, and a slide that takes none still gets
        one spot at its centre (the slide's label is what the placed nests say)."""
        spec = self.spec
        want = spec.nests + spec.decoys
        rad = spec.spot_radius
        rng = np.random.default_rng(np.random.SeedSequence(entropy=spec.seed, spawn_key=(_S_SPOT,)))
        gap2, cell = (6 * rad) ** 2, 6 * rad
        taken: dict[tuple[int, int], list[tuple[float, float]]] = {}
        centres: list[tuple[float, float]] = []
        tries, budget = 0, 20 * want + 4000  # candidates: bounds the time of a spec that asks too much
        while len(centres) < want and tries < budget:
            n = min(4096, 4 * (want - len(centres)) + 16)
            ys = rng.uniform(2 * rad, spec.height - 2 * rad, n).round()
            xs = rng.uniform(2 * rad, spec.width - 2 * rad, n).round()
            ok = self.tissue_points(ys, xs)
            tries += n
            for y, x in zip(ys[ok].tolist(), xs[ok].tolist(), strict=True):
                ky, kx = int(y // cell), int(x // cell)
                near = (p for dy in (-1, 0, 1) for dx in (-1, 0, 1) for p in taken.get((ky + dy, kx + dx), ()))
                if all((y - p[0]) ** 2 + (x - p[1]) ** 2 > gap2 for p in near):
                    taken.setdefault((ky, kx), []).append((y, x))
                    centres.append((y, x))
                    if len(centres) == want:
                        break
        if not centres and want:
            centres = [(float(spec.height // 2), float(spec.width // 2))]
        n_nests = min(spec.nests, len(centres))
        return [Spot(y, x, k < n_nests) for k, (y, x) in enumerate(centres)]

    @property
    def label(self) -> int:
        return int(any(s.nest for s in self.spots))

    def spots_near(self, y0: float, x0: float, y1: float, x1: float, d: int = 1) -> list[int]:
        """Indices (ascending: the global order) of spots whose disc may touch a pixel of
        the level of downsample ``d`` centred in the box (a disc reaches r + d from a pixel
        centre: :func:`_discs`): from the buckets, or from all spots when they are fewer."""
        b, reach = self.bucket, self.spec.spot_radius + d + 1
        by0, by1 = int((y0 - reach) // b), int((y1 + reach) // b)
        bx0, bx1 = int((x0 - reach) // b), int((x1 + reach) // b)
        if (by1 - by0 + 1) * (bx1 - bx0 + 1) > len(self.spots):
            ys, xs = self._rows, self._cols
            hit = (ys > y0 - reach) & (ys < y1 + reach) & (xs > x0 - reach) & (xs < x1 + reach)
            return np.flatnonzero(hit).tolist()
        found = []
        for by in range(by0, by1 + 1):
            for bx in range(bx0, bx1 + 1):
                found += self.index.get((by, bx), ())
        return sorted(found)

    # -- rendering -----------------------------------------------------------------------
    def render(self, row: int, col: int, h: int, w: int, d: int, level: int) -> np.ndarray:
        """[h, w, 3] uint8: rows row.., columns col.. of the level of downsample ``d``
        (index ``level``: the sensor noise's stream). Pixels outside the slide's level are
        rendered too (the caller clips)."""
        d = int(d)
        ys = (np.arange(row, row + h, dtype=np.float64) + 0.5) * d
        xs = (np.arange(col, col + w, dtype=np.float64) + 0.5) * d
        tissue = self.tissue_grid(ys, xs)
        pal = self.palette
        fine = NUCLEUS_CELL >= MEAN_BELOW * d  # scattered nuclei drawn one by one, else as their mean
        keep = 1.0 if fine else 1.0 - math.pi * NUCLEUS_RADIUS ** 2 / NUCLEUS_CELL ** 2
        stroma = pal["stroma"] if fine else (pal["nucleus"] + (pal["stroma"] - pal["nucleus"]) * np.float32(keep))
        # grey: the fibre texture (stronger in tissue; its mean-nuclei share too) and the
        # sensor noise, a hash of (seed, level, row, column): triangular, sigma SENSOR_SIGMA
        amp = 1.7 / math.sqrt(1.0 + (d / FIBRE_CELL) ** 2)
        grey = _grid_noise(self.seed, _S_FIBRE, ys, xs, FIBRE_CELL)
        grey *= np.where(tissue, np.float32(14.0 * amp * keep), np.float32(4.0 * amp))
        hashed = hash32(self.seed, _S_SENSOR, level, np.arange(row, row + h)[:, None], np.arange(col, col + w)[None])
        noise = (hashed & np.uint32(0xFFFF)).astype(np.float32)
        noise += (hashed >> np.uint32(16)).astype(np.float32)
        del hashed
        grey += noise * np.float32(SENSOR_SIGMA * math.sqrt(6) / 65536.0) - np.float32(SENSOR_SIGMA * math.sqrt(6))
        del noise
        img = np.stack([pal["glass"], stroma])[tissue.view(np.uint8)]
        img += grey[..., None]
        del grey
        if fine:
            cover = np.ones((h, w), np.float32)
            cy, cx, rad = self._scattered_nuclei(ys[0], xs[0], ys[-1], xs[-1], d)
            _discs(cover, cy, cx, rad, NUCLEUS_RADIUS, row, col, d)
            _composite(img, cover, pal["nucleus"])
        # nests and decoys, composited in the window their discs touch
        near = self.spots_near(ys[0], xs[0], ys[-1], xs[-1], d)
        if near:
            reach = self.spec.spot_radius + d
            cy, cx = self._rows[near], self._cols[near]
            top = max(row, int((cy.min() - reach) // d) - 1)
            left = max(col, int((cx.min() - reach) // d) - 1)
            bottom = min(row + h, int((cy.max() + reach) // d) + 2)
            right = min(col + w, int((cx.max() + reach) // d) + 2)
            self._spots(img[top - row:bottom - row, left - col:right - col], near, top, left, d)
        img += np.float32(0.5)
        np.clip(img, 0, 255, out=img)
        return img.astype(np.uint8)

    def _spots(self, img: np.ndarray, near: list[int], row: int, col: int, d: int) -> None:
        """Composite the spots ``near`` into ``img`` (rows row.., columns col.. of the level):
        their discs' background, then their nuclei (drawn, or as their mean where a kind's
        nuclei are less than ``MEAN_BELOW`` pixels apart)."""
        h, w = img.shape[:2]
        pal, r = self.palette, self.spec.spot_radius
        cy, cx = self._rows[near], self._cols[near]
        disc = np.ones((h, w), np.float32)
        _discs(disc, cy, cx, np.full(len(near), r), r, row, col, d)
        _composite(img, disc, pal["spot"])
        box = ((row + 0.5) * d, (col + 0.5) * d, (row + h - 0.5) * d, (col + w - 0.5) * d)  # pixel centres
        parts = [self._spot_nuclei(k, d, box) for k in near]
        as_mean = np.array([p is None for p in parts])
        cover = np.ones((h, w), np.float32)
        if as_mean.all():
            mine = disc
        elif as_mean.any():
            mine = np.ones((h, w), np.float32)
            _discs(mine, cy[as_mean], cx[as_mean], np.full(int(as_mean.sum()), r), r, row, col, d)
        else:
            mine = None
        if mine is not None:
            cover = np.float32(1) - (np.float32(1) - mine) * np.float32(SPOT_COVERAGE)
        drawn = [p for p in parts if p is not None and len(p[0])]
        if drawn:
            ny = np.concatenate([p[0] for p in drawn])
            nx = np.concatenate([p[1] for p in drawn])
            nr = np.concatenate([p[2] for p in drawn])
            _discs(cover, ny, nx, nr, float(nr.max()), row, col, d)
        _composite(img, cover, pal["nucleus"])

    def _scattered_nuclei(self, y0: float, x0: float, y1: float, x1: float, d: int):
        """Centres and radii of the scattered nuclei whose disc may touch a pixel centred
        in the box (level-0 coordinates), in the global (cell row-major) order: one per
        grid cell at a hashed offset, kept when that point is tissue."""
        g, reach = NUCLEUS_CELL, NUCLEUS_RADIUS + d + 1
        r0, r1 = int((y0 - reach) // g), int((y1 + reach) // g)
        c0, c1 = int((x0 - reach) // g), int((x1 + reach) // g)
        cells_y, cells_x = np.meshgrid(np.arange(r0, r1 + 1), np.arange(c0, c1 + 1), indexing="ij")
        cells_y, cells_x = cells_y.ravel(), cells_x.ravel()
        h = hash32(self.seed, _S_NUCLEI, cells_y, cells_x)
        cy = cells_y * g + _unit(h).astype(np.float64) * g
        cx = cells_x * g + _unit(_mix(h)).astype(np.float64) * g
        cy, cx = np.round(cy * 4) / 4, np.round(cx * 4) / 4
        keep = self.tissue_points(cy, cx) & (cy >= 0) & (cx >= 0) & (cy < self.spec.height) & (cx < self.spec.width)
        return cy[keep], cx[keep], np.full(int(keep.sum()), NUCLEUS_RADIUS)

    def _spot_nuclei(self, k: int, d: int, box: tuple[float, float, float, float]):
        """Centres and radii of spot ``k``'s nuclei at downsample ``d`` (None: drawn as the
        mean at this level) that may touch a pixel centred in ``box`` (y0, x0, y1, x1,
        level-0 coordinates), in the spot's order. Decoys: round nuclei on a jittered grid;
        nests: fewer, larger ones, each with a small satellite (irregular outlines).

        Only the grid points near the box are made: a spot's nuclei number (2 r /
        spacing)^2, gigabytes for one 64x64 patch on a large spot, and
        terabytes at the largest radius a spec allows, so the memory and time of a read
        are set by its pixels, never by the spot. A nucleus is a function of its grid
        indices, so the ones made are those a whole-spot grid would hold there."""
        s, rad = self.spots[k], self.spec.spot_radius
        spacing = NEST_SPACING if s.nest else DECOY_SPACING
        if spacing < MEAN_BELOW * d:
            return None
        n = math.ceil((rad + 1 - -rad) / spacing)  # len(np.arange(-rad, rad + 1, spacing)), as numpy counts it
        # a grid point's nuclei lie within spacing/4 (jitter) + 6 (the largest nucleus, or a
        # satellite 3 off with radius 2.5) of it, and touch pixel centres within that + d
        margin = spacing / 4 + max(NEST_RADII[1], 3 + SATELLITE_RADIUS) + d + 1

        def indices(lo: float, hi: float, centre: float) -> np.ndarray:
            first = max(0, math.floor((lo - margin - centre + rad) / spacing))
            return np.arange(first, max(first, min(n, math.ceil((hi + margin - centre + rad) / spacing) + 1)))

        rows, cols = indices(box[0], box[2], s.row), indices(box[1], box[3], s.col)
        ii, jj = np.meshgrid(rows, cols, indexing="ij")
        step = (-rad + spacing) - -rad  # np.arange's values: start + i * (its second value - start)
        gy, gx = -rad + ii * step, -rad + jj * step
        h = hash32(self.seed, _S_SPOT, k, ii.ravel(), jj.ravel())
        py = gy.ravel() + (_unit(h).astype(np.float64) - 0.5) * spacing / 2
        px = gx.ravel() + (_unit(_mix(h)).astype(np.float64) - 0.5) * spacing / 2
        keep = py ** 2 + px ** 2 <= (rad - spacing / 3) ** 2
        py, px, h = py[keep] + s.row, px[keep] + s.col, h[keep]
        if not s.nest:
            return py, px, np.full(len(py), DECOY_RADIUS)
        h2 = _mix(h ^ np.uint32(0x5BD1E995))
        radius = NEST_RADII[0] + _unit(h2).astype(np.float64) * (NEST_RADII[1] - NEST_RADII[0])
        sy = py + np.floor(_unit(_mix(h2)).astype(np.float64) * 7) - 3
        sx = px + np.floor(_unit(_mix(_mix(h2))).astype(np.float64) * 7) - 3
        order = np.stack([np.arange(len(py)) * 2, np.arange(len(py)) * 2 + 1], 1).ravel()
        ys, xs = np.empty(2 * len(py)), np.empty(2 * len(py))
        rs = np.empty(2 * len(py))
        ys[order[0::2]], ys[order[1::2]] = py, sy
        xs[order[0::2]], xs[order[1::2]] = px, sx
        rs[order[0::2]], rs[order[1::2]] = radius, SATELLITE_RADIUS
        return ys, xs, rs


def _palette(stain: tuple[float, float]) -> dict[str, np.ndarray]:
    """The base colours, their haematoxylin and eosin amounts scaled by ``stain`` (the
    colour-deconvolution model of :mod:`ats_cli.augment`): the stain is in the tissue,
    so the texture and noise added after it are the camera's."""
    names = ("glass", "stroma", "nucleus", "spot")
    colours = np.array([GLASS, STROMA, NUCLEUS, SPOT_BACKGROUND], np.float32)
    if tuple(stain) != (1.0, 1.0):
        import torch

        from ats_cli.augment import hed_jitter

        img = torch.from_numpy(colours / 255.0).T[None, :, :, None]  # [1, 3, 4, 1]
        alpha = torch.tensor([[stain[0], stain[1], 1.0]], dtype=torch.float32)
        colours = (hed_jitter(img, alpha, torch.zeros(1, 3))[0, :, :, 0].T.numpy() * 255.0).astype(np.float32)
    return {n: colours[i] for i, n in enumerate(names)}


def _discs(cover: np.ndarray, cy, cx, radii, r_max: float, row: int, col: int, d: int) -> None:
    """Multiply ``cover`` [h, w] (rows row.., columns col.. of the level of downsample
    ``d``) by (1 - coverage) of each disc (centres and radii in level-0 pixels), in the
    discs' order (the module docstring's coverage)."""
    h, w = cover.shape
    if len(cy) == 0 or h == 0 or w == 0:
        return
    cy, cx, radii = (np.asarray(a, np.float64) for a in (cy, cx, radii))
    span = int(math.ceil((2 * r_max + 2 * d) / d)) + 1
    # Each disc is computed on the pixels its span shares with the window, in a box of
    # at most the window's size placed over them: a disc wider than the window (a spot of
    # radius 4,000 read by a 64x64 patch) costs the window's pixels, not its own. Pixels
    # outside a disc's span have no coverage, so the pixels are the whole-disc ones.
    sh, sw = min(span, h), min(span, w)
    top = np.floor((cy - r_max - d) / d).astype(np.int64)
    left = np.floor((cx - r_max - d) / d).astype(np.int64)
    top = np.minimum(np.maximum(top, row), row + h - sh)
    left = np.minimum(np.maximum(left, col), col + w - sw)
    per = max(1, DISC_BLOCK // (sh * sw))  # discs at a time: memory bounded, their order kept
    for k in range(0, len(cy), per):
        part = slice(k, k + per)
        _disc_block(cover, cy[part], cx[part], radii[part], top[part], left[part], sh, sw, row, col, d)


def _disc_block(cover: np.ndarray, cy, cx, radii, top, left, sh: int, sw: int, row: int, col: int, d: int) -> None:
    """:func:`_discs` for a block of discs, each on the ``sh`` x ``sw`` level pixels from
    (``top``, ``left``)."""
    h, w = cover.shape
    rows = top[:, None] + np.arange(sh)  # [n, sh] level pixel rows
    cols = left[:, None] + np.arange(sw)
    py = ((rows + 0.5) * d - cy[:, None]).astype(np.float32)  # pixel centre minus disc centre
    px = ((cols + 0.5) * d - cx[:, None]).astype(np.float32)
    r = radii.astype(np.float32)[:, None, None]
    dist = np.sqrt(py[:, :, None] * py[:, :, None] + px[:, None, :] * px[:, None, :])
    fd = np.float32(d)
    reach = np.maximum(r, fd / 2)  # a disc narrower than the pixel spreads over a pixel's width
    # the ramp's integral is pi ((R/d)^2 + 1/12) pixels: scaled to the disc's pi (r/d)^2
    rho2 = (reach / fd) * (reach / fd)
    cov = np.clip((reach - dist) / fd + np.float32(0.5), 0, 1) * ((r / fd) * (r / fd) / (rho2 + np.float32(1 / 12)))
    inside = ((rows >= row) & (rows < row + h))[:, :, None] & ((cols >= col) & (cols < col + w))[:, None, :]
    inside &= cov > 0
    n_idx, i_idx, j_idx = np.nonzero(inside)  # C order: disc by disc, the global order kept
    flat = (rows[n_idx, i_idx] - row) * w + (cols[n_idx, j_idx] - col)
    np.multiply.at(cover.reshape(-1), flat, np.float32(1) - cov[n_idx, i_idx, j_idx])


def _composite(img: np.ndarray, transmit: np.ndarray, colour: np.ndarray) -> None:
    """``img = colour + (img - colour) * transmit``, in place ([h, w, 3], [h, w])."""
    img -= colour
    img *= transmit[..., None]
    img += colour


# ---------------------------------------------------------------------------- honest files


def level_sizes(spec: VirtualSlideSpec) -> list[tuple[int, int]]:
    """(H, W) of each level: ``floor(side / d)``, as a pyramid's reduced levels are."""
    return [(spec.height // d, spec.width // d) for d in spec.downsamples]


def write_virtual_tiff(spec_path: str | os.PathLike[str] | VirtualSlideSpec, out: str | os.PathLike[str], *,
                       tile: int = 256,
                       compression: str = "zlib") -> None:
    """Render the virtual slide ``spec_path`` into a real pyramidal TIFF ``out``: one IFD
    per level of the spec (the reduced ones ``subfiletype=1``, so OpenSlide and tifffile
    read them as levels), ``tile`` x ``tile`` tiles, losslessly compressed, the spec's
    mpp in the resolution tags. Every level is the virtual slide's own rendering of it,
    one band of tiles at a time (memory: one band), so the file's pixels are the virtual
    reader's exactly. Written atomically."""
    import tifffile

    from ats_cli.io import atomic_path

    spec = spec_path if isinstance(spec_path, VirtualSlideSpec) else load_spec(spec_path)
    slide = VirtualSlide(spec)
    levels = level_sizes(spec)
    H0, W0 = levels[0]
    res = 1e4 / spec.mpp  # pixels per centimetre

    def tiles(level: int):
        H, W = levels[level]
        for r in range(0, H, tile):
            band = np.zeros((tile, -(-W // tile) * tile, 3), np.uint8)  # zeros past the edges
            n = min(tile, H - r)
            band[:n, :W] = slide.render(r, 0, n, W, spec.downsamples[level], level)
            for c in range(0, W, tile):
                yield np.ascontiguousarray(band[:, c:c + tile])

    with atomic_path(out) as tmp, tifffile.TiffWriter(tmp, bigtiff=H0 * W0 * 3 > 2**31) as tif:
        for level, (H, W) in enumerate(levels):
            d = spec.downsamples[level]
            tif.write(tiles(level), shape=(H, W, 3), dtype=np.uint8, tile=(tile, tile), photometric="rgb",
                      compression=compression, subfiletype=1 if level else 0, resolution=(res / d, res / d),
                      resolutionunit="CENTIMETER", metadata=None)


# ---------------------------------------------------------------------------- datasets


def slide_spec(config, split: str, index: int) -> VirtualSlideSpec:
    """The spec of slide ``index`` of ``split`` for ``config`` (a
    :class:`~ats_cli.data.synthetic_slides.SyntheticSlidesConfig`): the synthetic-slides
    task at the same level-0 sizes: ``tumor`` (odd indices) slides carry 1..max_targets
    nests among ``n_spots`` spots, ``normal`` ones only decoys; the slide's seed and stain
    factors come from ``SeedSequence(seed + 1 (train) or seed (test), spawn_key=(index,))``
    and its stain stream, as the TIFF generator draws them."""
    from ats_cli.data.synthetic_slides import STAIN_STREAM, _rng

    rng = _rng(config.seed, split, index)
    nests = int(rng.integers(1, config.max_targets + 1)) if index % 2 else 0
    stain = (1.0, 1.0)
    if config.stain_jitter:
        s = config.stain_jitter
        stain = tuple(float(v) for v in _rng(config.seed, split, index, STAIN_STREAM).uniform(1 - s, 1 + s, size=2))
    return VirtualSlideSpec(width=config.size, height=config.size, seed=int(rng.integers(0, 2**32)),
                            mpp=config.mpp, downsamples=tuple(default_downsamples(config.size, config.size)),
                            nests=nests, decoys=config.n_spots - nests, spot_radius=float(config.spot_radius),
                            stain=stain, extra={"split": split, "index": index})


def csv_row(path: str, slide: VirtualSlide) -> dict[str, str]:
    """The dataset row of a virtual slide: its label from the nests placed, their boxes."""
    from ats_cli.data.synthetic_slides import CLASSES

    r = slide.spec.spot_radius
    boxes = [["tumor", round(s.row - r), round(s.col - r), round(2 * r), round(2 * r)]
             for s in sorted(slide.spots, key=lambda s: (s.row, s.col)) if s.nest]
    return {"path": path, "label": CLASSES[slide.label], "boxes": json.dumps(boxes, separators=(",", ":")),
            "n_targets": str(len(boxes))}


@dataclass
class _SpecJob:
    config: Any
    out: Path
    name_width: int
    tiff: bool = False  # write each slide rendered as a real TIFF instead of its spec

    def run_chunk(self, split: str, indices) -> list[tuple[int, dict[str, str], bool]]:
        from ats_cli.data.synthetic_slides import _is_complete

        results = []
        for index in indices:
            rel = f"{split}/{index:0{self.name_width}d}{'.tif' if self.tiff else VIRTUAL_SUFFIX}"
            spec = slide_spec(self.config, split, index)
            path = self.out / rel
            if self.tiff:
                wrote = not _is_complete(path)
                if wrote:
                    write_virtual_tiff(spec, path)
                results.append((index, csv_row(rel, VirtualSlide(spec)), wrote))
                continue
            try:
                wrote = load_spec(path) != spec
            except (VirtualSlideError, FileNotFoundError):
                wrote = True
            if wrote:
                write_spec(path, spec)
            results.append((index, csv_row(rel, VirtualSlide(spec)), wrote))
        return results


def fingerprint(config, tiff: bool = False) -> dict[str, Any]:
    """What ``dataset.json`` records of the generator: the synthetic-slides parameters and
    that the slides are virtual, or virtual ones rendered into TIFFs (a directory of one
    kind is not resumed with another)."""
    kind = {"virtual": True, **({"tiff": True} if tiff else {})}
    return {"name": "synthetic-slides", "version": VERSION, "params": {**config.params(), **kind},
            "seeding": "image i of a split: numpy SeedSequence(entropy=seed+1 for train / seed for test, "
                       "spawn_key=(i,)); its spec's seed is that generator's first 32-bit draw",
            "format": f"{FORMAT} {VERSION} ({VIRTUAL_SUFFIX})"}


def check_virtual_output(out: str | os.PathLike[str], config, tiff: bool = False) -> None:
    """Refuse early (DatasetError) an output directory that cannot receive this run."""
    from ats_cli.data.generation import check_output

    check_output(out, fingerprint(config, tiff))


def generate_virtual_slides(out: str | os.PathLike[str], config, *, workers: int | None = None, progress=None,
                            tiff: bool = False):
    """``ats make-dataset synthetic-slides --virtual``: a dataset of virtual slides (spec
    files, one per slide, rendered when read), with the CSVs and ``dataset.json`` of the
    TIFF generator; resumable, like it (:mod:`ats_cli.data.generation`). ``tiff``
    (``--virtual --tiff``): the same slides rendered into real pyramidal TIFFs
    (:func:`write_virtual_tiff`: the same pixels, lossless), e.g. to test a model trained on
    virtual slides on files."""
    from ats_cli.data.generation import run_generation
    from ats_cli.data.synthetic_slides import CLASSES, RECIPE

    config.validate()
    out = Path(out).expanduser()
    job = _SpecJob(config, out, max(4, len(str(max(config.n_train, config.n_test) - 1))), tiff)
    hints = {**config.hints(), "image_size": [config.size, config.size]}
    return run_generation(
        out, fingerprint(config, tiff), job, {"train": config.n_train, "test": config.n_test},
        dataset={"classes": CLASSES, "hints": hints, "recipe": RECIPE,
                 "description": f"virtual synthetic slides ({config.size}x{config.size}, "
                                + ("rendered into lossless pyramidal TIFFs" if tiff else
                                   f"rendered on demand from {VIRTUAL_SUFFIX} specs")
                                + f"; {config.n_spots} cell clusters; tumor = 1-"
                                f"{config.max_targets} of them are tumour nests)"},
        workers=workers, chunk_size=1 if tiff else 16, progress=progress, source="generated",
    )
