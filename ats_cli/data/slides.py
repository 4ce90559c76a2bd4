"""Lazy readers for whole-slide and very large images behind one surface: ``open_image``.

Attention sampling needs a low-resolution view and n patches, never the whole
full-resolution image, so a reader here never decodes level 0 whole: the low-res view
comes from the smallest pyramid level that is still large enough, and patches are
decoded tile by tile at the sampled positions only. Memory is therefore set by the
low-res view and the patches, not by the slide.

Every reader implements the core's ``PatchSource`` (``size``, ``channels``,
``read_patches``), so the model reads a slide exactly as it reads an in-memory tensor.

Backends, chosen by ``open_image`` from the suffix table of :mod:`ats_cli.data.dataset`
unless ``reader=`` forces one:

- ``openslide``: vendor formats (svs, ndpi, mrxs, scn, vms, bif, Philips TIFF, DICOM),
  tried first for those suffixes and for TIFFs OpenSlide recognises (e.g. Aperio).
- ``tifffile``: OME-TIFF, pyramidal TIFF (separate IFDs or SubIFDs) and large
  non-pyramidal tiled/stripped TIFF; reads only the tiles/strips a region touches. What
  a TIFF holds (levels, pixel size, which samples are colour, its codec) is decided in
  :mod:`ats_cli.data.tiff_meta`, which refuses by name what would otherwise be read
  wrongly: more than gray or RGB channels, samples wider than 8 bits, a missing codec.
- ``pillow``: PNG/JPEG/BMP/GIF/WebP/..., read whole by the one PIL decoder
  (:func:`ats_cli.data.images.decode_pil`) with an explicit pixel limit (``max_pixels``)
  instead of switching the decompression-bomb guard off.
- ``omezarr``: an OME-Zarr store (a ``.zarr`` directory; NGFF 0.4/0.5 multiscales), read
  chunk by chunk: :mod:`ats_cli.data.omezarr`.
- ``array``: an in-memory [H, W, C] uint8 array (tests, generated data).

Bounded memory: every reader has a pixel budget (``max_pixels``: ``--max-pixels``, else
``ATS_MAX_PIXELS``, else 64 M pixels; :func:`ats_cli.data.images.max_pixels_limit`)
checked from the header before decoding: a PNG/JPEG decoded whole, the pyramid level
the low-res view is made from, the view itself (a level resampled to the model's
microns per pixel can ask for a view larger than any level of the file), one resampled
patch's footprint and one TIFF strip or tile must each fit in it, or the read is refused
with a message naming the file, the size, the limit and how to raise it. The microns
per pixel that sizes a resampled level is checked first
(:mod:`ats_cli.data.dataset`). The level read for the low-res view is decoded and resized band by band, so it is
never held in float whole.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ats_cli.core.source import thread_pool
from ats_cli.data.dataset import OMEZARR, OPENSLIDE, PILLOW, TIFFFILE, VIRTUAL, backend, mpp_problem
from ats_cli.data.images import (
    DEFAULT_MAX_PIXELS,
    ImageReadError,
    RemoteReadError,
    decode_pil,
    max_pixels_limit,
    over_budget,
    resize_in_bands,
)
from ats_cli.data.remote import input_path, is_url, url_name
from ats_cli.data.tiff_meta import (
    APERIO_JP2K_YCBCR,
    aperio_ycbcr_to_rgb,
    codec_message,
    codec_problem,
    colour_samples,
    level_pages,
    not_a_microscope_scale,
    tiff_mpp_source,
)

__all__ = ["SlideReadError", "SlideInfo", "SlideReader", "open_image", "tissue_mask", "choose_level", "READERS",
           "MPP_TOLERANCE", "VirtualSlideReader"]

READERS = ("auto", OPENSLIDE, TIFFFILE, PILLOW)  # --reader's choices; "virtual" is chosen by the .vslide.json suffix
# Two pixel sizes closer than this (relative) are the same magnification: scanners record
# 0.2520 or 0.2527 um/px for "0.25", and a 5% change of scale is within the variation the
# model already sees between slides. Such a level is read as it is, never resampled.
MPP_TOLERANCE = 0.05
PARALLEL_SEGMENT_PIXELS = 4_000_000  # larger strips/tiles are decoded one patch at a time (memory)
READ_BUDGET_BYTES = 256 << 20  # decoded segments held at once by one read_patches call


class SlideReadError(ImageReadError):
    """A slide or large image that cannot be read; the message names the file and the problem."""


def _too_big(path, what: str, pixels: int, limit: int) -> SlideReadError:
    return SlideReadError(path, over_budget(path, what, pixels, limit).problem)


@dataclass(frozen=True)
class SlideInfo:
    """What ``ats info`` prints: enough to choose --level/--mpp and to spot a wrong file."""

    path: str
    reader: str
    vendor: str
    dimensions: tuple[int, int]  # (H, W) at level 0
    levels: tuple[tuple[int, int], ...]  # (H, W) per level, level 0 first
    downsamples: tuple[float, ...]
    mpp: tuple[float, float] | None  # microns per pixel (y, x) at level 0, when the file says
    channels: int
    scale_unknown: str = ""  # why what the file records is no scale (SlideReader.record_scale); "": it is one


class SlideReader:
    """Base class: a multi-resolution image read lazily. Subclasses implement ``_read_region``.

    Coordinates are (row, col) in level-0 pixels everywhere in the public API, as in the
    core's geometry; ``level`` picks which pyramid level pixels come from.
    """

    name = "base"
    max_pixels = DEFAULT_MAX_PIXELS  # the pixel budget (module docstring); open_image sets it

    def __init__(self, path: Path | str, levels: list[tuple[int, int]], channels: int, vendor: str, mpp=None):
        self.path = input_path(path)  # a URL stays the URL string (ats_cli.data.remote)
        self.levels = [tuple(int(v) for v in lv) for lv in levels]
        self._channels = channels
        self.vendor = vendor
        self.mpp = mpp
        self.mpp_source = "its metadata"  # where ``mpp`` was read (a tag, a property), for messages
        self.scale_unknown = ""  # why the pixel size the file records is not its scale (record_scale)
        self.level = 0  # level read_patches reads from (set by --level / --mpp)
        self.factor = 1.0  # pixels of that level per pixel handed out (match_mpp): 1 = read as it is
        self._out_channels = channels

    # -- PatchSource -------------------------------------------------------------------
    @property
    def size(self) -> tuple[int, int]:
        """Size of the level patches are read from, resampled by ``factor`` (match_mpp):
        the model's "full resolution"."""
        H, W = self.levels[self.level]
        if self.factor == 1.0:
            return H, W
        return max(1, round(H / self.factor)), max(1, round(W / self.factor))

    @property
    def channels(self) -> int:
        return self._out_channels

    def as_channels(self, channels: int) -> SlideReader:
        """Hand out ``channels`` (the model's) instead of the file's: gray -> RGB replicates;
        RGB -> gray is refused, as for ordinary images, since the model never saw colour."""
        if channels == self._channels or (channels == 3 and self._channels == 1):
            self._out_channels = channels
            return self
        raise SlideReadError(self.path, f"has {self._channels} channels, the model expects {channels}")

    def read_patches(self, offsets: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """Patches [n, C, h, w] uint8 at ``offsets`` [n, 2] (row, col) in ``self.level``
        pixels; zeros outside the image. Regions are decoded concurrently (decoders release
        the GIL), each touching only the tiles it overlaps."""
        h, w = int(size[0]), int(size[1])
        offs = [(int(r), int(c)) for r, c in offsets.tolist()]
        f = self.factor
        if f != 1.0:  # the patch's footprint in the level's pixels, resized to (h, w) below
            offs = [(round(r * f), round(c * f)) for r, c in offs]
            rh, rw = max(1, round(h * f)), max(1, round(w * f))
            if rh * rw > self.max_pixels:
                raise _too_big(self.path, f"a {w}x{h} patch resampled by {f:.3g} reads {rw}x{rh} pixels of level "
                               f"{self.level}", rh * rw, self.max_pixels)
        else:
            rh, rw = h, w
        if not offs:
            return torch.zeros((0, self.channels, h, w), dtype=torch.uint8)
        # in tile order (row-major position): neighbours share tiles and a backend's cache
        order = sorted(range(len(offs)), key=offs.__getitem__)
        parts = [None] * len(offs)
        for k, part in zip(order, self._read_regions([offs[k] for k in order], rh, rw, self.level), strict=True):
            parts[k] = part
        out = torch.from_numpy(np.stack(parts).transpose(0, 3, 1, 2).copy())
        if (rh, rw) != (h, w):
            out = _resample(out, (h, w))
        return out

    # -- multi-resolution --------------------------------------------------------------
    @property
    def dimensions(self) -> tuple[int, int]:
        return self.levels[0]

    @property
    def downsamples(self) -> list[float]:
        h0, w0 = self.levels[0]
        return [(h0 / h + w0 / w) / 2 for h, w in self.levels]

    @property
    def level_mpps(self) -> list[float] | None:
        """Microns per pixel of each level (the mean of y and x), or None when the file does not say."""
        if self.mpp is None:
            return None
        base = (self.mpp[0] + self.mpp[1]) / 2
        return [base * d for d in self.downsamples]

    @property
    def patch_downsample(self) -> float:
        """Level-0 pixels per pixel handed out: the level's downsample times ``factor``."""
        return float(self.downsamples[self.level]) * self.factor

    @property
    def pixel_mpp(self) -> float | None:
        """Microns per pixel handed out (patches' and, at the model's scale, the view's), if known."""
        mpps = self.level_mpps
        return None if mpps is None else mpps[self.level] * self.factor

    def record_scale(self, mpp: tuple[float, float] | None, source: str, per_inch: float | None = None) -> None:
        """Take ``mpp`` (y, x µm, read from ``source``; ``per_inch``: the resolution tags'
        density when read from them) as the file's scale, or, when it is none
        (:func:`~ats_cli.data.tiff_meta.not_a_microscope_scale`: a tool's 72 dpi), record
        no scale and why: the file is then read as it is, as one that records nothing, and
        ``ats info`` and the reading note say why in one line."""
        why = not_a_microscope_scale(mpp, source, per_inch) if mpp is not None else None
        self.mpp, self.scale_unknown = (None, why) if why else (mpp, "")
        self.mpp_source = source or self.mpp_source

    def plausible_mpps(self) -> list[float] | None:
        """:attr:`level_mpps`, once the file's microns per pixel is known to be a
        microscope's (:mod:`ats_cli.data.dataset`): the resampling factor and every
        size after it follow from it. The readers record no scale for one that is not
        (:meth:`record_scale`); this guards a reader that sets ``mpp`` itself, raising
        :class:`SlideReadError` naming the value and where it was read."""
        mpps = self.level_mpps
        if self.mpp is not None and (problem := mpp_problem((self.mpp[0] + self.mpp[1]) / 2)):
            value = (self.mpp[0] + self.mpp[1]) / 2
            raise SlideReadError(self.path, f"records {value:.4g} µm/px ({self.mpp_source}), {problem}; correct the "
                                 "file's metadata (ats predict/visualize: --mpp 0 reads it as it is)")
        return mpps

    def match_mpp(self, mpp: float) -> None:
        """Hand out pixels of ``mpp`` microns: read from the coarsest level at or below
        ``mpp`` (:func:`choose_level`) and resample patches (and the low-res view, made
        from ``size``) by the remaining factor, so that a patch covers the same tissue on
        a 40x and a 20x scan. Raises :class:`SlideReadError` when the file records no mpp,
        or when its mpp or ``mpp`` (the model's, or --mpp) is out of the plausible range
        (:mod:`ats_cli.data.dataset`), before anything is read."""
        if problem := mpp_problem(mpp):
            raise SlideReadError(self.path, f"cannot be read at {mpp:.4g} µm/px (the model's or --mpp): {problem}")
        mpps = self.plausible_mpps()
        if mpps is None:
            raise SlideReadError(self.path, "the file records no microns per pixel, so it cannot be read at "
                                 f"{mpp:g} µm/px")
        self.level, self.factor = choose_level(mpps, mpp)

    def set_level(self, level: int | None = None, mpp: float | None = None) -> None:
        """Choose the level patches come from: explicitly, or the one closest to ``mpp``
        (read as it is, not resampled: :meth:`match_mpp` resamples)."""
        if level is not None and mpp is not None:
            raise ValueError("give a level or an mpp, not both")
        if mpp is not None:
            if self.mpp is None:
                raise SlideReadError(self.path, "the file records no microns per pixel, so --mpp cannot be used")
            self.plausible_mpps()
            base = (self.mpp[0] + self.mpp[1]) / 2
            level = int(np.argmin([abs(np.log(base * d / mpp)) for d in self.downsamples]))
        level = 0 if level is None else int(level)
        if not 0 <= level < len(self.levels):
            raise SlideReadError(self.path, f"has {len(self.levels)} levels, level {level} does not exist")
        self.level, self.factor = level, 1.0

    def _read_regions(self, offs: list[tuple[int, int]], h: int, w: int, level: int) -> list[np.ndarray]:
        """:meth:`read_region` at each of ``offs`` (in tile order), concurrently on the
        shared reading threads (decoders release the GIL); one at a time where a segment is
        so large that several decoded at once would take too much memory."""
        if self._segment_pixels(level) > PARALLEL_SEGMENT_PIXELS or len(offs) == 1:
            return [self.read_region(r, c, h, w, level) for r, c in offs]
        return list(thread_pool("tiles").map(lambda rc: self.read_region(rc[0], rc[1], h, w, level), offs))

    def read_region(self, row: int, col: int, h: int, w: int, level: int = 0, segments=None) -> np.ndarray:
        """[h, w, C] uint8 of ``level`` starting at (row, col) in that level's pixels;
        zeros where the region leaves the image. May be a read-only view (of a decoded
        strip or tile): copy it before writing to it. ``segments``: a reader's segments
        already decoded (:meth:`TiffReader._read_regions`), else it decodes what it needs."""
        H, W = self.levels[level]
        more = {} if segments is None else {"segments": segments}
        r0, c0, r1, c1 = max(row, 0), max(col, 0), min(row + h, H), min(col + w, W)
        if (r0, c0, r1, c1) == (row, col, row + h, col + w):  # inside the image: no second copy
            region = self._read_region(row, col, h, w, level, **more)
            if region.shape[2] == self.channels:
                return region
        out = np.zeros((h, w, self.channels), dtype=np.uint8)
        if r1 > r0 and c1 > c0:
            out[r0 - row : r1 - row, c0 - col : c1 - col] = self._read_region(r0, c0, r1 - r0, c1 - c0, level, **more)
        return out  # a 1-channel region broadcasts into 3 channels when as_channels(3) asked for it

    def low_res(self, size: tuple[int, int]) -> np.ndarray:
        """The whole image resized to ``size`` (H, W), [H, W, C] uint8, read from the smallest
        level at least that large (never level 0 unless nothing smaller suffices). Resizing is
        the core's antialiased bilinear (as ``low_res_view``), so a slide's view matches what
        the model saw in training on in-memory images. That level must fit in the pixel
        budget; it is read and resized band by band (``resize_in_bands``: bit for bit the
        same as resizing it whole)."""
        th, tw = int(size[0]), int(size[1])
        level = self.view_level(size)
        H, W = self.levels[level]
        if H * W > self.max_pixels:
            raise _too_big(self.path, f"level {level} ({W}x{H}, the smallest the {tw}x{th} low-res view can be made "
                           "from)", H * W, self.max_pixels)
        # the view itself, and the band resize's intermediate (the level's rows at the
        # view's width), are allocated too: a resampled level (match_mpp) may ask for a
        # view larger than any level of the file
        for what, pixels in ((f"the {tw}x{th} low-res view", th * tw),
                             (f"the {tw}x{th} low-res view (resized from level {level}, {W}x{H})", H * tw)):
            if pixels > self.max_pixels:
                raise _too_big(self.path, what, pixels, self.max_pixels)
        if (H, W) == (th, tw):
            return np.require(self.read_region(0, 0, H, W, level), requirements="W")

        def rows(r0: int, r1: int) -> torch.Tensor:
            band = self.read_region(r0, 0, r1 - r0, W, level)  # may be a read-only view of a decoded strip
            with warnings.catch_warnings():  # only read (converted to float), never written: no copy needed
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(band).permute(2, 0, 1)

        small = resize_in_bands(rows, (self.channels, H, W), (th, tw), align=self._segment_rows(level))
        return small.permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()

    def view_level(self, size: tuple[int, int]) -> int:
        """The level :meth:`low_res` makes a view of ``size`` (H, W) from: the smallest at
        least that large, else level 0."""
        th, tw = int(size[0]), int(size[1])
        ok = [i for i, (h, w) in enumerate(self.levels) if h >= th and w >= tw]
        return min(ok, key=lambda i: self.levels[i][0] * self.levels[i][1]) if ok else 0

    def low_res_view(self, scale: float) -> torch.Tensor:
        """The model's low-res view [C, h, w] float in [0, 1] of the patch level at ``scale``,
        the same size ``core.source.low_res_size`` gives an in-memory image of that size."""
        from ats_cli.core.source import low_res_size

        view = self.low_res(low_res_size(self.size, scale))
        return torch.from_numpy(view.copy()).permute(2, 0, 1).float() / 255.0

    def read_view(self, offsets: torch.Tensor, size: tuple[int, int], view_size: tuple[int, int]) -> torch.Tensor:
        """Views [n, C, vh, vw] (float, [0, 1]) of the regions of ``size`` at ``offsets`` [n, 2]
        (row, col; both in the pixels :meth:`read_patches` hands out), each resized to
        ``view_size``: a two-level model's region views (:mod:`ats_cli.core.nested_model`).
        Each is read from the coarsest pyramid level at least as fine as the view, so its cost
        is set by the view, not by the region's size at full resolution; zeros outside."""
        h, w = int(size[0]), int(size[1])
        d = self.patch_downsample  # level-0 pixels per pixel handed out
        need = min(h / view_size[0], w / view_size[1]) * d  # level-0 pixels per view pixel
        downs = self.downsamples
        level = max((i for i, ds in enumerate(downs) if ds <= need * (1 + 1e-6)), key=lambda i: downs[i], default=0)
        s = d / downs[level]  # pixels of that level per pixel handed out
        rh, rw = max(1, round(h * s)), max(1, round(w * s))
        if rh * rw > self.max_pixels:
            raise _too_big(self.path, f"a {w}x{h} region read from level {level}", rh * rw, self.max_pixels)
        offs = [(round(r * s), round(c * s)) for r, c in offsets.tolist()]
        parts = self._read_regions(offs, rh, rw, level)
        x = torch.from_numpy(np.stack(parts).transpose(0, 3, 1, 2).copy()).float() / 255.0
        if (rh, rw) == tuple(view_size):
            return x
        return torch.nn.functional.interpolate(x, size=tuple(view_size), mode="bilinear", align_corners=False,
                                               antialias=True)

    def thumbnail(self, max_side: int = 1024) -> np.ndarray:
        H, W = self.dimensions
        s = min(1.0, max_side / max(H, W))
        return self.low_res((max(1, round(H * s)), max(1, round(W * s))))

    def info(self) -> SlideInfo:
        return SlideInfo(
            path=str(self.path), reader=self.name, vendor=self.vendor, dimensions=self.dimensions,
            levels=tuple(self.levels), downsamples=tuple(round(d, 4) for d in self.downsamples),
            mpp=self.mpp, channels=self.channels, scale_unknown=self.scale_unknown,
        )

    def close(self) -> None:
        pass

    def __reduce__(self):
        """Pickle as "reopen this file": a DataLoader worker opens a slide to make its
        low-res view and hands the reader to the training process, which cannot receive an
        open file handle. The receiving process reopens the file once and keeps it open
        (:func:`_reopen` caches readers per process), so later batches pay nothing."""
        return _reopen, (self.name, str(self.path), self.level, self._out_channels, self.max_pixels, self.factor)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read_region(self, row: int, col: int, h: int, w: int, level: int) -> np.ndarray:
        raise NotImplementedError

    def _segment_rows(self, level: int) -> int:
        """Rows of the unit the file is decoded in at ``level`` (a TIFF strip or tile)."""
        return 1

    def _segment_pixels(self, level: int) -> int:
        """Pixels of one such unit (0: no units, e.g. in memory)."""
        return 0


def _resample(patches: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 patches [n, C, H, W] resized to ``size``: down by area averaging, as a coarser
    pyramid level is made (and as a coarser sensor pixel integrates the light over its
    area), so a 40x scan resampled 2x gives a 20x level's pixels; up (a file coarser than
    the model) bilinearly. An antialiased bilinear filter, the low-res view's, would blur
    the patch further than the coarser scan is blurred: measured on the released
    synthetic-slides model, it moved normal slides towards tumor (docs/slides.md)."""
    x = patches.float()
    if size[0] <= patches.shape[-2] and size[1] <= patches.shape[-1]:
        x = torch.nn.functional.interpolate(x, size=size, mode="area")
    else:
        x = torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8)


def _to_rgb_or_gray(arr: np.ndarray) -> np.ndarray:
    """[h, w, C] uint8 with C in (1, 3): alpha dropped, 2-channel gray+alpha -> gray."""
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.shape[2] == 4:
        arr = arr[:, :, :3]
    elif arr.shape[2] == 2:
        arr = arr[:, :, :1]
    return arr


class ArrayReader(SlideReader):
    """An in-memory [H, W, C] uint8 image; optional coarser levels made by the caller."""

    name = "array"

    def __init__(self, image: np.ndarray, path: str | os.PathLike[str] = "<array>", levels_data=None):
        image = _to_rgb_or_gray(np.asarray(image))
        if image.dtype != np.uint8:
            raise SlideReadError(path, f"array reader needs uint8, got {image.dtype}")
        self._data = [image] + [_to_rgb_or_gray(np.asarray(x)) for x in (levels_data or [])]
        super().__init__(path, [d.shape[:2] for d in self._data], image.shape[2], "array")

    def _read_region(self, row, col, h, w, level):
        return self._data[level][row : row + h, col : col + w].copy()

    def __reduce__(self):
        raise TypeError(f"{self.name} readers hold their pixels in memory; pass the image tensor instead")


class PillowReader(ArrayReader):
    """PNG/JPEG/... decoded whole by :func:`ats_cli.data.images.decode_pil`, under the
    pixel budget (checked from the header, before decoding) rather than no limit."""

    name = PILLOW

    def __init__(self, path: Path | str, max_pixels: int | None = None):
        limit = max_pixels_limit(max_pixels)
        try:
            arr = decode_pil(path, limit)
        except ImageReadError as e:
            raise SlideReadError(e.path, e.problem) from e.__cause__
        super().__init__(arr, path)
        self.vendor = "image"
        self.max_pixels = limit


class TiffReader(SlideReader):
    """TIFF / OME-TIFF / pyramidal TIFF via tifffile, decoding only the segments (tiles or
    strips) a region overlaps. No zarr needed: segment offsets come from the IFD and
    ``TiffPage.decode`` decodes one segment at a time."""

    name = TIFFFILE

    def __init__(self, path: Path | str, max_pixels: int | None = None):
        import tifffile

        remote = None
        if is_url(path):  # read through fsspec's file, in blocks (ats_cli.data.remote)
            from ats_cli.data.remote import open_remote

            remote = open_remote(path)
        try:
            self._tif = tifffile.TiffFile(path if remote is None else remote, name=None if remote is None
                                          else url_name(path))
            series, pages = level_pages(self._tif)
        except RemoteReadError:  # the URL could not be fetched: its own one line
            if remote is not None:
                remote.close()
            raise
        except Exception as e:  # tifffile raises many types for broken files
            if remote is not None:
                remote.close()
            raise SlideReadError(path, f"not a readable TIFF ({type(e).__name__}: {e})") from e
        self._remote = remote
        try:
            self._open(path, series, pages, max_pixels)
        except BaseException:
            self._tif.close()
            if remote is not None:
                remote.close()
            raise

    def _open(self, path: Path, series, pages, max_pixels: int | None) -> None:
        fh = self._tif.filehandle
        self._check_complete(path, pages, fh.size)
        channels, problem = colour_samples(series, pages[0])
        for level, page in enumerate(pages):
            problem = problem or codec_problem(page)
            if not problem and colour_samples(series, page)[0] != channels:
                problem = f"level {level} has other samples ({page.samplesperpixel}, {page.dtype}) than level 0"
            if problem:
                raise SlideReadError(path, problem)
        self._keep = channels  # colour samples kept per pixel; alpha or padding after them is dropped
        self._pages = pages
        self._lock = threading.Lock()
        # Positional reads (pread) when the TIFF is a plain file: they neither use nor move
        # the file offset, which a forked DataLoader worker shares with this process (a
        # buffered file object finalised there seeks the shared offset: measured as tiles
        # decoded from the wrong bytes after a few epochs). Else seek+read under a lock.
        self._fd = fh.fileno() if getattr(fh, "is_file", False) and not getattr(fh, "_offset", 0) \
            and hasattr(os, "pread") else None
        vendor = "ome" if self._tif.is_ome else ("aperio" if self._tif.is_svs else "generic-tiff")
        super().__init__(path, [(p.imagelength, p.imagewidth) for p in pages], channels, vendor)
        self.record_scale(*tiff_mpp_source(self._tif, pages[0]))
        self.max_pixels = max_pixels_limit(max_pixels)
        self._probe_codec()

    def _probe_codec(self) -> None:
        """Decode one segment of the smallest level now, so that a codec imagecodecs was
        built without (its stand-in raises ImportError only when called) is refused when
        the file is opened, by ``ats info`` too, rather than at the first patch."""
        level = len(self._pages) - 1
        present = np.flatnonzero(np.asarray(self._pages[level].databytecounts) > 0)
        if len(present) and self._segment_pixels(level) <= self.max_pixels:  # else refused when read
            self._segment(level, int(present[0]))

    def _check_complete(self, path: Path, pages, size: int) -> None:
        """Refuse a file cut short (an interrupted copy or download) by name, before its
        channels or anything else are looked at: every strip/tile must lie inside it."""
        for level, page in enumerate(pages):
            offsets = np.asarray(page.dataoffsets, dtype=np.int64)
            counts = np.asarray(page.databytecounts, dtype=np.int64)
            past = np.flatnonzero((counts > 0) & (offsets + counts > size))
            if len(past):
                i, kind = int(past[0]), "tile" if page.is_tiled else "strip"
                raise SlideReadError(path, f"truncated: {kind} {i} of level {level} ends at byte "
                                     f"{int(offsets[i] + counts[i]):,} but the file has {size:,} bytes "
                                     f"({len(past)} of {len(counts)} {kind}s missing); the file is incomplete")

    def _segment_rows(self, level: int) -> int:
        return int(self._pages[level].chunks[0])

    def _segment_pixels(self, level: int) -> int:
        page = self._pages[level]
        return int(page.chunks[0]) * int(page.chunks[1])

    def _segments_of(self, row: int, col: int, h: int, w: int, level: int) -> list[int]:
        """Numbers of the segments (row-major) a region inside the image overlaps."""
        page = self._pages[level]
        ch, cw = page.chunks[0], page.chunks[1]
        return [ty * page.chunked[1] + tx for ty in range(row // ch, (row + h - 1) // ch + 1)
                for tx in range(col // cw, (col + w - 1) // cw + 1)]

    def _read_regions(self, offs, h, w, level):
        """Each segment the patches overlap decoded once, concurrently on the shared reading
        threads, then the patches cut from them: patches drawn close together (the
        attention's favourites) share tiles, which a read per patch decoded again each time.
        Patches go in groups (in tile order) whose decoded segments fit in
        ``READ_BUDGET_BYTES``, so memory stays bounded however many patches are asked for."""
        if self._segment_pixels(level) > PARALLEL_SEGMENT_PIXELS:
            return super()._read_regions(offs, h, w, level)
        self._check_segment_size(level)
        H, W = self.levels[level]
        room = max(1, READ_BUDGET_BYTES // (self._segment_pixels(level) * max(1, self._channels)))
        out, group, wanted = [], [], set()
        for k, (r, c) in enumerate(offs):
            r0, c0 = max(r, 0), max(c, 0)
            if min(r + h, H) > r0 and min(c + w, W) > c0:
                wanted.update(self._segments_of(r0, c0, min(r + h, H) - r0, min(c + w, W) - c0, level))
            group.append((r, c))
            if len(wanted) >= room or k == len(offs) - 1:
                decoded = self._segments(level, sorted(wanted))
                out += [self.read_region(rr, cc, h, w, level, segments=decoded) for rr, cc in group]
                group, wanted = [], set()
        return out

    def _check_segment_size(self, level: int) -> None:
        page = self._pages[level]
        ch, cw = page.chunks[0], page.chunks[1]
        if ch * cw > self.max_pixels:  # from the header, before decoding: one segment is decoded whole
            kind = "tile" if page.is_tiled else "strip"
            raise _too_big(self.path, f"{kind}s of level {level} are {cw}x{ch}", ch * cw, self.max_pixels)

    def _read_region(self, row, col, h, w, level, segments=None):
        page = self._pages[level]
        ch, cw = page.chunks[0], page.chunks[1]
        n_across = page.chunked[1]
        self._check_segment_size(level)
        tiles = [divmod(i, n_across) for i in self._segments_of(row, col, h, w, level)]
        if segments is None and self._remote is not None and len(tiles) > 1 \
                and self._segment_pixels(level) <= PARALLEL_SEGMENT_PIXELS:  # a URL: fetched in one batch
            segments = self._segments(level, [ty * n_across + tx for ty, tx in tiles])
        keep = self._keep
        out = None
        for ty, tx in tiles:
            index = ty * n_across + tx
            seg = segments[index] if segments is not None else self._segment(level, index)
            if seg is None:  # sparse tile: background
                continue
            y0, x0 = ty * ch, tx * cw
            ys, xs = max(row, y0), max(col, x0)
            ye = min(row + h, y0 + seg.shape[0], page.imagelength)
            xe = min(col + w, x0 + seg.shape[1], page.imagewidth)
            part = seg[ys - y0 : ye - y0, xs - x0 : xe - x0, :keep]
            if len(tiles) == 1 and part.shape[:2] == (h, w):  # one strip/tile covers it: no new array,
                # but no view either that would keep a large decoded strip alive for a small patch
                return part if 2 * part.size >= seg.size else part.copy()
            if out is None:
                out = np.zeros((h, w, keep), dtype=np.uint8)
            out[ys - row : ye - row, xs - col : xe - col] = part
        return out if out is not None else np.zeros((h, w, keep), dtype=np.uint8)

    def _segments(self, level: int, ids: list[int]) -> dict[int, np.ndarray | None]:
        """Segments ``ids`` of ``level`` decoded (:meth:`_segment`), concurrently on the
        shared reading threads. A URL's are fetched first, in one batch of byte ranges
        (:meth:`ats_cli.data.remote.RemoteFile.read_ranges`): fetched one by one, each tile
        would cost a round trip to the server, and a two-level read of a 100k² slide reads
        hundreds."""
        fetched: dict[int, bytes] = {}
        if self._remote is not None and len(ids) > 1:
            page = self._pages[level]
            present = [i for i in ids if int(page.databytecounts[i]) > 0]
            ranges = [(int(page.dataoffsets[i]), int(page.databytecounts[i])) for i in present]
            fetched = dict(zip(present, self._remote.read_ranges(ranges), strict=True))
        decode = lambda i: self._segment(level, i, fetched[i]) if i in fetched else self._segment(level, i)  # noqa: E731
        return dict(zip(ids, thread_pool("tiles").map(decode, ids) if len(ids) > 1 else map(decode, ids),
                        strict=True))

    def _segment(self, level: int, index: int, data: bytes | None = None) -> np.ndarray | None:
        """Strip or tile ``index`` of ``level`` decoded, [rows, cols, samples]; None when the
        file leaves it out (sparse: background). ``data``: its bytes, already fetched. Errors
        name the file and the segment."""
        page = self._pages[level]
        nbytes = int(page.databytecounts[index])
        if nbytes == 0:
            return None
        kind = "tile" if page.is_tiled else "strip"
        try:
            if data is None:
                data = self._read_bytes(int(page.dataoffsets[index]), nbytes)
            seg = page.decode(data, index, jpegtables=page.jpegtables)[0]
            seg = seg.reshape(seg.shape[-3:])
            if page.compression == APERIO_JP2K_YCBCR:
                seg = aperio_ycbcr_to_rgb(seg, data)
            return seg
        except ImportError as e:  # imagecodecs built without this codec
            raise SlideReadError(self.path, codec_message(page, str(e))) from e
        except RemoteReadError:  # the bytes could not be fetched (a URL): said as it is
            raise
        except Exception as e:  # whatever the codec raises: name the file and where
            ty, tx = divmod(index, page.chunked[1])
            raise SlideReadError(self.path, f"cannot decode {kind} {index} (row {ty * page.chunks[0]}, column "
                                 f"{tx * page.chunks[1]}) of level {level} ({type(e).__name__}: {e})") from e

    def _read_bytes(self, offset: int, n: int) -> bytes:
        if self._fd is not None:
            return os.pread(self._fd, n, offset)
        if self._remote is not None:  # a URL: exactly this range, concurrently (ats_cli.data.remote)
            return self._remote.read_range(offset, n)
        with self._lock:  # one file handle: seek+read must not interleave
            self._tif.filehandle.seek(offset)
            return self._tif.filehandle.read(n)  # a URL: RemoteReadError (one line) when it cannot be fetched

    def close(self):
        self._tif.close()
        if self._remote is not None:  # tifffile leaves a file object it was given open
            self._remote.close()


class OpenSlideReader(SlideReader):
    """Vendor whole-slide formats through OpenSlide; reads are level-native regions."""

    name = OPENSLIDE

    def __init__(self, path: Path, max_pixels: int | None = None):
        openslide = _openslide(path)
        self.max_pixels = max_pixels_limit(max_pixels)
        try:
            self._slide = openslide.OpenSlide(str(path))
        except (openslide.OpenSlideError, openslide.OpenSlideUnsupportedFormatError) as e:
            raise SlideReadError(path, f"OpenSlide cannot open it ({type(e).__name__}: {e})") from e
        props = self._slide.properties
        mx, my = props.get(openslide.PROPERTY_NAME_MPP_X), props.get(openslide.PROPERTY_NAME_MPP_Y)
        mpp = (float(my), float(mx)) if mx and my else None
        levels = [(h, w) for w, h in self._slide.level_dimensions]
        vendor = props.get(openslide.PROPERTY_NAME_VENDOR, "unknown")
        super().__init__(path, levels, 3, vendor)
        self.record_scale(mpp, *_openslide_source(props, vendor))

    @property
    def downsamples(self) -> list[float]:
        return [float(d) for d in self._slide.level_downsamples]

    def _read_region(self, row, col, h, w, level):
        import openslide

        d = self._slide.level_downsamples[level]
        try:  # OpenSlide takes the location in level-0 pixels, the size in level pixels
            rgba = np.asarray(self._slide.read_region((round(col * d), round(row * d)), level, (w, h)))
        except openslide.OpenSlideError as e:
            raise SlideReadError(self.path, f"OpenSlide cannot read the {w}x{h} region at row {row}, column {col} of "
                                 f"level {level} ({e})") from e
        return rgba[:, :, :3]

    def close(self):
        self._slide.close()


def _openslide_source(props, vendor: str) -> tuple[str, float | None]:
    """(where OpenSlide's openslide.mpp-x/y come from, the resolution tags' pixels per inch
    when from them): a generic TIFF's are its resolution tags (per centimetre), as
    TiffReader reads them, so a tool's 72 dpi is no scale through either reader."""
    unit, res = props.get("tiff.ResolutionUnit"), props.get("tiff.XResolution")
    per_unit = {"centimeter": 2.54, "inch": 1.0}.get(unit or "")
    if vendor == "generic-tiff" and per_unit and res:
        try:
            per = float(res)
        except ValueError:
            return "OpenSlide's openslide.mpp-x/y", None
        name = "inch" if unit == "inch" else "centimetre"
        return f"the TIFF resolution tags, {per:.6g} pixels per {name}", per * per_unit
    return "OpenSlide's openslide.mpp-x/y", None


class VirtualSlideReader(SlideReader):
    """A virtual slide (``.vslide.json``, :mod:`ats_cli.data.virtual_slides`) read like a
    pyramidal slide: levels ``floor(side / d)`` for the spec's downsamples, each region
    rendered on demand, at a cost set by its pixels, not by the slide's."""

    name = VIRTUAL
    BAND_PIXELS = 1 << 20  # a larger region is rendered this many pixels at a time

    def __init__(self, path: Path, max_pixels: int | None = None):
        from ats_cli.data.virtual_slides import RENDERER, VirtualSlide, level_sizes, load_spec

        self.renderer = RENDERER  # part of a cached view's key (ats_cli.data.inputs.ViewCache)
        self.max_pixels = max_pixels_limit(max_pixels)
        self.spec = load_spec(path)
        self.slide = VirtualSlide(self.spec)
        super().__init__(path, level_sizes(self.spec), 3, "virtual", (self.spec.mpp, self.spec.mpp))
        self.mpp_source = "the spec's mpp"

    @property
    def downsamples(self) -> list[float]:
        return [float(d) for d in self.spec.downsamples]

    def _read_region(self, row, col, h, w, level):
        if h * w > self.max_pixels:
            raise _too_big(self.path, f"a {w}x{h} region of level {level}", h * w, self.max_pixels)
        d, step = self.spec.downsamples[level], max(1, self.BAND_PIXELS // w)
        if h <= step:
            return self.slide.render(row, col, h, w, d, level)
        out = np.empty((h, w, 3), np.uint8)
        for r in range(0, h, step):
            out[r:r + step] = self.slide.render(row + r, col, min(step, h - r), w, d, level)
        return out

    def _segment_rows(self, level: int) -> int:
        return 256


# readers that live in modules of their own, by name, imported when a file needs one (as
# extensions are: ats_cli.registry); the module builds on this one's SlideReader
_READER_MODULES = {OMEZARR: ("ats_cli.data.omezarr", "OmeZarrReader")}


def _reader_class(name: str) -> type[SlideReader]:
    module, cls = _READER_MODULES[name]
    return getattr(importlib.import_module(module), cls)


def open_image(
    path: str | os.PathLike[str], reader: str = "auto", max_pixels: int | None = None
) -> SlideReader:
    """Open ``path`` with the right lazy reader (or the one ``reader`` names).

    auto: the backend :mod:`ats_cli.data.dataset` gives the suffix, except that a TIFF
    goes to OpenSlide when OpenSlide recognises a vendor format in it (Aperio, Philips,
    ...); a suffix the table does not list goes to pillow, which decodes it if it can.
    A TIFF that OpenSlide cannot open goes to tifffile (e.g. an SVS written by tifffile with
    JPEG 2000 tiles under TIFF compression 34712: OpenSlide decodes JPEG 2000 only under
    Aperio's codes 33003 and 33005); when neither opens it, the message gives both reasons.
    ``max_pixels``: the pixel budget (module docstring; default ``ATS_MAX_PIXELS``, else
    64 M). The pillow reader decodes the image here and the tifffile reader one tile of
    its smallest level (to refuse a missing codec now); the others check on reading.
    """
    if reader not in (*READERS, VIRTUAL, OMEZARR):  # these two: by suffix, or by name when a pickled reader is
        raise ValueError(f"unknown reader {reader!r}; choose from {', '.join(READERS)}")  # reopened
    if is_url(path):
        return _open_url(path, reader, max_pixels_limit(max_pixels))
    path = Path(path)
    if not path.exists():
        raise SlideReadError(path, "file not found")
    if reader == OMEZARR or (reader == "auto" and backend(path) == OMEZARR):
        OmeZarrReader = _reader_class(OMEZARR)  # zarr: imported only for a store

        if not path.is_dir():
            raise SlideReadError(path, "is a file; an OME-Zarr store is a directory")
        return OmeZarrReader(path, max_pixels_limit(max_pixels))
    if path.is_dir():
        raise SlideReadError(path, "is a directory, not an image file")
    max_pixels = max_pixels_limit(max_pixels)
    if reader == VIRTUAL or (reader == "auto" and backend(path) == VIRTUAL):
        return VirtualSlideReader(path, max_pixels)
    if reader != "auto":
        return _READER_CLASSES[reader](path, max_pixels)
    reader = backend(path) or PILLOW
    if reader == TIFFFILE and _vendor_tiff(path):
        reader = OPENSLIDE
    try:
        return _READER_CLASSES[reader](path, max_pixels)
    except SlideReadError as e:
        if reader != OPENSLIDE or not _is_tiff(path):
            raise
        try:
            return TiffReader(path, max_pixels)
        except SlideReadError as e2:
            raise SlideReadError(path, f"{e.problem}; tifffile cannot read it either: {e2.problem}") from e2


def _open_url(url: str, reader: str, max_pixels: int) -> SlideReader:
    """The reader of an input behind a URL (:mod:`ats_cli.data.remote`): a TIFF (and a
    vendor file that is one, as an Aperio SVS) through tifffile over fsspec's file, read
    in blocks; an OME-Zarr store through zarr's fsspec store, chunk by chunk; an ordinary
    image fetched whole. OpenSlide opens files by name, so it never reads a URL; virtual
    slides are not read from one either."""
    kind = backend(url) if reader == "auto" else reader
    if kind == OMEZARR:
        return _reader_class(OMEZARR)(url, max_pixels)
    if kind == VIRTUAL:
        raise SlideReadError(url, "is a virtual slide, which ats does not read from a URL; copy it to a local path")
    if kind == OPENSLIDE and reader == OPENSLIDE:
        raise SlideReadError(url, "OpenSlide reads local files only; --reader tifffile (or auto) reads a TIFF from a "
                             "URL, other vendor formats must be downloaded first")
    if kind in (PILLOW, None):
        return PillowReader(url, max_pixels)
    try:
        return TiffReader(url, max_pixels)
    except RemoteReadError:
        raise
    except SlideReadError as e:
        if kind != OPENSLIDE:
            raise
        raise SlideReadError(url, f"{e.problem}; OpenSlide, which reads the vendor formats tifffile cannot, reads "
                             "local files only: download it first") from e


def _is_tiff(path: Path) -> bool:
    """Whether ``path`` starts like a TIFF or BigTIFF (SVS and other vendor files are TIFFs)."""
    with open(path, "rb") as f:
        return f.read(4) in (b"II*\0", b"MM\0*", b"II+\0", b"MM\0+")


def _openslide(path: Path) -> Any:
    """The ``openslide`` module, or a SlideReadError naming ``path`` and the fix: the package
    is a dependency of ats, but an environment installed without dependencies (or with
    openslide-python and no OpenSlide library) would otherwise fail on every slide with a
    bare ``ModuleNotFoundError`` (seen on a GPU image)."""
    try:
        import openslide
    except (ImportError, OSError) as e:  # OSError: the package without its library
        raise SlideReadError(path, f"OpenSlide is not available ({type(e).__name__}: {e}); install it: "
                                   "pip install openslide-python openslide-bin") from None
    return openslide


def _vendor_tiff(path: Path) -> bool:
    """Whether OpenSlide recognises a vendor format (not a generic TIFF) in ``path``; no
    when OpenSlide is missing, so that tifffile reads the TIFF (and its error, if it
    cannot, comes with OpenSlide's)."""
    try:
        openslide = _openslide(path)
    except SlideReadError:
        return False
    try:
        vendor = openslide.OpenSlide.detect_format(str(path))
    except openslide.OpenSlideError:
        vendor = None
    return bool(vendor) and vendor != "generic-tiff"


_READER_CLASSES: dict[str, type[SlideReader]] = {OPENSLIDE: OpenSlideReader, TIFFFILE: TiffReader,
                                                 PILLOW: PillowReader}


_REOPENED: dict[tuple, SlideReader] = {}
_REOPEN_LIMIT = 256  # readers kept open per process (a file handle and a few tile headers each)
_REOPEN_LOCK = threading.Lock()


def _reopen(name: str, path: str, level: int, channels: int, max_pixels: int | None = None,
            factor: float = 1.0) -> SlideReader:
    """The unpickling side of :meth:`SlideReader.__reduce__`: one open reader per file,
    level and channel count in each process.

    Beyond ``_REOPEN_LIMIT`` the oldest is dropped from the cache but not closed: batches
    prefetched by the DataLoader may still hold it; it closes when the last one is done
    with it (garbage collection). The process id is part of the key so that a forked
    child (e.g. a DataLoader worker) never shares its parent's file offsets."""
    key = (os.getpid(), name, path, level, channels, max_pixels, factor)
    with _REOPEN_LOCK:
        reader = _REOPENED.get(key)
        if reader is None:
            reader = open_image(path, reader=name, max_pixels=max_pixels).as_channels(channels)
            reader.set_level(level)
            reader.factor = float(factor)
            if len(_REOPENED) >= _REOPEN_LIMIT:
                _REOPENED.pop(next(iter(_REOPENED)))
            _REOPENED[key] = reader
        return reader


def choose_level(mpps: list[float], mpp: float) -> tuple[int, float]:
    """(level, factor) that hand out pixels of ``mpp`` microns from a pyramid whose levels
    have ``mpps`` microns per pixel: the coarsest level at or below ``mpp`` (within
    :data:`MPP_TOLERANCE`), resampled down by ``factor = mpp / its mpp`` (>= 1: detail is
    averaged away, never invented). A factor within the tolerance of 1 is 1: that level
    is read as it is. When every level is coarser than ``mpp`` (a 20x scan for a model
    trained at 40x), the finest is upsampled (factor < 1): the best the file can give."""
    if not mpp > 0:
        raise ValueError(f"mpp must be > 0, got {mpp}")  # 0 = off is settled by the callers (open_input)
    fine = [i for i, m in enumerate(mpps) if m <= mpp * (1 + MPP_TOLERANCE)]
    level = max(fine, key=lambda i: mpps[i]) if fine else min(range(len(mpps)), key=lambda i: mpps[i])
    factor = mpp / mpps[level]
    return level, (1.0 if abs(factor - 1) <= MPP_TOLERANCE else factor)


def tissue_mask(low: torch.Tensor) -> torch.Tensor:
    """Bool [h, w]: tissue in a low-res view [C, h, w] (float, [0, 1]).

    Otsu's threshold on the HSV saturation, as pathology tools do: glass and background
    are bright and grey (low saturation), stained tissue is coloured. The mask becomes the
    attention's support (``ATSModel.support``), so background is never sampled. A
    grayscale view or one of uniform saturation has no tissue/background split: all True.

    Saturation and threshold are computed here, in numpy (importing ``skimage.filters``
    pulls in much of SciPy, which was a large part of a one-slide ``ats predict``'s
    start-up, for a dozen lines of arithmetic): the saturation exactly as scikit-image's
    ``rgb2hsv``, the split as its ``threshold_otsu`` chooses it, but applied at the chosen
    bin's upper edge, not its centre (:func:`otsu_threshold`).
    """
    if low.shape[0] != 3:
        return torch.ones(low.shape[-2:], dtype=torch.bool)
    sat = saturation(low.permute(1, 2, 0).clamp(0, 1).numpy())
    if float(sat.max() - sat.min()) < 1e-3:
        return torch.ones(low.shape[-2:], dtype=torch.bool)
    return torch.from_numpy(sat >= otsu_threshold(sat))


def saturation(rgb: np.ndarray) -> np.ndarray:
    """HSV saturation of an RGB array [..., 3] in [0, 1]: (max - min) / max, 0 where max is 0."""
    rgb = rgb.astype(np.float64, copy=False)
    top = rgb.max(-1)
    spread = top - rgb.min(-1)
    out = np.zeros_like(top)
    np.divide(spread, top, out=out, where=top > 0)
    return out


def otsu_threshold(values: np.ndarray, bins: int = 256) -> float:
    """Otsu's threshold: values ``>=`` it are the upper class, of the split (after one of
    ``bins`` bins over the values' range) that maximises the between-class variance
    ``w1 w2 (m1 - m2)^2``.

    The split is scikit-image's ``threshold_otsu``'s; the value returned is the upper edge
    of the last bin of the lower class, where scikit-image returns that bin's centre for a
    ``>`` test. Why: values inside the chosen bin belong to the lower class by Otsu's own
    split, and the centre cuts that bin in two. On glass that is nearly one colour (a
    scanner's flat background, a synthetic slide) the lower class is often that one bin,
    and its upper half, up to half of the glass, was taken for tissue: the attention's
    support then covered the background, and the rarity prior, its median taken over that
    support, ranked glass above the tissue's unusual cells."""
    hist, edges = np.histogram(values.ravel(), bins=bins, range=(float(values.min()), float(values.max())))
    hist = hist.astype(np.float64)
    centres = (edges[:-1] + edges[1:]) / 2
    w1 = np.cumsum(hist)
    w2 = np.cumsum(hist[::-1])[::-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        m1 = np.cumsum(hist * centres) / w1
        m2 = (np.cumsum((hist * centres)[::-1]) / w2[::-1])[::-1]
    between = w1[:-1] * w2[1:] * (m1[:-1] - m2[1:]) ** 2
    return float(edges[int(np.nanargmax(between)) + 1])
