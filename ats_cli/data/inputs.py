"""From an input file to what the model needs: low-res view, patch source, tissue mask;
one image at a time (:func:`open_input`) or a training batch (:class:`ImageDataset`).

:func:`open_input` is the one place this happens, for ``ats predict``, ``ats visualize``
and training's data loader alike, so an image is read the same way in all three. What
reading a file involves besides decoding lives here with it, one concern ("reading one
input") in four parts: the reading itself; at what physical scale a slide is read
(magnification); the per-run cache of slides' low-res views; and the batching of the
training loader. The decoders are below it (:mod:`ats_cli.data.images` for files read
whole, :mod:`ats_cli.data.slides` for lazy readers), the prepared layout of ordinary
images beside it (:mod:`ats_cli.data.prepared`).

**Magnification: models that know their microns.** A pathologist thinks in microns, not
pixels: a 64-pixel patch of a 40x scan (0.25 µm/px)
covers a quarter of the tissue the same patch covers on a 20x scan (0.5 µm/px). A model
trained on one and shown the other sees cells twice the size it learned, and answers
something else. So a model records the physical scale of its pixels, and every slide is
read at that scale:

* **Training** records the microns per pixel (mpp) the patches were read at in the
  model's spec (``input.mpp``): ``--mpp`` when given (every training slide is then read
  at that scale, :meth:`~ats_cli.data.slides.SlideReader.match_mpp`), else the training
  slides' own mpp at ``--level`` when all of them record one and agree within
  :data:`~ats_cli.data.slides.MPP_TOLERANCE`. When they disagree, or some record none,
  the model records none (and the log says why): predict then reads slides as it always
  did, by level.
* ``--patch-um`` / ``--low-res-um`` give the patch side and the low-res view's pixel in
  microns instead of ``--patch-size`` (pixels) and ``--scale`` (a ratio): at the mpp
  above they are ``patch_size = round(patch_um / mpp)`` and ``scale = mpp / low_res_um``.
  The spec stores pixels and the mpp, so the microns follow from it; giving both forms of
  one setting is accepted only when they agree (a resumed run's config.json holds both).
* **Predict / visualize**: a slide that records its mpp is read from the coarsest level
  at or below the model's mpp and resampled by the remaining factor
  (:func:`~ats_cli.data.slides.choose_level`), patches and low-res view alike, so a patch
  covers the same tissue on a 40x and a 20x scan. Resampling is per patch (each reads its
  footprint, at most factor² times its pixels, and is resized to the patch size) and the
  view comes from the smallest pyramid level large enough, as before: memory stays
  bounded by the view and the patches. A slide without mpp (or a PNG) is read at the
  model's level as it is, and the one-line reading note says so. ``--mpp`` overrides the
  model's mpp; ``--level`` reads that level as it is.

:func:`describe_reading` is that one-line note (``ats predict`` and ``ats visualize`` print
it); :func:`file_header` reads a file's microns per pixel and size. Training's part, the rule above and
the conversion of microns into pixels, is settled with the rest of the configuration
(:mod:`ats_cli.config`).

**The view cache.** The low-res views and tissue masks of slides, computed once per run and kept on disk.

Making a slide's low-res view decodes a whole pyramid level (the smallest one large
enough, e.g. 5000x5000 pixels for the 1/32 view of a 20000-pixel slide, read through the
JPEG tiles) and resizes it: seconds per slide, every epoch, in the DataLoader workers,
while the training step itself reads only n patches. The view does not change between
epochs (augmentation is applied to it afterwards, in the training step, with new draws
every epoch: :mod:`ats_cli.augment`), so it is made once and read back.

Where: ``RUN/cache/views/`` by default (``ats train`` passes it; ``ATS_VIEW_CACHE=DIR``
puts it elsewhere, e.g. to share it between runs on one dataset; ``ATS_VIEW_CACHE=off``
turns it off). On disk rather than in the training process's memory because the views
are made in the DataLoader workers, which are new processes every epoch (and new again
after ``--resume``): a file is what they all see, whatever process made it. Under the run
directory rather than beside the dataset because a dataset directory may be read-only or
shared by several people's runs; a run directory is the run's own.

What: one ``.npz`` per (file, what was asked) with the view as uint8 [h, w, C] (what
``SlideReader.low_res`` returns, so the float view is recomputed bit for bit) and the
tissue mask as bool [h, w]; loaded with ``allow_pickle=False``: nothing but arrays is ever
read back. Its name is a hash of the file's resolved path, size, modification time (ns),
inode change time (ns) and content digest (:func:`content_digest`: its first and last
64 KiB) and of the reader, level, channels, pixel budget and scale: a slide rewritten or
touched gets a new entry, and so does a slide replaced by another of the same size whose
modification time was kept (``cp -p``, ``rsync -t``, an archive unpacked), or edited in
place with its size and mtime restored (an uncompressed TIFF's middle tiles: neither its
first nor last 64 KiB change): the kernel sets the change time on every write and no
user can set it back. An OME-Zarr store is a directory, whose own times do not change
when a chunk is rewritten: it is named by the path, size and times of every file its view
is made from (the metadata and the chunks of the view's level) and the metadata's
content (:func:`source_state`). A URL is named by itself and what its server says of
the bytes: size, ETag, Last-Modified; a server that gives neither validator has its views
made every time, never stored. Old entries are never read again (delete the folder to reclaim
the space; it is rebuilt on the next epoch). Written atomically (:mod:`ats_cli.io`), so a
worker killed mid-write or two writing the same entry leave a whole file or none.

Why the change time and not a digest of the content: a digest of the whole file reads a
slide of gigabytes at every epoch (more than the view it saves); one of the tiles read
for the view costs that read, which is what the cache removes; a sampled digest misses
an edit between its samples. The change time proves a file unchanged once it was read
at least one timestamp tick after the file last changed (:func:`ats_cli.io.settled`: a
file system with 1-second times keeps all three times through a same-size rewrite
within that second); a view made sooner is used but not stored, and is made again (and
stored) at the next read: at most one more view per slide written just before its read.
A copy of the data (``cp -a``, ``rsync``) sets new change times: its views are made again
once, never served stale.

Checksums: each array of an entry carries the zip format's CRC-32, checked as it is read;
an entry that fails it (or is not the arrays asked for) is said in one line and made again.

A folder that cannot be written (not a directory, read-only, a full disk) is one line of
warning, once per process, and the run goes on computing views without storing them: the
cache only saves time, so a run that would have been correct without it is not stopped
for it (a training run of hours lost to a full cache disk would be the worse answer).

**The training loader.** From dataset records to model inputs: the low-res view is made here, in the
DataLoader workers, and the full-resolution image stays on the host: a uint8 tensor for
ordinary images, a lazy reader for slides and TIFFs (the file is reopened in the
training process, see ``SlideReader.__reduce__``; it is never decoded whole).

The model then reads only the sampled patches from it, so the device never holds more
than the low-res views and n patches per image, whatever the image size.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset

from ats_cli.core.source import PatchSource, TensorSource, low_res_size
from ats_cli.data.dataset import Record, is_lazy
from ats_cli.data.images import ImageReadError, pil_size, read_image, resize_in_bands
from ats_cli.io import atomic_path, settled

if TYPE_CHECKING:
    from ats_cli.data.slides import SlideReader

__all__ = ["OpenedImage", "open_input", "batch_sources", "batch_support", "batch_views", "describe_reading",
           "announce_readings", "check_patches_fit", "file_facts", "file_header", "FileHeader",
           "ViewCache", "view_cache_for", "VIEW_CACHE_ENV",
           "VIEW_CACHE_FORMAT",
           "ImageDataset", "Batch", "Unreadable", "collate", "readable", "single_thread_worker"]


@dataclass
class OpenedImage:
    """An input ready for the model: its low-res view [C, h, w] (float, [0, 1]) and the
    patch source standing for the full-resolution image."""

    low: torch.Tensor
    source: PatchSource
    support: torch.Tensor | None = None  # bool [h, w] over ``low``: where sampling may go (tissue mask)
    reading: str | None = None  # how a slide was read (level, resampling), one line: ats_cli.data.inputs


def low_res_view(image: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`ats_cli.core.source.low_res_view` of a uint8 image [C, H, W], bit for bit,
    converting one band of rows to float at a time: the whole image in float32 would be
    four times its size (1.2 GB for a 10000x10000 RGB image), twice over."""
    C, H, W = image.shape
    return resize_in_bands(lambda r0, r1: image[:, r0:r1], (C, H, W), low_res_size((H, W), scale), divide=255.0)


def open_input(path: str | os.PathLike[str], *, channels: int, scale: float,
               patch_size: tuple[int, int], reader: str | None = None, level: int | None = None,
               mpp: float | None = None, tissue: bool | None = None, max_pixels: int | None = None,
               resample: bool = True, view_cache=None) -> OpenedImage:
    """Read one input file into (low-res view, patch source): the only function that
    knows how files are read.

    TIFFs and whole-slide formats (or any file when ``reader`` is given) go through the
    lazy readers of :mod:`ats_cli.data.slides`: the view comes from a small pyramid level
    and patches are decoded tile by tile at the sampled positions, so memory does not grow
    with the slide. ``level``/``mpp`` choose the level patches are read from; with
    ``resample`` (the default) ``mpp`` is a physical scale to match: a file that records
    its microns per pixel is read from the level at or below ``mpp`` and resampled to it
    (:meth:`~ats_cli.data.slides.SlideReader.match_mpp`), any other file at ``level`` as
    it is (``reading`` says so); without it
    ``mpp`` picks the closest level, read as it is, and a file
    without mpp is refused. ``tissue`` (default: on for slides read lazily, off for
    ordinary images) restricts sampling to
    the Otsu tissue mask. Other files are read whole with :func:`read_image`, as before.
    ``max_pixels`` is the pixel budget of :mod:`ats_cli.data.slides` (default
    ``ATS_MAX_PIXELS``, else 64 M): larger reads are refused from the file's header.
    ``mpp`` 0 means off, as ``--mpp 0`` does in training: no physical scale is matched and
    the file is read at ``level`` as it is. A file whose recorded pixel size is no scale (a
    tool's 72 dpi, a value out of the plausible range:
    :func:`~ats_cli.data.tiff_meta.not_a_microscope_scale`) is read so too, and ``reading``
    says why.

    An image smaller than a patch in either dimension is refused: zero padding would make
    it run, but every patch would then be mostly padding the model never saw in training,
    and the prediction would look confident while meaning little. Raises
    :class:`ImageReadError` naming the file.
    """
    from ats_cli.data.inputs import describe_reading
    from ats_cli.data.slides import open_image, tissue_mask

    if not mpp:  # --mpp 0 (and a model that records none): off, read by level as it is
        mpp = None
    lazy = is_lazy(path, reader, level, None if resample else mpp)
    note = None
    if lazy:
        slide = open_image(path, reader=reader or "auto", max_pixels=max_pixels).as_channels(channels)
        if resample and mpp is not None and slide.mpp is not None:
            slide.match_mpp(mpp)
        else:
            slide.set_level(level, None if resample else mpp)
        low, mask = view_cache.view(slide, scale) if view_cache is not None else (slide.low_res_view(scale), None)
        source: PatchSource = slide
        note = describe_reading(slide, mpp if resample else None)
    else:
        image = read_image(path, channels, max_pixels=max_pixels)
        low, source, mask = low_res_view(image, scale), TensorSource(image), None
    H, W = source.size
    ph, pw = patch_size
    if H < ph or W < pw:
        raise ImageReadError(path, f"is {W}x{H} pixels (width x height), smaller than the model's {pw}x{ph} patch")
    support = (tissue_mask(low) if mask is None else mask) if (lazy if tissue is None else tissue) else None
    return OpenedImage(low=low, source=source, support=support, reading=note)


def batch_sources(sources: Sequence[PatchSource]) -> torch.Tensor | list[PatchSource]:
    """A batch's patch sources as the model takes them: one [B, C, H, W] tensor when every
    source is an in-memory image of one size (one vectorised patch extraction), else the
    sources themselves (lazy readers, or images of different sizes)."""
    if all(isinstance(s, TensorSource) for s in sources) and len({s.image.shape for s in sources}) == 1:
        return torch.stack([s.image for s in sources])
    return list(sources)


def batch_support(masks: Sequence[torch.Tensor | None], view_shape: Sequence[int]) -> torch.Tensor | None:
    """A batch's tissue masks [B, h, w] (True everywhere for an input without one), or
    None when no input has one. ``view_shape``: the (h, w) of the batch's views, the
    largest when they differ (a smaller view's mask is padded bottom/right with False, as
    its view is with zeros: :func:`batch_views`)."""
    if all(m is None for m in masks):
        return None
    h, w = (int(v) for v in view_shape)
    out = torch.zeros(len(masks), h, w, dtype=torch.bool)
    for b, m in enumerate(masks):
        if m is None:
            out[b] = True
        else:
            out[b, :m.shape[-2], :m.shape[-1]] = m
    return out


def batch_views(lows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch's low-res views [C, h, w] as one tensor [B, C, h, w], and their own sizes
    [B, 2] (host, int64) when they differ, else None.

    Views of different sizes (images of different sizes or aspect ratios) are padded
    bottom/right with zeros to the largest height and width: the padding stands for no
    cell of any image, and the model, told each view's size, keeps it out of the
    attention (it gets no probability and is never drawn) and computes each image's
    attention on its own view (:meth:`ats_cli.core.model.ATSModel.forward`), so an image
    gets in a mixed batch what it gets alone. Top-left so that a cell's (row, col) is the
    same in the padded grid as in the image's own."""
    shapes = [tuple(x.shape[-2:]) for x in lows]
    if len(set(shapes)) == 1:
        return torch.stack(list(lows)), None
    H, W = max(h for h, _ in shapes), max(w for _, w in shapes)
    out = lows[0].new_zeros(len(lows), lows[0].shape[0], H, W)
    for b, x in enumerate(lows):
        out[b, :, :x.shape[-2], :x.shape[-1]] = x
    return out, torch.tensor(shapes, dtype=torch.long)


# ------------------------------------- magnification: how a slide is read, a file's mpp
def _um(v: float) -> str:
    return f"{v:.3g} µm/px"


def describe_reading(slide: SlideReader, target: float | None) -> str:
    """How ``slide`` is read, one line: its level, that level's mpp and the resampling
    (``target``: the mpp asked for, the model's or ``--mpp``; None: none to match)."""
    mpps = slide.level_mpps
    level = f"level {slide.level}"
    if mpps is None and slide.scale_unknown:  # a tool's 72 dpi: said once, as ats info says it
        asked = "" if target is None else f" for {_um(target)}"
        return f"{level} read as it is{asked}, its scale unknown: {slide.scale_unknown}"
    if mpps is None:
        if target is None:
            return f"{level} read as it is (the file records no microns per pixel)"
        return (f"{level} read as it is: the file records no microns per pixel, so it cannot be matched to the "
                f"model's {_um(target)}")
    here = f"{level} ({_um(mpps[slide.level])})"
    f = slide.factor
    if target is None:
        return f"{here} read as it is (no microns per pixel to match)"
    if f == 1.0:
        return f"{here} read as it is for {_um(target)}"
    if f > 1:
        return f"{here} downsampled {f:.3g}x to {_um(target)}"
    return f"{here} upsampled {1 / f:.3g}x to {_um(target)} (the file has nothing finer)"


def announce_readings(opener: Callable[..., Any], say: Callable[[str], None]) -> Callable[..., Any]:
    """``opener`` that also says how a slide was read (:func:`describe_reading`), on one
    line naming the file, the first time each way of reading occurs: one line for a folder
    of slides from one scanner, another for the one that differs."""
    seen: set[str] = set()

    def read(path: Any, *args: Any, **kwargs: Any) -> Any:  # ats_cli.data.inputs.OpenedImage
        opened = opener(path, *args, **kwargs)
        note = getattr(opened, "reading", None)
        if note and note not in seen:
            seen.add(note)
            say(f"{path}: {note}")
        return opened

    return read


@dataclass(frozen=True)
class FileHeader:
    """What a file's header says (:func:`file_header`): ``mpp`` of the level read (None when
    it records none, or none that is a microscope's), ``size`` (height, width) as read (None:
    the file cannot be opened), ``lazy`` whether it is read lazily (a slide or TIFF, whose
    scale matters), ``scale_unknown`` why the pixel size it records is no scale ("" when it
    records one, or none at all)."""

    mpp: float | None
    size: tuple[int, int] | None
    lazy: bool = False
    scale_unknown: str = ""


def file_header(path: str | Path, *, reader: str | None = None, level: int | None = None,
                max_pixels: int | None = None) -> FileHeader:
    """What the header of the file at ``path`` says, without decoding pixels: the microns per
    pixel of ``level`` (0 by default; None when it records none or is not read lazily) and
    the (height, width) the image is read at (a photo's as its EXIF orientation turns it;
    None when the file cannot be opened: the training loader names unreadable files when it
    reaches them). A pixel size that is no microscope's (a tool's 72 dpi, out of the
    plausible range: :func:`~ats_cli.data.tiff_meta.not_a_microscope_scale`) is None here: a
    model trained at it would record a scale that resamples every slide it reads by hundreds;
    :attr:`FileHeader.scale_unknown` says why, so that ``ats train`` can say it as ``ats
    info`` does."""
    from ats_cli.data.slides import open_image

    if not is_lazy(path, reader, level, None):
        return FileHeader(None, pil_size(path, max_pixels))
    try:
        slide = open_image(path, reader=reader or "auto", max_pixels=max_pixels)
    except Exception:  # noqa: BLE001 - reported by name when training reads the file
        return FileHeader(None, None, lazy=True)
    with slide:
        mpps = slide.plausible_mpps()  # None for a scale no microscope has (SlideReader.record_scale)
        lv = level or 0
        size = slide.levels[lv] if lv < len(slide.levels) else None  # a level it lacks: named when training reads it
        mpp = None if mpps is None or lv >= len(mpps) else mpps[lv]
        return FileHeader(mpp, size, lazy=True, scale_unknown=slide.scale_unknown if mpp is None else "")


def file_facts(path: str | Path, *, reader: str | None = None, level: int | None = None,
               max_pixels: int | None = None) -> tuple[float | None, tuple[int, int] | None]:
    """(mpp, (height, width)) of :func:`file_header`."""
    header = file_header(path, reader=reader, level=level, max_pixels=max_pixels)
    return header.mpp, header.size


def check_patches_fit(records: Sequence[Record], patch_size: tuple[int, int], *, reader: str | None = None,
                      level: int | None = None) -> None:
    """Refuse, from the headers alone, ordinary images smaller than a patch, before training
    decodes the dataset: :func:`open_input` refuses each such image when it reads it, which
    training reaches only after preparing (decoding) every image. The message names the
    first, how many there are, and the largest ``--patch-size`` every image takes. Slides
    and TIFFs read lazily are left to :func:`open_input`: the level and scale they are read
    at are settled from more than the header."""
    ph, pw = patch_size
    small: list[tuple[Path, tuple[int, int]]] = []
    fits = None
    for rec in records:
        if is_lazy(rec.path, reader, level, None):
            continue
        size = pil_size(rec.path)  # None: unreadable, named when training reaches it
        if size is None:
            continue
        fits = min(size) if fits is None else min(fits, *size)
        if size[0] < ph or size[1] < pw:
            small.append((rec.path, size))
    if small:
        (path, (h, w)), more = small[0], len(small) - 1
        others = f" (and {more} more of the dataset's images)" if more else ""
        raise ImageReadError(path, f"is {w}x{h} pixels (width x height), smaller than the {pw}x{ph} patch{others}: "
                             f"give --patch-size {fits} or less (checked before preparing the dataset)")


# ----------------------------- the view cache: slides' low-res views, made once per run
VIEW_CACHE_ENV = "ATS_VIEW_CACHE"
VIEW_CACHE_FORMAT = 3  # bump when what is stored changes: old entries then simply stop matching (3: alpha on white)
DIGEST_BYTES = 64 << 10  # read from each end of a file for its content digest


def content_digest(path: str | os.PathLike[str]) -> str:
    """A digest of the first and last :data:`DIGEST_BYTES` of ``path``: a TIFF's header
    and first IFD are at its start, many writers put the IFDs (and the tile offsets) at
    its end, and the first tiles follow the header; two different slides of one size
    differ there. Two reads, whatever the file's size."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        h.update(fh.read(DIGEST_BYTES))
        size = fh.seek(0, os.SEEK_END)
        if size > DIGEST_BYTES:
            fh.seek(max(DIGEST_BYTES, size - DIGEST_BYTES))
            h.update(fh.read(DIGEST_BYTES))
    return h.hexdigest()


def source_state(slide, scale: float) -> tuple[dict, int, int]:
    """(what names the bytes ``slide``'s view at ``scale`` is made from as they are now, the
    latest mtime and ctime among them, ns). A file: its size, mtime, ctime and
    :func:`content_digest`. An OME-Zarr store, a directory whose own times do not change when
    a chunk is rewritten: the path, size, mtime and ctime of every file the view is read from
    (the metadata and the chunks of the view's level: ``slide.view_files``) and the metadata's
    content; a chunk added, removed or rewritten names another entry. A URL: the URL, its
    size, ETag and Last-Modified (:func:`ats_cli.data.remote.remote_stat`), proven (times 0)
    when the server gives a validator, else never (times now: the view is not stored). An
    OME-Zarr store behind a URL, never: it is one object per chunk, a server lists none of
    them, and no one object's validator says that a chunk was rewritten (stating every chunk
    of the view's level would cost a request each)."""
    from ats_cli.core.source import low_res_size
    from ats_cli.data.remote import is_url, proves_unchanged, remote_stat

    if is_url(slide.path) and getattr(slide, "view_files", None) is not None:  # a store: never stored
        now = time.time_ns()
        return {"url": slide.path, "store": "behind a URL"}, now, now
    if is_url(slide.path):  # what the server says of the bytes; no validator: never stored (view())
        stat = remote_stat(slide.path)
        proven = 0 if proves_unchanged(stat) else time.time_ns()
        return stat, proven, proven
    view_files = getattr(slide, "view_files", None)
    if view_files is None:
        st = os.stat(slide.path)
        return ({"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
                 "content": content_digest(slide.path)}, st.st_mtime_ns, st.st_ctime_ns)
    h, mtime, ctime = hashlib.sha256(), 0, 0
    root = Path(slide.path)
    for f in view_files(low_res_size(slide.size, scale)):
        st = os.stat(f)
        rel = f.relative_to(root).as_posix()
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n".encode())
        if f.name in ("zarr.json", ".zattrs", ".zgroup", ".zarray"):
            h.update(content_digest(f).encode())
        mtime, ctime = max(mtime, st.st_mtime_ns), max(ctime, st.st_ctime_ns)
    return {"store": h.hexdigest()}, mtime, ctime


class ViewCache:
    """Low-res views and tissue masks of lazily read slides, one file each in ``folder``."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.folder = Path(folder)
        self.writable = True  # False after a write failed: computed, not stored (module docstring)

    def key(self, slide, scale: float, source: dict | None = None) -> str:
        """The entry's name: the file as it is now (``source``: :func:`source_state`, taken
        by the caller) and what is asked of it."""
        source = source_state(slide, scale)[0] if source is None else source
        from ats_cli.data.remote import is_url

        where = slide.path if is_url(slide.path) else str(Path(slide.path).resolve())
        what = {"format": VIEW_CACHE_FORMAT, "path": where, **source,
                "reader": slide.name, "level": slide.level, "size": list(slide.size),
                "channels": slide.channels, "max_pixels": slide.max_pixels, "scale": repr(float(scale)),
                "resampled": repr(float(getattr(slide, "factor", 1.0))),  # --mpp: the level's resampling
                "renderer": getattr(slide, "renderer", None)}  # a virtual slide's pixels: its renderer's
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]

    def probe(self) -> bool:
        """Whether the folder can be written, asked of the file system without writing
        (every rank of a run calls this, and only rank 0 may write): the folder, or the
        nearest part of its path that exists, must be a writable directory. Warns once
        when not. A disk that fills later is caught when an entry is stored."""
        where = self.folder
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir():
            self._give_up(OSError(errno.ENOTDIR, f"{where} is not a directory"))
        elif not os.access(where, os.W_OK | os.X_OK):
            self._give_up(OSError(errno.EACCES, f"{where} is not writable"))
        return self.writable

    def _give_up(self, e: OSError) -> None:
        self.writable = False
        print(f"warning: {self.folder}: cannot write the view cache ({e.strerror or e}); going on without it "
              f"(slower: views are remade every epoch; set {VIEW_CACHE_ENV}=DIR elsewhere, or "
              f"{VIEW_CACHE_ENV}=off)",
              file=sys.stderr, flush=True)

    def _damaged(self, slide, path: Path, e: BaseException) -> None:
        print(f"warning: {slide.path}: its cached view {path} is damaged ({type(e).__name__}: {e}); made again "
              "from the file", file=sys.stderr, flush=True)

    def _store(self, path: Path, low: np.ndarray, mask: np.ndarray) -> None:
        """Write one entry; a folder that cannot take it is warned about once and left
        alone from then on (module docstring)."""
        if not self.writable:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp, open(tmp, "wb") as fh:
                np.savez(fh, low=low, mask=mask)
        except OSError as e:
            self._give_up(e)

    def view(self, slide, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slide.low_res_view(scale), tissue_mask(view))``, from the cache when the entry
        exists and is whole, else computed and stored."""
        from ats_cli.core.source import low_res_size
        from ats_cli.data.slides import tissue_mask

        stamped = time.time_ns()  # before the stat: io.settled measures from here
        source, mtime_ns, ctime_ns = source_state(slide, scale)
        path = self.folder / f"{self.key(slide, scale, source)}.npz"
        size = tuple(low_res_size(slide.size, scale))
        low = mask = None
        try:
            with np.load(path, allow_pickle=False) as z:  # each array's zip CRC-32 is checked as it is read
                low, mask = z["low"], z["mask"]
            if low.dtype != np.uint8 or low.shape != (*size, slide.channels) or mask.shape != size \
                    or mask.dtype != bool:
                raise ValueError(f"arrays {low.dtype} {low.shape}, {mask.dtype} {mask.shape} where uint8 "
                                 f"{(*size, slide.channels)}, bool {size} were expected")
        except OSError:  # not made yet, or a folder that cannot be read: made (the store says why not)
            low = None
        except (ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:  # damaged: said, made again
            self._damaged(slide, path, e)
            low = None
        if low is None:
            low = slide.low_res(size)
            mask = tissue_mask(_as_view(low)).numpy()
            # stored only when the stat proves the file: one taken within a timestamp tick of
            # the last change would also name a same-size rewrite within that tick
            if settled(stamped, mtime_ns, ctime_ns):
                self._store(path, low, mask)
            elif self.writable:
                self.probe()  # not stored this time, but a folder that cannot take it is said now
        return _as_view(low), torch.from_numpy(np.array(mask, dtype=bool))


def _as_view(low: np.ndarray) -> torch.Tensor:
    """uint8 [h, w, C] -> [C, h, w] float in [0, 1], as ``SlideReader.low_res_view`` makes it."""
    return torch.from_numpy(np.array(low, copy=True)).permute(2, 0, 1).float() / 255.0


def view_cache_for(run: str | os.PathLike[str]) -> ViewCache | None:
    """The cache a run uses: ``RUN/cache/views``, or ``$ATS_VIEW_CACHE``; None when that is
    ``off``, or cannot be written (said once, here, in the process that starts the run,
    rather than once by each DataLoader worker)."""
    where = os.environ.get(VIEW_CACHE_ENV, "").strip()
    if where.lower() in ("off", "0", "none", "no"):
        return None
    cache = ViewCache(Path(where).expanduser() if where else Path(run) / "cache" / "views")
    return cache if cache.probe() else None


# ---------------------------------------------- the training loader: records to batches
Item = tuple[torch.Tensor, PatchSource, int, int, "torch.Tensor | None"]


@dataclass(frozen=True)
class Unreadable:
    """An input a DataLoader worker could not read. It travels to the training process as
    data and is raised there as :class:`ImageReadError` by :func:`readable`: raised inside
    the worker, torch would re-raise it wrapped in a RuntimeError with the worker's
    traceback as its message, instead of the one line naming the file."""

    path: str
    problem: str


class ImageDataset(TorchDataset):
    """Records of one split -> (low-res view, patch source, label, index, tissue mask or
    None), read by :func:`open_input` exactly as ``ats predict`` reads them: the source is
    the uint8 image in memory (``TensorSource``) or a lazy slide reader.

    ``reader``/``level``/``mpp``/``tissue`` are ``ats predict``'s options of the same
    names; a model trained with them is predicted with them (they are saved in its spec).
    ``view_cache``: where slides' low-res views and tissue masks are kept once made
    (:mod:`ats_cli.data.inputs`); None: remade at every read. ``prepared``: a
    :class:`~ats_cli.data.prepared.PreparedStore`; an image with a fresh entry there is
    read from it (the same view and patches, bit for bit, without decoding), any other
    from its file.
    """

    def __init__(self, records: Sequence[Record], *, channels: int, scale: float,
                 patch_size: tuple[int, int] = (1, 1), reader: str | None = None, level: int | None = None,
                 mpp: float | None = None, tissue: bool | None = None, view_cache=None, prepared=None):
        self.records = list(records)
        self.prepared = prepared
        self.view_cache = view_cache
        self.channels = channels
        self.scale = scale
        self.options = {"patch_size": patch_size, "reader": reader, "level": level, "mpp": mpp, "tissue": tissue}

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Item | Unreadable:
        rec = self.records[i]
        try:
            opened = None if self.prepared is None else self.prepared.open_input(
                rec.path, patch_size=self.options["patch_size"], tissue=self.options["tissue"])
            if opened is None:
                opened = open_input(rec.path, channels=self.channels, scale=self.scale, view_cache=self.view_cache,
                                    **self.options)
        except ImageReadError as e:
            return Unreadable(str(e.path), e.problem)
        return opened.low, opened.source, rec.target, i, opened.support


@dataclass
class Batch:
    low: torch.Tensor  # [B, C, h, w] float
    sources: torch.Tensor | list[PatchSource]  # full-res images, stacked when they share a size
    labels: torch.Tensor  # [B] class indices, or [B, classes] multi-hot (multi-label)
    indices: torch.Tensor  # [B] positions in the split
    support: torch.Tensor | None = None  # [B, h, w] bool: tissue masks (True everywhere for images without one)
    # [B, 2] (host, int64) each view's own (h, w) when they differ and ``low`` holds them padded
    # bottom/right to the largest (batch_views); None: every view fills ``low``
    view_sizes: torch.Tensor | None = None

    def pin_memory(self) -> Batch:
        """Page-locked copies (the DataLoader's pin thread calls this), so that the training
        step's copies to the GPU are queued without the host waiting (ats_cli.core.source.to_device)."""
        self.low, self.labels = self.low.pin_memory(), self.labels.pin_memory()
        if isinstance(self.sources, torch.Tensor):
            self.sources = self.sources.pin_memory()
        if self.support is not None:
            self.support = self.support.pin_memory()
        return self

    def support_on(self, device: torch.device) -> torch.Tensor | None:
        return None if self.support is None else self.support.to(device)

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """The model's keyword for a batch of views of different sizes (``view_sizes``), or
        nothing for one of a single size: a model that never takes mixed batches (the
        baselines, two levels) is called as before."""
        return {} if self.view_sizes is None else {"view_sizes": self.view_sizes}


def collate(items: list[Item | Unreadable]) -> Batch | Unreadable:
    for item in items:
        if isinstance(item, Unreadable):
            return item
    lows, sources, labels, indices, masks = zip(*items, strict=True)
    low, view_sizes = batch_views(lows)  # different sizes: padded, their own sizes kept
    return Batch(low, batch_sources(sources), torch.tensor(labels), torch.tensor(indices),
                 batch_support(masks, low.shape[-2:]), view_sizes)


def readable(loader: Iterable[Batch | Unreadable]) -> Iterator[Batch]:
    """The loader's batches; an input that could not be read stops the run here, in the
    training process, with an :class:`ImageReadError` naming the file."""
    for batch in loader:
        if isinstance(batch, Unreadable):
            raise ImageReadError(batch.path, batch.problem)
        yield batch


def single_thread_worker(_: int) -> None:
    """DataLoader worker init: one intra-op thread per worker. Decoding and resizing are
    per-image work; letting every worker also spawn a full thread pool oversubscribes the
    cores and starves the training step."""
    torch.set_num_threads(1)
