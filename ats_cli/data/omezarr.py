"""OME-Zarr stores (NGFF 0.4 and 0.5 multiscales) read lazily, as one more slide reader.

Pathology and microscopy groups increasingly keep images as OME-Zarr: a directory of
chunked arrays, one per pyramid level, described by the group's ``multiscales``
metadata (``.zattrs`` of a Zarr v2 store, NGFF 0.4; ``zarr.json``'s ``attributes.ome``
of a Zarr v3 store, NGFF 0.5). :class:`OmeZarrReader` reads one behind the surface of
:class:`~ats_cli.data.slides.SlideReader`, so ``ats info``, train, predict, visualize and
the GeoJSON export read a store exactly as they read a pyramidal TIFF.

What is read from the store's own metadata, and nothing else:

- **Levels**: the ``datasets`` of the first multiscale, in order (level 0 the finest),
  each a Zarr array at its ``path``; their (y, x) sizes from the arrays' shapes.
- **Scale**: microns per pixel from each dataset's ``coordinateTransformations`` scale
  (times the multiscale's own, when it has one) on the ``y`` and ``x`` axes, in the axes'
  ``unit`` ("micrometer"; other lengths converted). Axes without a length unit record no
  scale: the store is then read as it is, and ``ats info`` says why. A level whose scale
  disagrees with its shape (more than :data:`~ats_cli.data.slides.MPP_TOLERANCE`) is
  refused: one of the two is wrong, and the model would read patches at the wrong size.
- **Axes**: ``y`` and ``x``, optionally ``c`` (1 channel: gray, 3: RGB) and ``t``/``z`` of
  one plane each, in any order the metadata gives. More planes or other channel counts are
  refused by name, as the TIFF reader refuses them (:mod:`ats_cli.data.tiff_meta`): taking
  the first plane or three channels would hand the model a plausible image that is not the
  one in the store.
- **Samples**: uint8 as they are; uint16 scaled to 8 bits by the display window the store
  records for each channel (``omero.channels[i].window`` start/end), the range its own
  viewer shows. Without a window a uint16 store is refused: there is no one right scaling
  (a 12-bit camera fills 0-4095 of 0-65535), the TIFF reader's reason.

Bounded, whatever the metadata claims: a metadata document larger than
:data:`MAX_METADATA_BYTES` is refused before it is parsed; a region reads only the chunks
it touches (zarr decodes whole chunks, so a chunk must fit in the pixel budget, checked
from the array's metadata before any is decoded); a huge claimed shape costs nothing until
a level is read, and the low-res view comes from the smallest level large enough, under
the pixel budget like every reader's.

A missing chunk is an error naming the store, the chunk and the level, not background:
an interrupted copy of a store leaves chunks out, and reading them as the fill value would
give a confident prediction on a slide that is partly black. (zarr-python 3 leaves out a
chunk that equals the fill value unless written with ``write_empty_chunks=True``; a
brightfield slide has no such chunk, a store written so that has them must be rewritten
with them. Inside a shard, a chunk the shard's index marks empty is read as the fill
value: that is the writer's statement, not a loss.)

Behind a URL (``http(s)://``, ``file://``, ``s3://``, ...: :mod:`ats_cli.data.remote`), a
store is read through zarr's ``FsspecStore`` over an asynchronous fsspec file system: the
metadata documents once each at opening (bounded as above, from what the server says of
their size), then each chunk a region touches as one request, the chunks of a
``read_patches`` call in flight together, each fetched once per call and none kept
afterwards (a chunk is decoded into the patches and dropped, as a TIFF tile is). No local
copy and no listing: a server lists no directories, so a chunk the store lacks is found
when it is fetched (HTTP 404) and is the same error naming the URL, the chunk and where it
is; a store whose URL has neither ``zarr.json`` nor ``.zattrs`` below it "does not exist".
A store's view is never kept in the view cache when it is behind a URL: no one object's
validator says a chunk was rewritten (:func:`ats_cli.data.inputs.source_state`).

The ``zarr`` package (the ``[zarr]`` extra) is imported when a store is opened, never at
start-up.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ats_cli.core.source import thread_pool
from ats_cli.data.dataset import OMEZARR
from ats_cli.data.images import max_pixels_limit
from ats_cli.data.remote import RemoteReadError, async_filesystem, describe, fetch_document, input_path, is_url
from ats_cli.data.slides import (
    MPP_TOLERANCE,
    PARALLEL_SEGMENT_PIXELS,
    READ_BUDGET_BYTES,
    SlideReader,
    SlideReadError,
    _too_big,
)

__all__ = ["OmeZarrReader", "MAX_METADATA_BYTES", "read_multiscales"]

MAX_METADATA_BYTES = 4 << 20  # a group's or array's metadata document; real ones are a few kB
# NGFF units are UDUNITS-2 names; the lengths, in micrometres
_MICRONS = {"angstrom": 1e-4, "picometer": 1e-6, "nanometer": 1e-3, "micrometer": 1.0, "millimeter": 1e3,
            "centimeter": 1e4, "decimeter": 1e5, "meter": 1e6, "inch": 25_400.0, "foot": 304_800.0}
_OLD_AXES = "tczyx"  # NGFF 0.1-0.3 without named axes: the last ndim of these


def _join(store: Path | str, name: str) -> Path | str:
    """``store/name``: a path, or the URL of an object below a store's URL."""
    return store.rstrip("/") + "/" + name if is_url(store) else Path(store) / name


def _read_json(store: Path | str, name: str) -> dict | None:
    """The JSON object ``store/name``, or None when the file (the object, behind a URL) is
    absent; refused by name when it is too large, not JSON, or not an object."""
    doc = _join(store, name)
    if is_url(store):
        data = fetch_document(doc, MAX_METADATA_BYTES)  # a RemoteReadError naming the object's URL
        if data is None:
            return None
    else:
        try:
            size = doc.stat().st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SlideReadError(store, f"cannot read {name} ({e.strerror or e})") from e
        if size > MAX_METADATA_BYTES:
            raise SlideReadError(store, f"{name} is {size:,} bytes, more than the {MAX_METADATA_BYTES:,} a metadata "
                                 "document may have")
        try:
            data = doc.read_bytes()
        except OSError as e:
            raise SlideReadError(store, f"cannot read {name} ({e.strerror or e})") from e
    try:
        value = json.loads(data)
    except ValueError as e:
        raise SlideReadError(store, f"{name} is not readable JSON ({type(e).__name__}: {e})") from e
    if not isinstance(value, dict):
        raise SlideReadError(store, f"{name} holds {type(value).__name__}, not a JSON object")
    return value


def read_multiscales(store: Path | str) -> tuple[dict, dict, str]:
    """(the first multiscale, the attributes it was found in, the NGFF version) of the
    group at ``store`` (a path or a URL): ``zarr.json``'s ``attributes.ome`` (0.5) or
    ``.zattrs`` (0.4 and earlier). Raises :class:`SlideReadError` naming the store when
    there is none."""
    v3 = _read_json(store, "zarr.json")
    zattrs = None
    if v3 is not None:
        attrs = v3.get("attributes") or {}
        ome = attrs.get("ome") if isinstance(attrs, dict) else None
        if isinstance(ome, dict) and "multiscales" in ome:
            attrs, version = ome, str(ome.get("version", "0.5"))
        elif isinstance(attrs, dict) and "multiscales" in attrs:  # 0.4 metadata written into a v3 group
            version = ""
        else:
            attrs = None
    else:
        attrs = zattrs = _read_json(store, ".zattrs")
        version = ""
    if not isinstance(attrs, dict) or "multiscales" not in attrs:
        found = "zarr.json" if v3 is not None else ".zattrs" if zattrs is not None else None
        if found is None and is_url(store):  # a URL names no directory to find: nothing is there
            raise RemoteReadError(store, "does not exist (HTTP 404 or no such object: no zarr.json or .zattrs "
                                  "below it, so no OME-Zarr store)")
        where = f"its {found} has" if found else "it has no zarr.json or .zattrs, so"
        raise SlideReadError(store, f"is not an OME-Zarr image: {where} no 'multiscales' metadata (NGFF: the "
                             "group's attributes name the pyramid's levels)")
    multiscales = attrs["multiscales"]
    if not isinstance(multiscales, list) or not multiscales or not isinstance(multiscales[0], dict):
        raise SlideReadError(store, "its 'multiscales' metadata is not a list of multiscale objects")
    ms = multiscales[0]
    version = version or str(ms.get("version", "0.4"))
    return ms, attrs, version


def _axes(store: Path, ms: dict, ndim: int) -> list[tuple[str, str | None]]:
    """[(name, unit)] per array dimension."""
    axes = ms.get("axes")
    if axes is None:
        if ndim > len(_OLD_AXES):
            raise SlideReadError(store, f"its arrays have {ndim} dimensions and the multiscales name no axes")
        return [(a, None) for a in _OLD_AXES[-ndim:]]
    if not isinstance(axes, list):
        raise SlideReadError(store, "its multiscales 'axes' is not a list")
    out = []
    for a in axes:
        if isinstance(a, str):
            out.append((a.lower(), None))
        elif isinstance(a, dict) and isinstance(a.get("name"), str):
            unit = a.get("unit")
            out.append((a["name"].lower(), unit.lower() if isinstance(unit, str) else None))
        else:
            raise SlideReadError(store, f"its multiscales axis {a!r} has no name")
    if len(out) != ndim:
        raise SlideReadError(store, f"its multiscales name {len(out)} axes ({', '.join(n for n, _ in out)}) for "
                             f"arrays of {ndim} dimensions")
    names = [n for n, _ in out]
    missing = [n for n in ("y", "x") if n not in names]
    if missing or len(set(names)) != len(names):
        raise SlideReadError(store, f"its axes are {', '.join(names)}; an image needs one y and one x axis")
    unknown = [n for n in names if n not in ("t", "c", "z", "y", "x")]
    if unknown:
        raise SlideReadError(store, f"has an axis {unknown[0]!r}; ats reads the axes t, c, z, y, x")
    return out


def _scale(store: Path, transforms: Any, ndim: int, what: str) -> list[float] | None:
    """The product of the ``scale`` transformations in ``transforms`` (None: none)."""
    if transforms is None:
        return None
    if not isinstance(transforms, list):
        raise SlideReadError(store, f"the coordinateTransformations of {what} are not a list")
    out = None
    for t in transforms:
        if not isinstance(t, dict) or t.get("type") != "scale":
            continue
        s = t.get("scale")
        if not (isinstance(s, list) and len(s) == ndim and all(isinstance(v, int | float) for v in s)):
            raise SlideReadError(store, f"the scale of {what} is {s!r}, not {ndim} numbers (a scale given by "
                                 "'path' is not read)")
        if not all(math.isfinite(v) and v > 0 for v in s):
            raise SlideReadError(store, f"the scale of {what} is {s}: every factor must be a positive number")
        out = [float(v) for v in s] if out is None else [a * float(b) for a, b in zip(out, s, strict=True)]
    return out


def _windows(store: Path, attrs: dict, channels: int) -> list[tuple[float, float]] | None:
    """Each channel's display window (start, end) from ``omero``, or None if not all have one."""
    omero = attrs.get("omero")
    chans = omero.get("channels") if isinstance(omero, dict) else None
    if not isinstance(chans, list) or len(chans) != channels:
        return None
    out = []
    for i, ch in enumerate(chans):
        win = ch.get("window") if isinstance(ch, dict) else None
        if not isinstance(win, dict):
            return None
        start, end = win.get("start"), win.get("end")
        if not (isinstance(start, int | float) and isinstance(end, int | float)):
            return None
        if not (math.isfinite(start) and math.isfinite(end) and end > start):
            raise SlideReadError(store, f"the display window of channel {i} is {start}-{end}; it needs start < end")
        out.append((float(start), float(end)))
    return out


class OmeZarrReader(SlideReader):
    """An OME-Zarr store: its multiscale levels, read chunk by chunk (module docstring)."""

    name = OMEZARR

    def __init__(self, path: Path | str, max_pixels: int | None = None):
        path = input_path(path)  # a URL stays the URL string
        ms, attrs, version = read_multiscales(path)
        datasets = ms.get("datasets")
        if not isinstance(datasets, list) or not datasets:
            raise SlideReadError(path, "its multiscales list no datasets (the pyramid's levels)")
        zarr = _zarr(path)
        remote = _remote_store(path) if is_url(path) else None
        self._paths, self._arrays = [], []
        for k, ds in enumerate(datasets):
            sub = ds.get("path") if isinstance(ds, dict) else None
            if not isinstance(sub, str) or not sub or Path(sub).is_absolute() or ".." in Path(sub).parts:
                raise SlideReadError(path, f"dataset {k} of its multiscales has no path inside the store ({sub!r})")
            # the array's metadata, bounded before zarr parses it: Zarr v3's, else v2's
            fmt = 3 if _read_json(_join(path, sub), "zarr.json") is not None else \
                2 if _read_json(_join(path, sub), ".zarray") is not None else None
            if remote is not None and fmt is None:  # zarr would say "not found" without the URL
                raise SlideReadError(path, f"level {k} ({sub}) is not there: no {_join(path, sub)}/zarr.json or "
                                     ".zarray (HTTP 404 or no such object)")
            try:
                arr = zarr.open_array(store=str(path / sub), mode="r", zarr_format=fmt) if remote is None else \
                    zarr.open_array(store=remote, path=sub, mode="r", zarr_format=fmt)
            except Exception as e:  # zarr raises many types for a missing or broken array
                raise SlideReadError(path, f"level {k} ({sub}) is not a readable Zarr array "
                                     f"({type(e).__name__}: {e})") from e
            self._paths.append(sub)
            self._arrays.append(arr)
        first = self._arrays[0]
        axes = _axes(path, ms, first.ndim)
        names = [n for n, _ in axes]
        self._axis = {n: i for i, n in enumerate(names)}
        for n in ("t", "z"):
            if n in self._axis and first.shape[self._axis[n]] != 1:
                what = "time points" if n == "t" else "z planes"
                raise SlideReadError(path, f"has {first.shape[self._axis[n]]} {what} (axis {n}); ats reads one "
                                     "plane: write the one to read as a store of its own")
        channels = first.shape[self._axis["c"]] if "c" in self._axis else 1
        if channels not in (1, 3):
            raise SlideReadError(path, f"has {channels} channels (axis c); ats reads gray (1) or RGB (3) images: "
                                 "write the channels to read as a store of 1 or 3")
        self._windows = None
        if first.dtype == np.uint16:
            self._windows = _windows(path, attrs, channels)
            if self._windows is None:
                raise SlideReadError(path, "has 16-bit samples and records no display window (omero.channels[]."
                                     "window start/end) to scale them to 8 bits by; there is no one right scaling "
                                     "(a 12-bit camera fills 0-4095 of 0-65535): record the window, or write it "
                                     "as 8-bit")
        elif first.dtype != np.uint8:
            raise SlideReadError(path, f"has {first.dtype} samples; ats reads uint8, or uint16 with a display window")
        levels = []
        for k, arr in enumerate(self._arrays):
            if arr.ndim != first.ndim or arr.dtype != first.dtype or \
                    any(arr.shape[self._axis[n]] != first.shape[self._axis[n]] for n in ("t", "c", "z")
                        if n in self._axis):
                raise SlideReadError(path, f"level {k} ({self._paths[k]}) is a {arr.dtype} array of shape "
                                     f"{arr.shape}, unlike level 0's {first.dtype} {first.shape} in all but y and x")
            levels.append((int(arr.shape[self._axis["y"]]), int(arr.shape[self._axis["x"]])))
            if min(levels[-1]) < 1 or (k and (levels[-1][0] > levels[-2][0] or levels[-1][1] > levels[-2][1])):
                raise SlideReadError(path, f"level {k} ({self._paths[k]}) is {levels[-1][1]}x{levels[-1][0]}, "
                                     "not smaller than the level before it")
        super().__init__(path, levels, channels, f"ome-zarr {version}")
        self.max_pixels = max_pixels_limit(max_pixels)
        self._present: set[tuple[int, str]] = set()  # chunk files seen on disk (stat once each)
        self._remote = remote
        self._scale_from(path, ms, datasets, axes)

    def _scale_from(self, path: Path, ms: dict, datasets: list, axes: list[tuple[str, str | None]]) -> None:
        """Record level 0's microns per pixel from the coordinateTransformations, after
        checking every level's scale against its shape (module docstring)."""
        ndim = len(axes)
        outer = _scale(path, ms.get("coordinateTransformations"), ndim, "the multiscale")
        scales = []
        for k, ds in enumerate(datasets):
            s = _scale(path, ds.get("coordinateTransformations"), ndim, f"level {k}")
            if s is not None and outer is not None:
                s = [a * b for a, b in zip(s, outer, strict=True)]
            scales.append(s)
        y, x = self._axis["y"], self._axis["x"]
        if scales[0] is not None:
            for k, s in enumerate(scales[1:], start=1):
                if s is None:
                    continue
                for i, n in ((y, 0), (x, 1)):
                    by_scale, by_shape = s[i] / scales[0][i], self.levels[0][n] / self.levels[k][n]
                    if abs(by_scale / by_shape - 1) > MPP_TOLERANCE and abs(self.levels[0][n] / by_scale
                                                                           - self.levels[k][n]) > 1:
                        raise SlideReadError(path, f"level {k}'s scale is {by_scale:.4g}x level 0's on "
                                             f"{axes[i][0]}, its shape {by_shape:.4g}x smaller: the metadata and "
                                             "the arrays disagree")
        units = (axes[y][1], axes[x][1])
        source = "the multiscales' coordinateTransformations"
        if scales[0] is None:
            self.record_scale(None, source)
        elif not all(u in _MICRONS for u in units):
            self.record_scale(None, source)
            said = "no unit" if units == (None, None) else f"units {units[0]}, {units[1]}"
            self.scale_unknown = f"{source}: the y and x axes have {said}, not lengths"
        else:
            self.record_scale((scales[0][y] * _MICRONS[units[0]], scales[0][x] * _MICRONS[units[1]]),
                              f"{source} ({units[0]})")

    # -- reading ---------------------------------------------------------------------------
    def _chunk_shape(self, level: int) -> tuple[int, ...]:
        return tuple(int(v) for v in self._arrays[level].chunks)

    def _segment_rows(self, level: int) -> int:
        return self._chunk_shape(level)[self._axis["y"]]

    def _segment_pixels(self, level: int) -> int:
        chunks = self._chunk_shape(level)
        return chunks[self._axis["y"]] * chunks[self._axis["x"]]

    def _check_chunks(self, level: int) -> None:
        """zarr decodes a chunk whole: refuse, from the metadata, chunks over the pixel budget."""
        chunks = self._chunk_shape(level)
        ch, cw = chunks[self._axis["y"]], chunks[self._axis["x"]]
        if ch * cw > self.max_pixels:
            raise _too_big(self.path, f"chunks of level {level} are {cw}x{ch}", ch * cw, self.max_pixels)

    def _check_present(self, row: int, col: int, h: int, w: int, level: int) -> None:
        """Refuse a region that touches a chunk (a shard, in a sharded array) missing from
        the store, by name (module docstring: missing is not background)."""
        if self._remote is not None:  # behind a URL: the store says so when a chunk is fetched (_Strict)
            return
        arr = self._arrays[level]
        grid = tuple(int(v) for v in (arr.shards or arr.chunks))
        ranges = []
        for i, n in enumerate(self._axis):
            if n == "y":
                ranges.append(range(row // grid[i], (row + h - 1) // grid[i] + 1))
            elif n == "x":
                ranges.append(range(col // grid[i], (col + w - 1) // grid[i] + 1))
            else:
                ranges.append(range(-(-arr.shape[i] // grid[i])))
        for coords in np.ndindex(*(len(r) for r in ranges)):
            coords = tuple(r[j] for r, j in zip(ranges, coords, strict=True))
            key = arr.metadata.encode_chunk_key(coords)
            if (level, key) in self._present:
                continue
            if not (self.path / self._paths[level] / key).is_file():
                raise self._missing(level, key, coords)
            self._present.add((level, key))

    def _missing(self, level: int, key: str, coords: tuple[int, ...] | None = None) -> SlideReadError:
        """The error for chunk ``key`` (a shard, in a sharded array) of ``level``, missing
        from the store; ``coords``: its grid position, else read from the key."""
        arr = self._arrays[level]
        grid = tuple(int(v) for v in (arr.shards or arr.chunks))
        if coords is None:
            parts = [p for p in re.split(r"[./]", key) if p != "c"]
            coords = tuple(int(p) for p in parts) if len(parts) == arr.ndim and all(p.isdigit() for p in parts) \
                else None
        where = ""
        if coords is not None:
            y, x = coords[self._axis["y"]] * grid[self._axis["y"]], coords[self._axis["x"]] * grid[self._axis["x"]]
            where = f" (row {y}, column {x})"
        return SlideReadError(self.path, f"chunk {self._paths[level]}/{key} of level {level}{where} is missing: the "
                              "store is incomplete (an interrupted copy?)")

    def _read_region(self, row, col, h, w, level):
        self._check_chunks(level)
        if h * w > self.max_pixels:
            raise _too_big(self.path, f"a {w}x{h} region of level {level}", h * w, self.max_pixels)
        self._check_present(row, col, h, w, level)
        sel = tuple(slice(row, row + h) if n == "y" else slice(col, col + w) if n == "x" else
                    slice(None) if n == "c" else 0 for n in self._axis)
        try:
            data = np.asarray(self._arrays[level][sel])
        except _MissingChunk as e:  # behind a URL (_Strict): missing is not background
            raise self._missing(level, e.key[len(self._paths[level]) + 1:]) from None
        except Exception as e:  # whatever the codec or the store raises: name the store and where
            fetching = isinstance(e, OSError | TimeoutError) or type(e).__module__.split(".")[0] == "aiohttp"
            why = describe(self.path, e) if self._remote is not None and fetching else f"{type(e).__name__}: {e}"
            raise SlideReadError(self.path, f"cannot read the {w}x{h} region at row {row}, column {col} of level "
                                 f"{level} ({why})") from e
        kept = [n for n in self._axis if n in ("y", "x", "c")]  # the axes the selection kept, in array order
        data = data.transpose([kept.index(n) for n in ("y", "x", "c") if n in kept])
        if data.ndim == 2:
            data = data[:, :, None]
        if self._windows is not None:
            start = np.array([s for s, _ in self._windows], dtype=np.float64)
            span = np.array([e - s for s, e in self._windows], dtype=np.float64)
            data = np.clip(np.rint((data - start) * (255.0 / span)), 0, 255).astype(np.uint8)
        return np.ascontiguousarray(data)

    def _read_regions(self, offs, h, w, level):
        """Each chunk the patches overlap read once (concurrently on the shared reading
        threads), then the patches cut from them, as the TIFF reader does with its tiles:
        the attention's favourite patches lie close together and share chunks, which a zarr
        read per patch would decode again for each of them. Patches go in groups whose chunks fit in
        ``READ_BUDGET_BYTES``, so memory stays bounded however many are asked for."""
        if self._segment_pixels(level) > PARALLEL_SEGMENT_PIXELS or len(offs) == 1:
            return super()._read_regions(offs, h, w, level)
        self._check_chunks(level)
        H, W = self.levels[level]
        ch, cw = self._segment_rows(level), self._chunk_shape(level)[self._axis["x"]]
        room = max(1, READ_BUDGET_BYTES // (ch * cw * self._channels))
        read = lambda t: self.read_region(t[0] * ch, t[1] * cw, min(ch, H - t[0] * ch),  # noqa: E731
                                          min(cw, W - t[1] * cw), level)
        out, group, wanted = [], [], set()
        for k, (r, c) in enumerate(offs):
            r0, c0, r1, c1 = max(r, 0), max(c, 0), min(r + h, H), min(c + w, W)
            if r1 > r0 and c1 > c0:
                wanted.update((ty, tx) for ty in range(r0 // ch, (r1 - 1) // ch + 1)
                              for tx in range(c0 // cw, (c1 - 1) // cw + 1))
            group.append((r, c))
            if len(wanted) >= room or k == len(offs) - 1:
                ids = sorted(wanted)
                chunks = dict(zip(ids, thread_pool("tiles").map(read, ids) if len(ids) > 1 else map(read, ids),
                                  strict=True))
                for rr, cc in group:
                    patch = np.zeros((h, w, self.channels), dtype=np.uint8)  # read_region gives these
                    for (ty, tx), chunk in chunks.items():
                        y0, x0 = ty * ch, tx * cw
                        ys, xs = max(rr, y0), max(cc, x0)
                        ye, xe = min(rr + h, y0 + chunk.shape[0]), min(cc + w, x0 + chunk.shape[1])
                        if ye > ys and xe > xs:
                            patch[ys - rr:ye - rr, xs - cc:xe - cc] = chunk[ys - y0:ye - y0, xs - x0:xe - x0]
                    out.append(patch)
                group, wanted = [], set()
        return out

    def view_files(self, size: tuple[int, int]) -> list[Path]:
        """The files the low-res view of ``size`` is made from (the group's and that level's
        metadata, the level's chunks), for the view cache's key (:mod:`ats_cli.data.inputs`):
        a store is a directory, so no one file's times say it changed."""
        level = self.view_level(size)
        files = [self.path / n for n in ("zarr.json", ".zattrs", ".zgroup") if (self.path / n).is_file()]
        for dirpath, dirnames, names in os.walk(self.path / self._paths[level]):
            dirnames.sort()
            files += [Path(dirpath) / n for n in sorted(names)]
        return files


class _MissingChunk(Exception):
    """A chunk (or shard) the store does not have: raised by :class:`_Strict` through zarr,
    which would otherwise read it as the fill value."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


_METADATA_NAMES = ("zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata")


def _remote_store(url: str) -> Any:
    """zarr's ``FsspecStore`` over the store at ``url`` (an asynchronous fsspec file system:
    each chunk one request, several in flight at once), read-only, whose missing chunks are
    errors (:func:`_strict_store`)."""
    from zarr.storage import FsspecStore

    fs, where = async_filesystem(url)
    return _strict_store()(FsspecStore(fs, path=where.rstrip("/"), read_only=True))


@functools.cache
def _strict_store() -> type:
    """The store class that raises :class:`_MissingChunk` for a chunk its store lacks (made
    on first use: zarr is imported when a store is opened). zarr reads a key the store
    lacks as the fill value; a local store's chunk files are checked before reading
    (``_check_present``), but behind a URL there is no listing to check against, so the
    store says so itself when the chunk is fetched."""
    from zarr.storage import WrapperStore

    def check(key: str, value: Any) -> None:
        if value is None and key.rsplit("/", 1)[-1] not in _METADATA_NAMES:
            raise _MissingChunk(key)

    class StrictStore(WrapperStore):
        async def get(self, key, prototype, byte_range=None):
            value = await self._store.get(key, prototype, byte_range)
            check(key, value)
            return value

        async def get_partial_values(self, prototype, key_ranges):
            key_ranges = list(key_ranges)
            values = await self._store.get_partial_values(prototype, key_ranges)
            for (key, _), value in zip(key_ranges, values, strict=True):
                check(key, value)
            return values

    return StrictStore


def _zarr(path: Path) -> Any:
    """The ``zarr`` module, or a SlideReadError naming the store and the fix."""
    try:
        import zarr
    except ImportError as e:
        raise SlideReadError(path, f"reading OME-Zarr needs the zarr package ({e}); install it: "
                             "pip install 'ats[zarr]' (or pip install zarr)") from None
    return zarr
