"""One prepared image on disk: its low-res view and its pixels in compressed tiles, and
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
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ats_cli.data.images import ImageReadError
from ats_cli.io import atomic_path

__all__ = ["TILE", "EntryError", "PreparedSource", "entry_source", "entry_view", "read_entry", "restamp_entry",
           "write_entry"]

MAGIC = b"ATSPREP1"
PREFIX = struct.Struct("<8sQQ")
TILE = 64
LEVEL = 1  # zlib level: 6 shrinks tiles ~15% more and decodes several times slower
SPAN = 1 << 20  # tiles this close together are read in one call
MAX_HEADER = 1 << 20  # a larger "header" is damage, not an entry


class EntryError(ValueError):
    """A prepared entry that cannot be read as one (missing, damaged, another format)."""


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
            index = np.frombuffer(os.pread(fd, 8 * (-(-H // T) * tx_n + 1), self.index_at), dtype="<i8").tolist()
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
                  "view_at": PREFIX.size, "view_len": len(view_bytes), "data_at": data_at, "index_at": index_at}
        text = json.dumps(header, sort_keys=True).encode()
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
    except (EntryError, ValueError, OSError) as e:
        os.close(fd)
        raise e if isinstance(e, EntryError) else EntryError(f"{path}: {e}") from None
    return header, fd, st


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
    packed = np.frombuffer(data, dtype=np.uint8, count=min(len(data), -(-n // 8)))
    keep = np.unpackbits(packed, count=n).view(bool) if len(packed) * 8 >= n else None
    values = np.frombuffer(data, dtype=np.uint8, offset=len(packed))
    if keep is None or len(values) != 4 * int(np.count_nonzero(keep)):
        raise EntryError(f"{path}: its view is damaged")
    out = np.zeros(n, dtype=np.float32)
    out[keep] = values.view(np.float32)
    return torch.from_numpy(out.reshape(shape))


def entry_source(path: Path, header: dict, st: os.stat_result) -> PreparedSource:
    """The patch source of an entry whose header was read with :func:`read_entry`."""
    return PreparedSource(entry=str(path), source=str(header["source"]), height=int(header["height"]),
                          width=int(header["width"]), n_channels=int(header["channels"]), tile=int(header["tile"]),
                          index_at=int(header["index_at"]), data_at=int(header["data_at"]), inode=st.st_ino,
                          mtime_ns=st.st_mtime_ns)


def restamp_entry(path: str | os.PathLike[str], stamp: dict) -> None:
    """Rewrite the entry at ``path`` with ``stamp`` in its header and its pixels as they
    are: for a source whose stat changed but whose content (digest) did not. Atomic, and
    copied in blocks, so memory does not grow with the entry."""
    header, fd, _ = read_entry(path)
    try:
        header.update(stamp)
        text = json.dumps(header, sort_keys=True).encode()
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
