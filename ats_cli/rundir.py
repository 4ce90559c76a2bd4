"""A run directory belongs to one run: ownership, the writer's lock, the epoch journal.

``ats train --out RUN`` writes ``config.json``, ``settled.json`` (ats_cli.config),
``metrics.jsonl``, ``last.pt``, ``best.pt``, ``epochs/`` and ``curves.png`` into RUN. Three rules keep it trustworthy:

* **One run per directory.** A directory that holds a run (a checkpoint or metrics) is
  continued with ``--resume RUN`` or replaced on purpose with ``--overwrite``, which
  moves the old run aside to ``RUN.old-YYYYmmdd-HHMMSS`` (nothing is deleted); a new run
  is never mixed into an old one.
* **One writer at a time.** The writer holds ``RUN/.ats-train.lock`` (its pid, host,
  start time and command inside) under an OS file lock (``flock``) for as long as it
  runs. The OS drops that lock when the process ends, however it ends (kill -9
  included), so a lock file left behind by a dead process is stale and the next writer
  takes it over; the lock of a live writer refuses every other writer with its pid and
  host. Where the file system has no locks, the pid alone decides (same host only).
* **An epoch's record is atomic.** At the end of an epoch the checkpoints are written
  first (``epochs/epoch_NNN.pt``, ``best.pt``, then ``last.pt``, which marks the epoch
  done) and the ``metrics.jsonl`` line last; ``--resume`` rewrites ``metrics.jsonl``
  from ``last.pt``'s history. An interruption anywhere in between (kill -9, a full
  disk) therefore neither duplicates nor loses an epoch.
* **A resume continues the same run.** ``--resume`` starts from the newest full
  training state in RUN (:func:`resume_state`): ``last.pt``, or ``best.pt`` when a full
  disk stopped the epoch's end after writing it (both hold the weights, optimizer and
  history; the newer epoch wins). A run records its training set's identity
  (:func:`training_set_identity`: the number of ``train.csv`` rows and a digest of their
  paths and labels), and a resume against another set is refused: the epoch's order and
  the position in it (image 18 of 10) would continue over other images, and the result
  would be neither run. So is a resume whose settings build another model (``--method``,
  a network): one line naming what changed, instead of PyTorch's state_dict dump.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ats_cli.io import atomic_write_text

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

__all__ = ["LOCK_NAME", "RESUMABLE", "RunDirError", "RunLock", "append_metrics", "check_training_set", "claim",
           "failed_save", "holds_run", "make_dirs", "move_aside", "prepare", "resumable", "resume_state",
           "rewrite_metrics", "settings_changed", "training_set_identity"]

LOCK_NAME = ".ats-train.lock"
METRICS = "metrics.jsonl"
_RUN_FILES = ("last.pt", "best.pt", METRICS)
RESUMABLE = ("last.pt", "best.pt")  # full training states (weights, optimizer, history), newest wins


class RunDirError(ValueError):
    """A run directory that cannot be used as asked; the message names it and says what to do."""


def _contents(run: Path) -> list[str]:
    """What makes ``run`` a run: its checkpoints and metrics (empty if none)."""
    found = [name for name in _RUN_FILES if (run / name).exists()]
    epochs = sorted((run / "epochs").glob("epoch_*.pt")) if (run / "epochs").is_dir() else []
    if epochs:
        found.append(f"{len(epochs)} epoch checkpoint(s)")
    return found


def holds_run(run: str | os.PathLike[str]) -> bool:
    """Whether ``run`` holds a run: a checkpoint or a metrics file. A directory with only
    ``config.json`` (a run stopped before its first checkpoint) has nothing to lose."""
    return bool(_contents(Path(run)))


# ---------------------------------------------------------------------------- the lock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _holder_text(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process"
    since = holder.get("started")
    when = f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if since else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{when}"


class RunLock:
    """The one-writer lock of a run directory (see the module docstring).

    ``acquire()`` raises :class:`RunDirError` naming the holder when a live process holds
    it; a stale lock (its process is gone) is taken over and ``took_over`` tells whose it
    was. Use as a context manager, or ``acquire()`` / ``release()``.
    """

    def __init__(self, run: str | os.PathLike[str]):
        self.run = Path(run)
        self.path = self.run / LOCK_NAME
        self.took_over: dict[str, Any] | None = None
        self._fd: int | None = None

    def _record(self) -> bytes:
        return (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                            "command": " ".join(sys.argv)[:500]}) + "\n").encode()

    def _read(self, fd: int) -> dict[str, Any] | None:
        try:
            data = json.loads(os.pread(fd, 65536, 0).decode() or "null")
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _busy(self, holder: dict[str, Any] | None) -> RunDirError:
        return RunDirError(f"{self.run}: in use by {_holder_text(holder)} (lock file {self.path}); two runs "
                           "cannot write one directory: wait for it to finish or stop it, or choose another --out")

    def acquire(self) -> RunLock:
        try:
            self.run.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"{self.run}: cannot create the run directory ({e.strerror or e})") from None
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError as e:
                raise RunDirError(f"{self.run}: cannot write the run directory ({e.strerror or e})") from None
            try:
                if not self._lock(fd):
                    holder = self._read(fd)
                    raise self._busy(holder)
                # the file locked must still be the one named LOCK_NAME: a releasing writer
                # unlinks it before closing, and its inode must not be mistaken for the lock
                try:
                    same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                previous = self._read(fd)
                if previous and previous.get("pid") != os.getpid():
                    self.took_over = previous
                os.ftruncate(fd, 0)
                os.pwrite(fd, self._record(), 0)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            self._fd = fd
            return self
        raise RunDirError(f"{self.run}: could not take the lock {self.path} (it keeps changing hands)")

    def _lock(self, fd: int) -> bool:
        """Take the OS lock on ``fd``: False when another open file holds it. Without OS
        locks (no fcntl, or a file system that refuses them) the recorded pid decides."""
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
        holder = self._read(fd)
        if not holder or holder.get("pid") == os.getpid():
            return True
        same_host = holder.get("host") == socket.gethostname()
        return same_host and not _alive(int(holder.get("pid", 0)))

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()
        with contextlib.suppress(OSError):
            os.close(self._fd)  # drops the OS lock
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------------------- ownership


def _refusal(run: Path) -> RunDirError:
    what = ", ".join(_contents(run))
    return RunDirError(f"{run} already holds a run ({what}): continue it with `ats train --resume {run}`, or start "
                       f"a new run there with --overwrite (the old one is moved to {run.name}.old-<date-time>), "
                       "or choose another --out")


@contextlib.contextmanager
def claim(run: str | os.PathLike[str], *, resume: bool, enabled: bool = True) -> Iterator[RunLock | None]:
    """Hold ``run`` for one training run (``enabled``: on the process that writes it).

    Takes the lock, then refuses a directory that holds a run unless ``resume``, and a
    resume with nothing to resume. The lock is released on the way out, however the run
    ends; if the process is killed the OS releases it.
    """
    if not enabled:
        yield None
        return
    run = Path(run)
    if resume and not run.is_dir():
        raise RunDirError(f"{run}: no such run directory to resume")
    lock = RunLock(run).acquire()
    try:
        if resume and not resumable(run):
            raise RunDirError(f"{run}: nothing to resume (no last.pt or best.pt: the run stopped before its first "
                              "checkpoint); start it again with --overwrite")
        if not resume and holds_run(run):
            raise _refusal(run)
        yield lock
    finally:
        lock.release()


def move_aside(run: str | os.PathLike[str]) -> Path | None:
    """Move the run in ``run`` to ``RUN.old-YYYYmmdd-HHMMSS`` (``-2``, ``-3``... if taken)
    and return that path; None if ``run`` does not exist. Refused while a live writer
    holds the directory. ``run`` itself is left absent (the new run creates it)."""
    run = Path(run)
    if not run.exists():
        return None
    if not run.is_dir():
        raise RunDirError(f"{run}: exists and is not a directory")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = run.with_name(f"{run.name}.old-{stamp}")
    n = 2
    while dest.exists():
        dest = run.with_name(f"{run.name}.old-{stamp}-{n}")
        n += 1
    lock = RunLock(run).acquire()
    try:
        os.rename(run, dest)
    except OSError as e:
        lock.release()
        raise RunDirError(f"{run}: cannot move it to {dest} ({e.strerror or e})") from None
    with contextlib.suppress(OSError):
        (dest / LOCK_NAME).unlink()
    lock.path = dest / LOCK_NAME  # released below without touching the new directory
    lock.release()
    return dest


def prepare(run: str | os.PathLike[str], *, resume: bool, overwrite: bool) -> Path | None:
    """The command line's checks before training starts (``ats train``): refuse a
    directory that a live writer holds, and one that holds a run unless ``resume``;
    with ``overwrite`` move the old run aside (returns where to). :func:`claim` checks
    again when training starts (the authoritative, race-free check)."""
    run = Path(run)
    if resume and overwrite:
        raise RunDirError("give --resume (continue a run) or --overwrite (start afresh), not both")
    if run.exists() and not run.is_dir():
        raise RunDirError(f"{run}: exists and is not a directory")
    if run.is_dir():
        with RunLock(run):  # a live writer refuses here, before anything is moved or loaded
            pass
    if overwrite and (holds_run(run) or (run / "config.json").exists()):
        return move_aside(run)  # a directory of other files is trained into, never moved
    if not resume and holds_run(run):
        raise _refusal(run)
    return None


# ---------------------------------------------------------------------------- the journal


def make_dirs(path: str | os.PathLike[str]) -> None:
    """``mkdir -p`` whose failure (read-only, full disk) is one line naming the directory."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"{path}: cannot create it ({e.strerror or e})") from None


def append_metrics(run: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append one epoch's line to ``metrics.jsonl`` (after that epoch's ``last.pt``)."""
    with open(Path(run) / METRICS, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def rewrite_metrics(run: str | os.PathLike[str], history: Sequence[dict[str, Any]]) -> None:
    """On resume: ``metrics.jsonl`` := the epochs ``last.pt`` vouches for (atomically), so
    lines written after the last checkpoint are dropped and lines lost are restored."""
    atomic_write_text(Path(run) / METRICS, "".join(json.dumps(dict(h)) + "\n" for h in history))


# ---------------------------------------------------------------------------- resuming


def resumable(run: str | os.PathLike[str]) -> list[Path]:
    """The full training states in ``run`` (:data:`RESUMABLE` that exist)."""
    return [Path(run) / name for name in RESUMABLE if (Path(run) / name).is_file()]


def resume_state(run: str | os.PathLike[str], load: Callable[[Path], dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """(path, checkpoint) of the newest full training state in ``run``: the highest
    (epoch, images done) among ``last.pt`` and ``best.pt``, ``last.pt`` on a tie. An epoch's
    end writes ``best.pt`` before ``last.pt`` (module docstring), so a disk that fills
    between the two leaves the finished epoch in ``best.pt`` alone; continuing from the
    older ``last.pt`` (or, in epoch 1, from nothing) would redo or refuse an epoch the run
    had finished. ``load``: the checkpoint loader (raises naming the file)."""
    paths = resumable(run)
    if not paths:
        raise RunDirError(f"{run}: nothing to resume (no last.pt or best.pt); start it again with --overwrite")
    states = [(p, load(p)) for p in paths]
    return max(states, key=lambda s: (int(s[1].get("epoch", 0)), int(s[1].get("samples", 0)),
                                      s[0].name == "last.pt"))


def failed_save(run: str | os.PathLike[str], epoch: int, e: OSError) -> RunDirError:
    """The one line for an epoch's end that could not be written (a full disk, a directory
    gone read-only): advises --resume only when there is a state to resume from."""
    fix = f"continue with --resume {run}" if resumable(run) else "start it again with --overwrite"
    return RunDirError(f"{run}: cannot save epoch {epoch} ({e.strerror or e}); make room or fix the directory, "
                       f"then {fix}")


def training_set_identity(records: Iterable[Any], root: str | os.PathLike[str]) -> dict[str, Any]:
    """What a run records of its training set (``records``: the dataset's train split,
    :class:`~ats_cli.data.dataset.Record`): the number of rows and a digest of their
    (path, label) in order (the order decides each epoch's shuffle). Paths relative to the
    dataset ``root``, so a dataset moved whole is still the same set."""
    h = hashlib.sha256()
    n = 0
    for r in records:
        h.update(f"{os.path.relpath(r.path, root)}\t{r.label_name}\n".encode())
        n += 1
    return {"images": n, "digest": h.hexdigest()}


def check_training_set(path: str | os.PathLike[str], recorded: Mapping[str, Any] | None, now: Mapping[str, Any],
                       where: str) -> None:
    """Refuse to resume the state at ``path`` (recorded training set ``recorded``; None:
    saved before it was recorded, not checked) on another training set ``now``
    (:func:`training_set_identity`; ``where``: its train.csv, for the message)."""
    if not recorded or recorded.get("digest") == now["digest"]:
        return
    before, after = int(recorded.get("images", 0)), now["images"]
    what = f"{after} images, not the {before}" if after != before else f"other rows than the {before} images"
    raise RunDirError(f"{path}: {where} now lists {what} this run was trained on; resuming would continue its epoch "
                      "over other images: resume on the data it was trained on, or start a new run with --overwrite")


def settings_changed(path: str | os.PathLike[str], theirs: Mapping[str, Any] | None, ours: Mapping[str, Any],
                     problem: BaseException) -> RunDirError:
    """The one line for a resume whose settings build another model than the state at
    ``path`` holds (its spec ``theirs``, this run's ``ours``): what changed, else the
    first line of the loader's ``problem``."""
    theirs = dict(theirs or {})
    changed = [f"{k} {theirs.get(k)!r} -> {ours.get(k)!r}" if not isinstance(ours.get(k), dict) else f"{k}"
               for k in sorted(set(theirs) | set(ours)) if k != "version" and theirs.get(k) != ours.get(k)]
    why = ", ".join(changed) if changed else str(problem).strip().splitlines()[0]
    return RunDirError(f"{path}: cannot be continued with these settings ({why}); resume with the run's own "
                       "settings (leave out the flags that change them), or start a new run with --overwrite")
