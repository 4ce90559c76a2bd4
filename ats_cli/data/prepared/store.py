"""Where prepared entries live, what each is named, and when one may be used.

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
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ats_cli.core.source import low_res_size
from ats_cli.data.dataset import LAZY_BACKENDS, backend
from ats_cli.data.images import ImageReadError, max_pixels_limit, over_budget
from ats_cli.data.inputs import OpenedImage
from ats_cli.data.prepared.entry import TILE, EntryError, entry_source, entry_view, read_entry

__all__ = ["ENV", "FOLDER", "FORMAT", "PreparedStore", "file_stamp", "made_by", "store_folder"]

ENV = "ATS_PREPARED"
FOLDER = ".ats-prepared"
FORMAT = 1  # bump when what an entry holds changes: old entries then stop matching


def made_by() -> str:
    """The versions an entry's pixels and view come from: the decoder (Pillow and the
    libraries it bundles) and the resize (torch). An entry made by others may differ from
    what reading the source gives now, bit for bit, so it is not used: prepared again."""
    import PIL
    import torch

    return f"format {FORMAT}, Pillow {PIL.__version__}, torch {torch.__version__}"
SUFFIX = ".atsp"


def file_stamp(path: str | os.PathLike[str]) -> dict:
    """What identifies a source file's content at read time: size, mtime_ns, ctime_ns."""
    st = os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def store_folder(root: str | os.PathLike[str]) -> tuple[Path | None, str]:
    """Where the prepared entries of the dataset at ``root`` go, and why there (one line
    for the log); None when ``ATS_PREPARED=off``."""
    where = os.environ.get(ENV, "").strip()
    if where.lower() in ("off", "0", "none", "no"):
        return None, f"{ENV}={where}: preparing is off"
    if where:
        return Path(where).expanduser() / _digest(str(Path(root).resolve()))[:16], f"{ENV}={where}"
    beside = Path(root) / FOLDER
    if beside.is_dir() and os.access(beside, os.W_OK | os.X_OK) or not beside.exists() and os.access(root, os.W_OK):
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
        """Whether ``source`` has an entry that matches the file as it is now."""
        try:
            header, fd, _ = read_entry(self.entry_path(source))
        except EntryError:
            return False
        os.close(fd)
        try:
            return self._matches(header, file_stamp(source))
        except OSError:
            return False

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
        except (OSError, EntryError):
            return None
        try:
            if not self._matches(header, stamp):
                return None
            source_ = entry_source(path, header, st)
            H, W = source_.size
            limit = max_pixels_limit(self.max_pixels)
            if H * W > limit:  # as decode_pil refuses it, from the header
                raise over_budget(source, f"{W}x{H} (width x height)", H * W, limit)
            if header["view"] != [self.channels, *low_res_size((H, W), self.scale)] or header["tile"] != TILE:
                return None
            view = entry_view(path, header, fd)
        except (EntryError, KeyError, ValueError, TypeError, OSError) as e:
            if isinstance(e, ImageReadError):
                raise
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
