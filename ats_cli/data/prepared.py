"""Prepared images: an ordinary image (PNG, JPEG, ... read whole) decoded once into a
layout that hands out patches and its low-res view without decoding or resizing again.

Why: attention sampling reads n small patches of an image and a low-res view of it, yet
an image read whole is decoded and resized in full every epoch, and the whole image is
copied into the batch, to be read ten patches of. A prepared entry keeps the view as it
was computed and the pixels in small compressed tiles, so a read costs the view and the
tiles the patches touch, whatever the image's size.

The layout (chosen against raw memory-mapped arrays; the figures of both are in
benchmarks/README.md, "Loader", measured by benchmarks/loader.py): one file per image
with the float view, stored sparsely, and zlib-compressed 64x64 tiles (the entry, below).
Raw arrays take the image's full uint8 size on disk, many times a PNG of mostly dark
pixels, and were not faster to read (opening a memory map costs more than decoding the
few tiles ten patches touch); the tiles take about the PNG's size.

Why not Zarr v3 (issue 70; ``benchmarks/loader.py --zarr``, benchmarks/README.md,
"Loader"): on the same images, one Zarr group per image (the pixels as one shard of 64x64
inner chunks, the view as one chunk) written and read by zarr-python takes 7.7x the time to
prepare (zstd; blosc-zstd and gzip take more) and about 100x the time per patch (its every
read passes an asyncio loop and the codec pipeline: 1.2 ms a patch, against 12 us). Only the
same format written and read by code of our own comes near, and still misses the targets of
1.2x: 1.5x per patch with gzip (2.0x with numcodecs' zstd), 3.5x the view read (no sparse
view among its codecs), 1.75x a sample, and 1.32x the disk blocks (five files an entry
against one), on Megapixel MNIST at the paper spec. On dense JPEG photos zarr-python
takes 1.7x to prepare and 13x a patch; read directly, zstd chunks read 2.3x faster than
our zlib tiles (the codec, which the entry could adopt, not the container), gzip ones as
fast. Zarr would also give up what one file gives: an entry replaced by one rename, and
a reader that knows by its inode that the file it reads is the one whose view it was
given. Zarr's gains (other tools read it, object storage) do not concern a cache of decoded
pixels that lives beside its dataset and is made again from it at will, so the entry stays
the format of our own.

Results do not change: a prepared image gives bit for bit the view and patches the
source gives (tested), so a run with the same seed gives the same metrics.

One module, in the order a reader meets the questions: the entry (one image's file), the
store (where entries live and when one may be used), preparing (in parallel, resumable,
one preparer at a time; ``ats make-dataset prepare DATA`` does it ahead of training), and
what ``ats train`` does (``--prepare``, the default).

**The entry.** One prepared image on disk: its low-res view and its pixels in compressed tiles, and
the patch source that reads patches back from them.

Layout of an entry file (little-endian)::

    b"ATSPREP1" | u64 header offset | u64 header length        (24 bytes)
    view: the float32 [C, h, w] the loader computes: a bit mask of its non-zero values, then those
    tiles: zlib of uint8 [C, th, tw] each, row-major; an all-zero tile is stored as nothing
    index: int64 [n_tiles + 1], each tile's start relative to the first tile
    header: JSON (the source's stamp, the sizes and where each part starts)

Why tiles of ``TILE`` pixels: a patch no larger than a tile touches at most four of
them, so a read decodes a few small tiles per patch and the cost follows the patches,
never the image. Why zlib: it is in the standard library and decodes a small tile
quickly; images that are mostly background (Megapixel MNIST, fluorescence, astronomy)
shrink to about their PNG's size, where raw arrays take the full uint8 size; all-zero
tiles take no space at all. Why the view is stored as the float32 the loader computes,
not recomputed: bit-identical views are the contract (the same seed, the same metrics,
prepared or not), and the resize is the cost this layout removes. It is stored as a bit
mask of its non-zero values and those values: exact, decoded with two numpy calls, and
faster than inflating it with zlib (benchmarks/README.md, "Loader").

The header is written last and its offset first (the file is streamed, tile by tile,
so memory holds one tile and the view, never the compressed image whole).

**The store.** Where prepared entries live, what each is named, and when one may be used.

Where: ``DATA/.ats-prepared/`` beside the dataset, because preparing is once per dataset,
not per run: every run on the dataset (and ``ats make-dataset prepare``) finds the same
entries. ``ATS_PREPARED=DIR`` puts them elsewhere (a faster disk, a dataset on a
read-only or shared mount); when ``DATA`` cannot be written and no such directory is
given, ``$XDG_CACHE_HOME/ats/prepared/<hash of DATA>`` (else ``~/.cache``) is used and
the log says so. ``ATS_PREPARED=off`` turns preparing off, like ``ats train --no-prepare``.

Names: a hash of the source file's path (relative to the dataset when it lies inside it,
so a dataset moved or copied with its ``.ats-prepared`` keeps its names), the channels
and the scale: what the entry's pixels and view depend on. Another ``--scale`` is
another entry.

When an entry may be used (the key decision): its header records the source's size,
``mtime_ns`` and ``ctime_ns`` as they were when it was read, plus a full BLAKE2b digest
of its bytes. At every read the loader compares the first three with ``os.stat`` of the
source, one stat call; any difference and the entry is not used (the source is read
as it is now, exactly as without preparing, and the next preparation redoes it). Why
the stat and not a digest at read time: the inode change time is set by the kernel on
every write and on every ``touch``/``utime`` (a copy that restores the old mtime sets it
to now), so a rewritten file cannot keep all three; a digest at read time would read
the whole source again, the cost preparing removes. The digest is checked when the stat
differs but the content may not (a dataset copied or touched): the same digest and the
entry is re-stamped instead of decoded again. An entry also records the Pillow and torch
versions that decoded and resized it (:func:`made_by`): after an upgrade, reading the
source might give other bits, so older entries are prepared again.

The stat proves the file unchanged only when it was taken at least one timestamp tick
after the file last changed (:func:`ats_cli.io.settled`; ``stamped_ns`` in the header): on
a file system with 1-second times an image rewritten within the second it was prepared
in, at the same size, keeps size, mtime and ctime. Such an entry is used only when the
source's digest matches (one read of the file, no decode), and the next preparation
re-stamps it once its times have settled.

A source behind a URL (:mod:`ats_cli.data.remote`) is stamped with what its server says
of it instead: its size, ETag and Last-Modified. A server's validator changes with the
bytes, so a stamp with one is settled at once; one without either proves nothing, and
its entry is used only when the source's digest matches (a fetch of the image, no
decode) and is never re-stamped.

Checksums: the header carries the CRC-32 of its own JSON, of the view and of the tile
index; each tile is a zlib stream with its own Adler-32. A damaged entry (a flipped bit
on disk) is never served: met by a read, it is said in one line and removed, and the
image is read from its file (the same result); met by a preparation, it is said and
made again.

**Preparing.** Every ordinary image of a dataset decoded once, its view made once, written
as an entry, in parallel processes.

Resumable without bookkeeping: an entry is written atomically and carries its source's
stamp, so a file is done exactly when its entry matches it (:meth:`PreparedStore.is_fresh`);
a rerun after a kill skips what is done and redoes nothing else. One preparer per store
at a time (an OS lock on ``.lock`` in the store, dropped by the OS however the holder
ends): a second one waits, then finds the work done. Under that lock the temporary files
of a killed preparer are swept. The workers neither inherit the lock nor outlive their
preparer, and a lock left held by leftovers of a dead preparer is taken over
(:mod:`ats_cli.io`), so a ``kill -9`` at any moment leaves nothing that blocks the next
preparation.

A file's digest is taken before it is decoded and its stat compared before and after,
so an entry never pairs one version's pixels with another version's stamp: a file that
changes while being read is reported, not prepared.

Disk: entries are compressed, but a dataset of photographs may still take several times
its own size, so preparing stops (by name, with the free space) when the file system
would keep less than ``MIN_FREE_BYTES``: the files not prepared are then read from the
sources, as without preparing, and results are the same either way.

**In a training run.** ``ats train --prepare`` (the default): the dataset prepared before the first epoch, once.

Before the first epoch rather than during it: the preparation then runs in as many
processes as the loader has workers, reports what it did (and what it could not read,
by name) in one line before any training, and the first epoch already reads prepared
entries. Everything that goes wrong with the store itself (a full disk, a directory that
cannot be written) costs one warning and the run trains from the source files, which
gives the same result, only slower.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import stat
import struct
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ats_cli.core.source import low_res_size
from ats_cli.data.dataset import LAZY_BACKENDS, backend
from ats_cli.data.images import ImageReadError, max_pixels_limit, over_budget, read_image
from ats_cli.data.inputs import OpenedImage, low_res_view
from ats_cli.data.remote import fetch_bytes, is_url, remote_stat
from ats_cli.io import (
    atomic_path,
    die_with_parent,
    held,
    owner_gone,
    read_record,
    released,
    sweep_temporaries,
    write_record,
)
from ats_cli.io import settled as _settled

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: one preparer is then the user's care
    fcntl = None

__all__ = ["TILE", "EntryError", "EntryDamaged", "PreparedSource", "entry_source", "entry_view", "read_entry",
           "restamp_entry", "verify_entry", "check_index", "settled", "source_digest",
           "write_entry", "ENV", "FOLDER", "FORMAT", "PreparedStore", "file_stamp", "made_by", "store_folder",
           "MIN_FREE_BYTES", "PrepareReport", "prepare", "prepare_one", "preparer_lock", "prepare_for_run"]

MAGIC = b"ATSPREP1"
PREFIX = struct.Struct("<8sQQ")
TILE = 64
LEVEL = 1  # zlib level: a higher one shrinks tiles a little more and decodes several times slower
SPAN = 1 << 20  # tiles this close together are read in one call
MAX_HEADER = 1 << 20  # a larger "header" is damage, not an entry


class EntryError(ValueError):
    """A prepared entry that cannot be read as one (missing, damaged, another format)."""


class EntryDamaged(EntryError):
    """A prepared entry whose bytes are not what was written: a checksum that does not
    match, or parts that do not fit together. Said in one line, and the entry made again."""


@dataclass(frozen=True)
class PreparedSource:
    """The full-resolution image of a prepared entry, as a
    :class:`~ats_cli.core.source.PatchSource`: ``read_patches`` decodes only the tiles
    the patches touch.

    Plain values only, so it pickles as "this file, these offsets": a DataLoader worker
    opens the entry for the view and hands this to the training process, which reads the
    patches. ``inode``/``mtime_ns`` identify the entry file the worker read: an entry
    replaced in between (its source changed) is refused by name rather than mixed with the
    view of the old one."""

    entry: str
    source: str
    height: int
    width: int
    n_channels: int
    tile: int
    index_at: int
    data_at: int
    inode: int
    mtime_ns: int
    index_crc: int = -1

    @property
    def size(self) -> tuple[int, int]:
        return self.height, self.width

    @property
    def channels(self) -> int:
        return self.n_channels

    def read_patches(self, offsets: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        h, w = int(size[0]), int(size[1])
        H, W, C, T = self.height, self.width, self.n_channels, self.tile
        out = np.zeros((offsets.shape[0], C, h, w), dtype=np.uint8)
        tx_n = -(-W // T)
        try:
            fd = os.open(self.entry, os.O_RDONLY)
        except OSError as e:
            raise ImageReadError(self.source, f"its prepared copy {self.entry} is gone ({e.strerror}); "
                                 "rerun (it is prepared again)") from None
        try:
            st = os.fstat(fd)
            if (st.st_ino, st.st_mtime_ns) != (self.inode, self.mtime_ns):
                raise ImageReadError(self.source, f"its prepared copy {self.entry} was replaced while in use "
                                     "(the file changed); rerun")
            raw_index = os.pread(fd, 8 * (-(-H // T) * tx_n + 1), self.index_at)
            if zlib.crc32(raw_index) != self.index_crc:
                raise ImageReadError(self.source, f"its prepared copy {self.entry} is damaged (its tile index does "
                                     "not match its checksum); delete it and rerun (it is prepared again)")
            index = np.frombuffer(raw_index, dtype="<i8").tolist()
            # which non-empty tiles each patch covers, and where: (patch, tile, rows, cols in both)
            cuts = []
            for k, (r0, c0) in enumerate(offsets.tolist()):
                y0, y1 = (r0 if r0 > 0 else 0), (r0 + h if r0 + h < H else H)
                x0, x1 = (c0 if c0 > 0 else 0), (c0 + w if c0 + w < W else W)
                if y0 >= y1 or x0 >= x1:
                    continue
                for ty in range(y0 // T, (y1 - 1) // T + 1):
                    a0, a1 = max(y0, ty * T), min(y1, ty * T + T)
                    for tx in range(x0 // T, (x1 - 1) // T + 1):
                        i = ty * tx_n + tx
                        if index[i] != index[i + 1]:  # an empty tile is all zero: so is the output already
                            b0, b1 = max(x0, tx * T), min(x1, tx * T + T)
                            cuts.append((k, i, a0 - r0, a1 - r0, b0 - c0, b1 - c0, a0 - ty * T, a1 - ty * T,
                                         b0 - tx * T, b1 - tx * T))
            tiles = self._tiles(fd, index, {cut[1] for cut in cuts})
        finally:
            os.close(fd)
        for k, i, o0, o1, p0, p1, t0, t1, s0, s1 in cuts:
            out[k, :, o0:o1, p0:p1] = tiles[i][:, t0:t1, s0:s1]
        return torch.from_numpy(out)

    def _tiles(self, fd: int, index: list[int], wanted: set[int]) -> dict[int, np.ndarray]:
        """The decoded tiles ``wanted`` (numbers into the row-major grid), read in one call
        when they lie close together (``SPAN``), else one by one."""
        if not wanted:
            return {}
        T, tx_n = self.tile, -(-self.width // self.tile)
        first, last = index[min(wanted)], index[max(wanted) + 1]
        block = os.pread(fd, last - first, self.data_at + first) if last - first <= SPAN else None
        tiles = {}
        for i in wanted:
            start, end = index[i], index[i + 1]
            data = block[start - first:end - first] if block is not None else os.pread(fd, end - start,
                                                                                          self.data_at + start)
            ty, tx = divmod(i, tx_n)
            th, tw = min(T, self.height - ty * T), min(T, self.width - tx * T)
            try:
                raw = _inflate(data, self.n_channels * th * tw)
            except EntryError as e:
                raise ImageReadError(self.source, f"its prepared copy {self.entry} is damaged ({e}); delete it "
                                     "and rerun (it is prepared again)") from None
            tiles[i] = np.frombuffer(raw, dtype=np.uint8).reshape(self.n_channels, th, tw)
        return tiles


def _inflate(data: bytes, want: int) -> bytes:
    """zlib-decompress ``data``, which must give exactly ``want`` bytes: never more is
    held, whatever a damaged file holds."""
    d = zlib.decompressobj()
    try:
        raw = d.decompress(data, want)
    except zlib.error as e:
        raise EntryError(f"zlib: {e}") from None
    if len(raw) != want or d.unconsumed_tail or not d.eof:
        raise EntryError(f"{len(raw)} bytes where {want} were expected")
    return raw


def write_entry(path: str | os.PathLike[str], image: torch.Tensor, view: torch.Tensor, stamp: dict) -> int:
    """Write the entry of uint8 ``image`` [C, H, W] and its float32 ``view`` [C, h, w]
    to ``path`` atomically (:mod:`ats_cli.io`): a killed preparer leaves the old entry or
    none, never half of one. ``stamp`` (the source file's identity) goes into the header.
    Returns the bytes written."""
    pixels = image.numpy()
    C, H, W = pixels.shape
    view_bytes = _sparse(view.numpy())
    ty_n, tx_n = -(-H // TILE), -(-W // TILE)
    index = np.zeros(ty_n * tx_n + 1, dtype="<i8")
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(PREFIX.pack(MAGIC, 0, 0))
        fh.write(view_bytes)
        data_at = fh.tell()
        for ty in range(ty_n):
            for tx in range(tx_n):
                tile = pixels[:, ty * TILE:(ty + 1) * TILE, tx * TILE:(tx + 1) * TILE]
                i = ty * tx_n + tx
                blob = zlib.compress(np.ascontiguousarray(tile).tobytes(), LEVEL) if tile.any() else b""
                fh.write(blob)
                index[i + 1] = index[i] + len(blob)
        index_at = fh.tell()
        fh.write(index.tobytes())
        header = {**stamp, "channels": C, "height": H, "width": W, "tile": TILE, "view": list(view.shape),
                  "view_at": PREFIX.size, "view_len": len(view_bytes), "data_at": data_at, "index_at": index_at,
                  "view_crc": zlib.crc32(view_bytes), "index_crc": zlib.crc32(index.tobytes())}
        text = _header_text(header)
        header_at = fh.tell()
        fh.write(text)
        fh.seek(0)
        fh.write(PREFIX.pack(MAGIC, header_at, len(text)))
        total = header_at + len(text)
    return total


def read_entry(path: str | os.PathLike[str]) -> tuple[dict, int, os.stat_result]:
    """An entry's header, an open descriptor on it (the caller closes it) and its stat.
    :class:`EntryError` when it is missing, damaged or of another format."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise EntryError(f"{path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        magic, at, length = PREFIX.unpack(os.pread(fd, PREFIX.size, 0).ljust(PREFIX.size, b"\0"))
        if magic != MAGIC or not 0 < length <= MAX_HEADER or at + length != st.st_size:
            raise EntryError(f"{path}: not a whole prepared entry")
        header = json.loads(os.pread(fd, length, at))
        if not isinstance(header, dict):
            raise EntryError(f"{path}: not a whole prepared entry")
        if header.pop("header_crc", None) != zlib.crc32(json.dumps(header, sort_keys=True).encode()):
            raise EntryDamaged(f"{path}: its header does not match its checksum")
    except (EntryError, ValueError, OSError) as e:
        os.close(fd)
        raise e if isinstance(e, EntryError) else EntryError(f"{path}: {e}") from None
    return header, fd, st


def _header_text(header: dict) -> bytes:
    """The header as stored: its JSON with the CRC-32 of its canonical JSON (``header_crc``)."""
    canonical = json.dumps(header, sort_keys=True).encode()
    return json.dumps({**header, "header_crc": zlib.crc32(canonical)}, sort_keys=True).encode()


def _sparse(view: np.ndarray) -> bytes:
    """The view as a bit mask of its non-zero values, then those values (float32)."""
    flat = np.ascontiguousarray(view, dtype=np.float32).ravel()
    keep = flat != 0
    return np.packbits(keep).tobytes() + flat[keep].tobytes()


def entry_view(path: Path, header: dict, fd: int) -> torch.Tensor:
    """The stored low-res view [C, h, w] float32 of an open entry; ``header["view"]``
    must have been checked by the caller (it sets what is allocated)."""
    shape = tuple(int(s) for s in header["view"])
    n = int(np.prod(shape))
    data = os.pread(fd, int(header["view_len"]), int(header["view_at"]))
    if zlib.crc32(data) != header.get("view_crc"):
        raise EntryDamaged(f"{path}: its view does not match its checksum")
    packed = np.frombuffer(data, dtype=np.uint8, count=min(len(data), -(-n // 8)))
    keep = np.unpackbits(packed, count=n).view(bool) if len(packed) * 8 >= n else None
    values = np.frombuffer(data, dtype=np.uint8, offset=len(packed))
    if keep is None or len(values) != 4 * int(np.count_nonzero(keep)):
        raise EntryDamaged(f"{path}: its view is damaged")
    out = np.zeros(n, dtype=np.float32)
    out[keep] = values.view(np.float32)
    return torch.from_numpy(out.reshape(shape))


def check_index(path: Path, header: dict, fd: int) -> None:
    """Raise :class:`EntryDamaged` unless the tile index of an open entry matches its checksum."""
    T = int(header["tile"])
    n = -(-int(header["height"]) // T) * -(-int(header["width"]) // T) + 1
    if zlib.crc32(os.pread(fd, 8 * n, int(header["index_at"]))) != header.get("index_crc"):
        raise EntryDamaged(f"{path}: its tile index does not match its checksum")


def verify_entry(path: Path) -> dict:
    """The header of the entry at ``path`` once its header, view and tile index match
    their checksums (the tiles carry zlib's own, checked as they are decoded).
    :class:`EntryDamaged` when they do not, :class:`EntryError` when there is no entry."""
    header, fd, _ = read_entry(path)
    try:
        entry_view(path, header, fd)
        check_index(path, header, fd)
    except (KeyError, ValueError, TypeError, OSError) as e:
        if isinstance(e, EntryError):
            raise
        raise EntryDamaged(f"{path}: {e}") from None
    finally:
        os.close(fd)
    return header


def entry_source(path: Path, header: dict, st: os.stat_result) -> PreparedSource:
    """The patch source of an entry whose header was read with :func:`read_entry`."""
    return PreparedSource(entry=str(path), source=str(header["source"]), height=int(header["height"]),
                          width=int(header["width"]), n_channels=int(header["channels"]), tile=int(header["tile"]),
                          index_at=int(header["index_at"]), data_at=int(header["data_at"]), inode=st.st_ino,
                          mtime_ns=st.st_mtime_ns, index_crc=int(header["index_crc"]))


def restamp_entry(path: str | os.PathLike[str], stamp: dict) -> None:
    """Rewrite the entry at ``path`` with ``stamp`` in its header and its pixels as they
    are: for a source whose stat changed but whose content (digest) did not. Atomic, and
    copied in blocks, so memory does not grow with the entry."""
    header, fd, _ = read_entry(path)
    try:
        header.update(stamp)
        text = _header_text(header)
        _, header_at, _ = PREFIX.unpack(os.pread(fd, PREFIX.size, 0))
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            fh.write(PREFIX.pack(MAGIC, header_at, len(text)))
            at = PREFIX.size
            while at < header_at:
                block = os.pread(fd, min(1 << 20, header_at - at), at)
                if not block:
                    raise EntryError(f"{path}: shorter than its header says")
                fh.write(block)
                at += len(block)
            fh.write(text)
    finally:
        os.close(fd)


# ---------------------------------- the store: where entries live, when one may be used
ENV = "ATS_PREPARED"
FOLDER = ".ats-prepared"
FORMAT = 2  # bump when what an entry holds changes: old entries then stop matching


def made_by() -> str:
    """The versions an entry's pixels and view come from: the decoder (Pillow and the
    libraries it bundles) and the resize (torch). An entry made by others may differ from
    what reading the source gives now, bit for bit, so it is not used: prepared again."""
    import PIL
    import torch

    return f"format {FORMAT}, Pillow {PIL.__version__}, torch {torch.__version__}"
SUFFIX = ".atsp"


def file_stamp(path: str | os.PathLike[str]) -> dict:
    """What identifies a source file's content at read time: size, mtime_ns, ctime_ns; for a
    URL, size, ETag and Last-Modified (:func:`ats_cli.data.remote.remote_stat`: a
    RemoteReadError naming it when it cannot be asked)."""
    if is_url(path):
        stat_ = remote_stat(path)
        return {"bytes": stat_["bytes"], "etag": stat_["etag"], "last_modified": stat_["last_modified"]}
    st = os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def settled(header: dict) -> bool:
    """Whether an entry's stamp proves its source unchanged while the stamp still matches
    (:func:`ats_cli.io.settled`: taken at least a timestamp tick after the source last
    changed); an entry whose stamp does not is used only once the source's digest matches.
    A URL's stamp is settled when the server gave a validator (ETag or Last-Modified)."""
    if "etag" in header:
        return bool(header.get("etag") or header.get("last_modified"))
    try:
        return _settled(int(header["stamped_ns"]), int(header["mtime_ns"]), int(header["ctime_ns"]))
    except (KeyError, TypeError, ValueError):
        return False


def source_digest(source: str | os.PathLike[str]) -> str:
    """BLAKE2b of a source file's bytes (streamed: memory does not grow with the file; a
    URL's, fetched whole as it is to be decoded, under the same cap)."""
    if is_url(source):
        return hashlib.blake2b(fetch_bytes(source)).hexdigest()
    with open(source, "rb") as fh:
        return hashlib.file_digest(fh, "blake2b").hexdigest()


def store_folder(root: str | os.PathLike[str]) -> tuple[Path | None, str]:
    """Where the prepared entries of the dataset at ``root`` go, and why there (one line
    for the log); None when ``ATS_PREPARED=off``."""
    where = os.environ.get(ENV, "").strip()
    if where.lower() in ("off", "0", "none", "no"):
        return None, f"{ENV}={where}: preparing is off"
    if where:
        return Path(where).expanduser() / _digest(str(Path(root).resolve()))[:16], f"{ENV}={where}"
    beside = Path(root) / FOLDER
    # one look at the folder decides: asked twice (is it a directory? does it exist?), a
    # second preparer creating it in between made the first take the cache below
    try:
        mode = os.stat(beside).st_mode
    except (FileNotFoundError, NotADirectoryError):
        usable = os.access(root, os.W_OK | os.X_OK)
    else:
        usable = stat.S_ISDIR(mode) and os.access(beside, os.W_OK | os.X_OK)
    if usable:
        return beside, "beside the dataset"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ats" / "prepared"
    return cache / _digest(str(Path(root).resolve()))[:16], f"{root} is not writable"


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


_MADE_BY = made_by()


class PreparedStore:
    """The prepared entries of one dataset for one way of reading it (channels, scale).

    Picklable (paths and numbers), so the dataset hands it to the DataLoader workers.
    ``max_pixels`` is the pixel budget :func:`ats_cli.data.inputs.open_input` applies;
    an entry is never used for an image the budget would refuse.
    """

    def __init__(self, folder: str | os.PathLike[str], root: str | os.PathLike[str], *, channels: int,
                 scale: float, max_pixels: int | None = None):
        self.folder = Path(folder)
        self.root = Path(root).resolve()
        self.channels = int(channels)
        self.scale = float(scale)
        self.max_pixels = max_pixels
        self._names: dict[str | os.PathLike[str], Path] = {}

    def entry_path(self, source: str | os.PathLike[str]) -> Path:
        """The entry of ``source`` (remembered: it is asked at every read)."""
        known = self._names.get(source)
        if known is None:
            known = self._names[source] = self._name(source)
        return known

    def _name(self, source: str | os.PathLike[str]) -> Path:
        if is_url(source):  # named by the URL itself
            name = source
        else:
            path = Path(source)
            try:
                name = str(path.relative_to(self.root))
            except ValueError:
                name = str(path)
        what = {"format": FORMAT, "source": name, "channels": self.channels, "scale": repr(self.scale)}
        return self.folder / (_digest(json.dumps(what, sort_keys=True)) + SUFFIX)

    @staticmethod
    def applies(source: str | os.PathLike[str]) -> bool:
        """Whether ``source`` is one of the files preparing is for: read whole (PNG, JPEG,
        ...), not by the lazy slide readers, which read only the patches already."""
        return backend(source) not in LAZY_BACKENDS

    def is_fresh(self, source: str | os.PathLike[str]) -> bool:
        """Whether ``source`` has a whole entry that matches the file as it is now."""
        return self.check(source)[0] != "stale"

    def check(self, source: str | os.PathLike[str]) -> tuple[str, str | None]:
        """(state, damage) of the entry of ``source``. state: "fresh" (whole, by its
        checksums, and its settled stamp matches the file: :func:`settled`), "verified"
        (whole, the stamp matches but is too recent to prove it, and the file's digest
        matches), else "stale". ``damage`` says what is wrong with an entry that exists
        but is not what was written, else None."""
        try:
            header = verify_entry(self.entry_path(source))
        except EntryDamaged as e:
            return "stale", str(e)
        except EntryError:
            return "stale", None
        try:
            if not self._matches(header, file_stamp(source)):
                return "stale", None
            if settled(header):
                return "fresh", None
            return ("verified" if source_digest(source) == header.get("digest") else "stale"), None
        except (OSError, ImageReadError):  # ImageReadError: a URL that cannot be fetched
            return "stale", None

    def _matches(self, header: dict, stamp: dict) -> bool:
        return self.same_making(header) and all(header.get(k) == v for k, v in stamp.items())

    def same_making(self, header: dict) -> bool:
        """Whether an entry's pixels and view are what reading its source this way gives
        (the same channels, scale and library versions), whatever its stamp says."""
        return (header.get("made_by") == _MADE_BY and header.get("channels") == self.channels
                and header.get("scale") == repr(self.scale))

    @property
    def made_by(self) -> str:
        return _MADE_BY

    def open_input(self, source: str | os.PathLike[str], *, patch_size: tuple[int, int],
                   tissue: bool | None = None) -> OpenedImage | None:
        """What :func:`~ats_cli.data.inputs.open_input` returns for ``source``, bit for bit,
        from its entry: the stored view and a :class:`PreparedSource`. None when there is
        no usable entry (none yet, damaged, or the source changed since): the caller then
        reads the source itself. A deleted source is None too, and reading it names it."""
        path = self.entry_path(source)
        try:
            stamp = file_stamp(source)
            header, fd, st = read_entry(path)
        except EntryDamaged as e:
            _damaged(source, path, e)
            return None
        except (OSError, EntryError, ImageReadError):  # ImageReadError: a URL that cannot be fetched
            return None
        try:
            if not self._matches(header, stamp):
                return None
            if not settled(header) and source_digest(source) != header.get("digest"):
                return None  # rewritten within the stamp's tick: the times cannot tell, the bytes do
            source_ = entry_source(path, header, st)
            H, W = source_.size
            limit = max_pixels_limit(self.max_pixels)
            if H * W > limit:  # as decode_pil refuses it, from the header
                raise over_budget(source, f"{W}x{H} (width x height)", H * W, limit)
            if header["view"] != [self.channels, *low_res_size((H, W), self.scale)] or header["tile"] != TILE:
                return None
            view = entry_view(path, header, fd)
            check_index(path, header, fd)
        except (EntryError, KeyError, ValueError, TypeError, OSError) as e:
            if isinstance(e, ImageReadError):
                raise
            if isinstance(e, EntryDamaged):
                _damaged(source, path, e)
            return None
        finally:
            os.close(fd)
        ph, pw = patch_size
        if H < ph or W < pw:
            raise ImageReadError(source, f"is {W}x{H} pixels (width x height), smaller than the model's {pw}x{ph} "
                                 "patch")
        support = None
        if tissue:  # open_input: ordinary images get a mask only when asked
            from ats_cli.data.slides import tissue_mask

            support = tissue_mask(view)
        return OpenedImage(low=view, source=source_, support=support)


def _damaged(source: str | os.PathLike[str], path: Path, e: EntryError) -> None:
    """One line for a damaged entry met while reading, which is then removed: the image
    is read from its file (the same result) and the next preparation makes it again."""
    with contextlib.suppress(OSError):
        path.unlink()
    print(f"warning: {source}: its prepared copy is damaged ({e}); read from the file instead, and made again by "
          "the next preparation", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- preparing
MIN_FREE_BYTES = 2 << 30  # preparing stops before the file system keeps less than this free
POOL_FROM = 16  # fewer files are prepared in this process: starting processes would cost more


@dataclass
class PrepareReport:
    """What a preparation did, for the log and for tests."""

    folder: Path
    total: int = 0  # files preparing applies to
    fresh: int = 0  # already prepared and unchanged
    prepared: int = 0
    restamped: int = 0  # stat changed, content not: header rewritten only
    failed: list[tuple[str, str]] = field(default_factory=list)  # (file, problem): read unprepared, fails there
    no_room: int = 0  # left unprepared: the disk was full
    entry_bytes: int = 0  # of every entry of these files, after the run
    source_bytes: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        done = f"{self.prepared} prepared, {self.restamped} re-stamped, {self.fresh} already done"
        extra = f", {len(self.failed)} unreadable (first: {self.failed[0][0]}: {self.failed[0][1]})" \
            if self.failed else ""
        room = f", {self.no_room} left unprepared: less than {MIN_FREE_BYTES >> 30} GiB free" if self.no_room else ""
        ratio = self.entry_bytes / max(self.source_bytes, 1)
        return (f"prepared images in {self.folder}: {done}{extra}{room} of {self.total} in {self.seconds:.1f} s; "
                f"{self.entry_bytes / 2**20:.1f} MiB, {ratio:.2f}x the source files")


LOCK_POLL_S = 0.25  # how often a waiting preparer looks at the lock (and at its holder)


@contextlib.contextmanager
def preparer_lock(folder: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold the store's preparer lock; when another process holds it, say so and wait.

    The lock file records its holder (:mod:`ats_cli.io`). Waiting polls rather than
    blocks, so that a holder that dies is noticed: a lock still held when its recorded
    holder is gone (held by processes that inherited it, such as the orphaned workers of
    a preparer killed by an older version) is taken over with one line saying so, as is
    the record a killed preparer left behind. No forked worker inherits the lock."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".lock"
    waiting, suspect = False, None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        if fcntl is None:
            break
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_record(fd)
            # seen twice, LOCK_POLL_S apart: a new holder writes its record just after locking
            if owner_gone(holder) and holder == suspect:
                log(f"taking over the preparation lock {path}: its holder, pid {holder.get('pid')}, is gone "
                    "(processes it left behind still hold the old lock file)")
                with contextlib.suppress(OSError):
                    if os.stat(path).st_ino == os.fstat(fd).st_ino:
                        path.unlink()
                os.close(fd)
                continue
            os.close(fd)
            suspect = holder
            if not waiting and not owner_gone(holder):
                log(f"waiting for another preparation of {folder} to finish")
                waiting = True
            time.sleep(LOCK_POLL_S)
            continue
        except BaseException:
            os.close(fd)
            raise
        try:  # the file locked must still be the one named .lock (a takeover removes the old one)
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    held(fd)
    try:
        previous = read_record(fd)
        if previous and owner_gone(previous):
            log(f"taking over the preparation lock {path} of pid {previous.get('pid')}, which stopped without "
                "releasing it; its unfinished files are swept")
        write_record(fd)
        yield
    finally:
        released(fd)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # released on purpose: nobody to take it over from
        os.close(fd)  # drops the lock


def prepare(store: PreparedStore, sources: Iterable[str | os.PathLike[str]], *, workers: int = 1,
            progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] = print,
            min_free: int = MIN_FREE_BYTES) -> PrepareReport:
    """Prepare every file of ``sources`` that preparing applies to and that has no fresh
    entry, with ``workers`` processes (1: in this process). ``progress(done, total)``
    after each file. Unreadable files are reported, not raised: the loader reads them as
    without preparing and names them there. Raises OSError when the store cannot be
    written."""
    start = time.perf_counter()
    files = list(dict.fromkeys(str(s) for s in sources if store.applies(s)))
    report = PrepareReport(store.folder, total=len(files))
    with preparer_lock(store.folder, log):
        sweep_temporaries(store.folder)
        pending = []
        for s in files:
            state, damage = store.check(s)
            if damage:  # removed, so that it is made again, never re-stamped
                log(f"{s}: its prepared copy is damaged ({damage}); preparing it again")
                store.entry_path(s).unlink(missing_ok=True)
            if state == "verified":  # proven by content: stamped anew, so reads need not digest it
                _restamp_if_settled(store, s)
            elif state == "stale":
                pending.append(s)
        report.fresh = len(files) - len(pending)
        if progress:
            progress(report.fresh, report.total)
        for i, (source, status, problem) in enumerate(_run(store, pending, workers, min_free), 1):
            if status == "prepared":
                report.prepared += 1
            elif status == "restamped":
                report.restamped += 1
            elif status == "no room":
                report.no_room += 1
            else:
                report.failed.append((source, problem))
            if progress:
                progress(report.fresh + i, report.total)
    for s in files:
        with contextlib.suppress(OSError):
            report.source_bytes += os.path.getsize(s)
            report.entry_bytes += os.path.getsize(store.entry_path(s))
    report.seconds = time.perf_counter() - start
    return report


def _run(store: PreparedStore, pending: list[str], workers: int,
         min_free: int) -> Iterator[tuple[str, str, str]]:
    if workers <= 1 or len(pending) < POOL_FROM:
        for source in pending:
            yield prepare_one(store, source, min_free)
        return
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(max_workers=min(workers, len(pending)), mp_context=ctx, initializer=_worker_init,
                               initargs=(os.getpid(),))
    try:
        yield from pool.map(prepare_one, [store] * len(pending), pending, [min_free] * len(pending),
                            chunksize=max(1, min(16, len(pending) // (4 * workers))))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _worker_init(parent: int) -> None:
    """One thread per preparing process (the work is per image), and Ctrl-C goes to the
    parent alone, which stops the pool: finished entries are kept. A worker dies with
    its parent (:func:`ats_cli.io.die_with_parent`): after a kill -9 of the preparer
    no orphan goes on, and none holds the store's lock (that is closed at the fork)."""
    die_with_parent(parent)
    import torch

    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _restamp_if_settled(store: PreparedStore, source: str) -> None:
    """Re-stamp the verified entry of ``source`` when a stamp taken now would be settled
    (left as it is otherwise: rewriting it would prove nothing more)."""
    if is_url(source):  # a URL's stamp is settled or never (settled()): nothing to wait for
        return
    with contextlib.suppress(OSError, EntryError):
        stamped = time.time_ns()
        stamp = file_stamp(source)
        if _settled(stamped, stamp["mtime_ns"], stamp["ctime_ns"]):
            header, fd, _ = read_entry(store.entry_path(source))
            os.close(fd)
            if all(header.get(k) == v for k, v in stamp.items()):
                restamp_entry(store.entry_path(source), {**stamp, "stamped_ns": stamped})


def prepare_one(store: PreparedStore, source: str, min_free: int = MIN_FREE_BYTES) -> tuple[str, str, str]:
    """Prepare one file: (source, "prepared" | "restamped" | "no room" | "failed", problem).
    A source that cannot be read is "failed"; a store that cannot be written raises OSError."""
    path = store.entry_path(source)
    try:
        stamped = time.time_ns()  # before the stat: settled() measures from here
        before = file_stamp(source)
        digest = source_digest(source)
    except OSError as e:
        return source, "failed", e.strerror or str(e)
    except ImageReadError as e:  # a URL that cannot be fetched
        return source, "failed", e.problem
    with contextlib.suppress(EntryError):  # same content, new or unsettled stamp (copied, touched): keep the pixels
        header = verify_entry(path)
        if header.get("digest") == digest and store.same_making(header):
            restamp_entry(path, {**before, "stamped_ns": stamped})
            return source, "restamped", ""
    if shutil.disk_usage(store.folder).free < min_free:
        return source, "no room", ""
    try:
        image = read_image(source, store.channels, max_pixels=store.max_pixels)
    except ImageReadError as e:
        return source, "failed", e.problem
    view = low_res_view(image, store.scale)
    try:
        changed = file_stamp(source) != before
    except (OSError, ImageReadError):
        changed = True
    if changed:
        return source, "failed", "changed while being prepared"
    write_entry(path, image, view, {**before, "stamped_ns": stamped, "digest": digest, "made_by": store.made_by,
                                    "scale": repr(store.scale), "source": source})
    return source, "prepared", ""


# -------------------------------------------------------------------- in a training run
def prepare_for_run(enabled: bool, data: Any, reading: dict[str, Any], *, workers: int = 1,
                    log: Callable[[str], None] = print, splits: Sequence[str] | None = None) -> PreparedStore | None:
    """The prepared store the run's datasets read from (prepared now where needed), or
    None: not ``enabled`` (``--no-prepare``), ``ATS_PREPARED=off``, every file read lazily anyway (a reader,
    level or mpp asked for), or no store could be made. ``data``: the loaded
    :class:`~ats_cli.data.dataset.Dataset`; ``reading``: the datasets' reading options."""
    if not enabled or any(reading.get(k) is not None for k in ("reader", "level", "mpp")):
        return None
    folder, why = store_folder(data.root)
    if folder is None:
        log(f"not preparing the images: {why}")
        return None
    store = PreparedStore(folder, data.root, channels=reading["channels"], scale=reading["scale"])
    sources = [r.path for split in (splits or list(data.splits)) for r in data.splits[split]]
    if not any(store.applies(s) for s in sources):
        return None
    try:
        report = prepare(store, sources, workers=max(1, workers), log=log)
    except OSError as e:
        log(f"warning: cannot prepare the images in {folder} ({e.strerror or e}); reading the source files "
            "(same results, slower; --no-prepare hides this)")
        return store  # whatever entries exist are used, the rest is read from the sources
    if report.prepared or report.restamped or report.failed or report.no_room:
        log(report.line() + ("" if why == "beside the dataset" else f" ({why})"))
    return store
