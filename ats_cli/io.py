"""Writing files safely: the files ats writes for users and for later runs (checkpoints,
dataset CSVs and JSON, predictions, metrics, figures, generated images, dataset copies)
go through here.

Why one place: a file is replaced in one step, readers (a resumed run, ``ats predict``
reading a checkpoint another process is saving, a user's spreadsheet) see either the
old file or the new one, and a crash or Ctrl-C never leaves half a file behind. The
temporary files share one name pattern, so an interrupted run's leftovers are
recognisable (:func:`sweep_temporaries`).

Imports nothing beyond the standard library: ``ats --help`` and the torch-free dataset
modules use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_bytes", "atomic_write_text", "check_writable", "sweep_temporaries", "settled",
           "COARSE_SETTLE_NS", "FINE_SETTLE_NS"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; on success it replaces
    ``path`` in one step (readers see either the old file or the new one), on any error
    it is deleted.

    The temporary file lives in the destination directory (``os.replace`` is only atomic
    within one file system) and is named ``.<name>.<pid>.tmp`` so an interrupted run's
    leftovers are recognisable and can be swept (:func:`sweep_temporaries`). Whatever
    the body puts there (a file, a symlink) is what ``path`` becomes.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_path`).

    ``fsync`` makes the content durable before the rename (power loss); callers that
    verify their files on reuse anyway, like the image generator, may skip it for speed.
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """UTF-8 text variant of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def sweep_temporaries(folder: str | os.PathLike[str]) -> None:
    """Delete the temporary files (``.<name>.<pid>.tmp``, :func:`atomic_path`) that an
    interrupted run left behind in ``folder``."""
    for stray in Path(folder).glob(".*.tmp"):
        stray.unlink(missing_ok=True)


def check_writable(path: str | os.PathLike[str]) -> None:
    """Raise OSError (with the reason) unless a file can be written at ``path``: checked
    before any work, so that an unwritable output is not found out after hours of it.
    Creates the parent directory (the write would), writes and removes a probe file (also
    when the write fails)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file where a directory must be
        blocker = next((p for p in [path.parent, *path.parent.parents] if p.exists() and not p.is_dir()), path.parent)
        raise NotADirectoryError(errno.ENOTDIR, f"{blocker} is a file, not a directory", str(path)) from None
    probe = path.with_name(f".{path.name}.{os.getpid()}.probe")
    try:
        with open(probe, "wb") as fh:
            fh.write(b"\0")
    finally:  # a full disk creates the probe, then refuses its byte: nothing is left behind either way
        probe.unlink(missing_ok=True)


COARSE_SETTLE_NS = 2_000_000_000  # whole-second timestamps (ext3, FAT's 2 s, many network file systems)
FINE_SETTLE_NS = 50_000_000  # sub-second timestamps: set from a clock that ticks every 1-10 ms


def settled(stamped_ns: int, mtime_ns: int, ctime_ns: int) -> bool:
    """Whether a file's (size, mtime, ctime), read at ``stamped_ns`` (``time.time_ns()``
    taken just before the stat), prove the file unchanged for as long as they stay the same.

    Why not always: a file system keeps times at its own resolution, and a rewrite within
    the same tick as the stamp, keeping the size, leaves size, mtime and ctime all as they
    were (ctime cannot be restored by a user, but it cannot move within a tick either).
    Any change later than one tick after the file's last change moves ctime past it, so
    a stamp taken at least a tick after that change is proof; one taken sooner is not,
    and the caller then compares content (git's "racily clean" rule). The tick is read
    from the times themselves: whole seconds (both on a 1 s or 2 s file system, or
    an mtime restored to a whole second) take :data:`COARSE_SETTLE_NS`, others
    :data:`FINE_SETTLE_NS`. A file just written (a dataset generated a moment ago) is
    therefore checked by content once, then proven by its times."""
    coarse = mtime_ns % 1_000_000_000 == 0 or ctime_ns % 1_000_000_000 == 0
    return stamped_ns - max(mtime_ns, ctime_ns) >= (COARSE_SETTLE_NS if coarse else FINE_SETTLE_NS)


def load_refusal(e: BaseException) -> tuple[str | None, str]:
    """What ``torch.load(weights_only=True)``'s refusal ``e`` says, without PyTorch's advice to
    load with ``weights_only=False`` (for a file from elsewhere that means running whatever
    code it carries, the very thing the refusal prevented): the Python object it met, ""
    when it met one it did not name, None when the file failed for another reason; and the
    message's first line without that advice, for the other reasons."""
    import re

    text = str(e).strip()
    blocked = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"Unsupported operand (\d+)", text)
    lines = [line.strip() for line in text.splitlines() if line.strip() and "weights_only" not in line]
    first = lines[0] if lines else type(e).__name__
    if blocked or "Weights only load failed" in text:
        return (f" ({blocked.group(1)})" if blocked else ""), first
    return None, first
