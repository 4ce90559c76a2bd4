"""Files that survive a crash: writing them safely, and locks that die with their owner.

**Writing files safely.** The files ats writes for users and for later runs (checkpoints,
dataset CSVs and JSON, predictions, metrics, figures, generated images, dataset copies)
go through here.

Why one place: a file is replaced in one step, readers (a resumed run, ``ats predict``
reading a checkpoint another process is saving, a user's spreadsheet) see either the
old file or the new one, and a crash or Ctrl-C never leaves half a file behind. The
temporary files share one name pattern, so an interrupted run's leftovers are
recognisable (:func:`sweep_temporaries`).

**Locks that die with their owner, and worker processes that die with their parent.**
Why: ``ats`` takes two OS file locks (``flock``): the run directory's
``RUN/.ats-train.lock`` (:class:`ats_cli.runtime.RunLock`) and the prepared store's
``.lock`` (:func:`ats_cli.data.prepared.preparer_lock`). The OS drops such a lock when
the *open file description* it was taken on is closed by every process that refers to
it, and a ``fork`` shares the description with the child. A worker forked while its
parent held a lock (the preparing pool, the DataLoader workers) therefore held it too:
after a ``kill -9`` of the parent the workers lived on as orphans, the lock with them,
and every later preparation or training on that dataset waited forever. ``O_CLOEXEC``
does not help here: it closes descriptors at ``exec``, and a forked worker never execs.

Three rules, each enough for the common case and together for the rest:

* **No child inherits a lock.** Every lock descriptor is registered here while held
  (:func:`held`), and :func:`os.register_at_fork` closes them all in every forked child
  before any of the child's own code runs. Closing a shared description in the child
  drops the child's reference only; the parent keeps the lock.
* **Workers die with their parent** (:func:`die_with_parent`, called by a pool's
  initializer): on Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` has the kernel kill the
  worker when its parent dies, however it dies; elsewhere (and as a second line) a
  thread polls ``os.getppid()`` and exits when the worker has been re-parented. A worker
  writes entries atomically, so a killed one leaves a temporary file the next run sweeps.
* **A lock whose owner is gone is taken over** (:func:`owner_gone`): each lock file
  records its holder's pid and host. A lock that is busy while its recorded holder (on
  this host) no longer runs is held by leftovers of a dead owner (orphans of an older
  version, or of another program that forked): the waiter says so in one line, removes
  the lock file and locks a new one, so the leftovers hold a lock nobody asks for.

One module, because both are about what a crash leaves behind. It imports nothing beyond
the standard library: ``ats --help`` and the torch-free dataset modules use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["atomic_path", "atomic_save_png", "first_line",
           "atomic_write_bytes", "atomic_write_text", "check_writable", "sweep_temporaries", "settled",
           "COARSE_SETTLE_NS", "FINE_SETTLE_NS", "alive", "held", "released", "die_with_parent", "owner_gone",
           "read_record", "write_record", "PARENT_POLL_S", "end_process"]


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


def atomic_save_png(fig: Any, path: str | os.PathLike[str], dpi: int = 100) -> None:
    """Write the matplotlib figure ``fig`` to ``path`` as a PNG, atomically
    (:func:`atomic_path`), and close it whether or not the write succeeded: a figure left
    open holds its memory for the process's life."""
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format="png")
    finally:
        plt.close(fig)


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


def first_line(e: BaseException, limit: int | None = 200) -> str:
    """An exception's message cut to its first line (at most ``limit`` characters; None: the
    whole line, where it names a file that must stay whole), or its type's name when it
    says nothing: what goes in parentheses in a one-line error."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:limit]


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


# ---------------------------------------------------------------- locks that die with their owner

_HELD: set[int] = set()  # lock descriptors this process holds
PARENT_POLL_S = 0.5  # how often a worker without PR_SET_PDEATHSIG looks for its parent


def held(fd: int) -> int:
    """Register ``fd`` as a lock this process holds: a forked child closes it at once."""
    _HELD.add(fd)
    return fd


def released(fd: int) -> None:
    """``fd`` no longer holds a lock (call before closing it)."""
    _HELD.discard(fd)


def _close_inherited() -> None:
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)  # the child's reference only: the parent's lock stands
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited)


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Make this (worker) process end when ``parent`` (its parent's pid, taken before the
    fork) ends. Call first thing in a pool's initializer."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="ats-parent-watch").start()


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(1)


def write_record(fd: int) -> None:
    """Write this process's record (pid, host, start time, command) into lock file ``fd``."""
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "command": " ".join(sys.argv)[:500]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)


def read_record(fd: int) -> dict[str, Any] | None:
    """The holder record in lock file ``fd``, or None (empty, or not a record)."""
    try:
        data = json.loads(os.pread(fd, 65536, 0).decode() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def alive(pid: int) -> bool:
    """Whether a process of ``pid`` runs on this host (a zombie, killed and not yet reaped, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    try:  # a zombie (killed, not yet reaped) is gone too
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def owner_gone(record: dict[str, Any] | None) -> bool:
    """Whether the process that ``record`` names is known to be gone: recorded on this
    host, and no process of that pid runs. Unknown (no record, another host) is not gone."""
    if not record or record.get("host") != socket.gethostname():
        return False
    try:
        pid = int(record.get("pid", 0))
    except (TypeError, ValueError):
        return False
    return pid != os.getpid() and not alive(pid)


def end_process(status: int) -> NoReturn:
    """Flush stdout and stderr, then end this process with ``status`` at once
    (``os._exit``): no interpreter teardown, no atexit handler, no thread waited for. The
    callers say why that is right where they call it (:func:`ats_cli.cli.exit_now`,
    :func:`ats_cli.runtime.exit_worker`, a benchmark row's process)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe or stream: nothing more can reach it
            stream.flush()
    os._exit(status)
