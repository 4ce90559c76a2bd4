"""Locks that die with their owner, and worker processes that die with their parent.

Why this module: ``ats`` takes two OS file locks (``flock``): the run directory's
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
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["alive", "held", "released", "die_with_parent", "owner_gone", "read_record", "write_record", "PARENT_POLL_S"]

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
