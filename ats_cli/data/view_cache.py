"""The low-res views and tissue masks of slides, computed once per run and kept on disk.

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
read back. Its name is a hash of the file's resolved path, size, modification time (ns)
and content digest (:func:`content_digest`: its first and last 64 KiB) and of the
reader, level, channels, pixel budget and scale: a slide rewritten or touched gets a new
entry, and so does a slide replaced by another of the same size whose modification time
was kept (``cp -p``, ``rsync -t``, an archive unpacked), which size and time alone took
for the old one; old entries are never read again (delete the folder to reclaim
the space; it is rebuilt on the next epoch). Written atomically (:mod:`ats_cli.io`), so a
worker killed mid-write or two writing the same entry leave a whole file or none.

A folder that cannot be written (not a directory, read-only, a full disk) is one line of
warning, once per process, and the run goes on computing views without storing them: the
cache only saves time, so a run that would have been correct without it is not stopped
for it (a training run of hours lost to a full cache disk would be the worse answer).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch

from ats_cli.io import atomic_path

__all__ = ["ViewCache", "view_cache_for", "ENV", "FORMAT"]

ENV = "ATS_VIEW_CACHE"
FORMAT = 1  # bump when what is stored changes: old entries then simply stop matching
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


class ViewCache:
    """Low-res views and tissue masks of lazily read slides, one file each in ``folder``."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.folder = Path(folder)
        self.writable = True  # False after a write failed: computed, not stored (module docstring)

    def key(self, slide, scale: float) -> str:
        """The entry's name: the file as it is now (path, size, mtime, content digest) and
        what is asked of it."""
        st = os.stat(slide.path)
        what = {"format": FORMAT, "path": str(Path(slide.path).resolve()), "bytes": st.st_size,
                "mtime_ns": st.st_mtime_ns, "content": content_digest(slide.path),
                "reader": slide.name, "level": slide.level, "size": list(slide.size),
                "channels": slide.channels, "max_pixels": slide.max_pixels, "scale": repr(float(scale)),
                "resampled": repr(float(getattr(slide, "factor", 1.0)))}  # --mpp: the level's resampling
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
              f"(slower: views are remade every epoch; set {ENV}=DIR elsewhere, or {ENV}=off)",
              file=sys.stderr, flush=True)

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

        path = self.folder / f"{self.key(slide, scale)}.npz"
        size = tuple(low_res_size(slide.size, scale))
        low = mask = None
        try:
            with np.load(path, allow_pickle=False) as z:
                low, mask = z["low"], z["mask"]
            if low.dtype != np.uint8 or low.shape != (*size, slide.channels) or mask.shape != size \
                    or mask.dtype != bool:
                low = None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError):  # missing or damaged: recompute
            low = None
        if low is None:
            low = slide.low_res(size)
            mask = tissue_mask(_as_view(low)).numpy()
            self._store(path, low, mask)
        return _as_view(low), torch.from_numpy(np.array(mask, dtype=bool))


def _as_view(low: np.ndarray) -> torch.Tensor:
    """uint8 [h, w, C] -> [C, h, w] float in [0, 1], as ``SlideReader.low_res_view`` makes it."""
    return torch.from_numpy(np.array(low, copy=True)).permute(2, 0, 1).float() / 255.0


def view_cache_for(run: str | os.PathLike[str]) -> ViewCache | None:
    """The cache a run uses: ``RUN/cache/views``, or ``$ATS_VIEW_CACHE``; None when that is
    ``off``, or cannot be written (said once, here, in the process that starts the run,
    rather than once by each DataLoader worker)."""
    where = os.environ.get(ENV, "").strip()
    if where.lower() in ("off", "0", "none", "no"):
        return None
    cache = ViewCache(Path(where).expanduser() if where else Path(run) / "cache" / "views")
    return cache if cache.probe() else None
