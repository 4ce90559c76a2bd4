"""Preparing a dataset: every ordinary image decoded once, its view made once, written as
an entry (:mod:`ats_cli.data.prepared.entry`), in parallel processes.

Resumable without bookkeeping: an entry is written atomically and carries its source's
stamp, so a file is done exactly when its entry matches it (:meth:`PreparedStore.is_fresh`);
a rerun after a kill skips what is done and redoes nothing else. One preparer per store
at a time (an OS lock on ``.lock`` in the store, dropped by the OS however the holder
ends): a second one waits, then finds the work done. Under that lock the temporary files
of a killed preparer are swept.

A file's digest is taken before it is decoded and its stat compared before and after,
so an entry never pairs one version's pixels with another version's stamp: a file that
changes while being read is reported, not prepared.

Disk: entries are compressed, but a dataset of photographs may still take several times
its own size, so preparing stops (by name, with the free space) when the file system
would keep less than ``MIN_FREE_BYTES``: the files not prepared are then read from the
sources, as without preparing, and results are the same either way.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ats_cli.data.images import ImageReadError, read_image
from ats_cli.data.inputs import low_res_view
from ats_cli.data.prepared.entry import EntryError, read_entry, restamp_entry, write_entry
from ats_cli.data.prepared.store import PreparedStore, file_stamp
from ats_cli.io import sweep_temporaries

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: one preparer is then the user's care
    fcntl = None

__all__ = ["MIN_FREE_BYTES", "PrepareReport", "prepare", "preparer_lock"]

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


@contextlib.contextmanager
def preparer_lock(folder: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold the store's preparer lock; when another process holds it, say so and wait."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log(f"waiting for another preparation of {folder} to finish")
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
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
        pending = [s for s in files if not store.is_fresh(s)]
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
    pool = ProcessPoolExecutor(max_workers=min(workers, len(pending)), mp_context=ctx, initializer=_worker_init)
    try:
        yield from pool.map(prepare_one, [store] * len(pending), pending, [min_free] * len(pending),
                            chunksize=max(1, min(16, len(pending) // (4 * workers))))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _worker_init() -> None:
    """One thread per preparing process (the work is per image), and Ctrl-C goes to the
    parent alone, which stops the pool: finished entries are kept."""
    import torch

    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def prepare_one(store: PreparedStore, source: str, min_free: int = MIN_FREE_BYTES) -> tuple[str, str, str]:
    """Prepare one file: (source, "prepared" | "restamped" | "no room" | "failed", problem).
    A source that cannot be read is "failed"; a store that cannot be written raises OSError."""
    path = store.entry_path(source)
    try:
        before = file_stamp(source)
        with open(source, "rb") as fh:
            digest = hashlib.file_digest(fh, "blake2b").hexdigest()
    except OSError as e:
        return source, "failed", e.strerror or str(e)
    with contextlib.suppress(EntryError):  # same content, new stat (copied, touched): keep the pixels
        header, fd, _ = read_entry(path)
        os.close(fd)
        if header.get("digest") == digest and store.same_making(header):
            restamp_entry(path, before)
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
    except OSError:
        changed = True
    if changed:
        return source, "failed", "changed while being prepared"
    write_entry(path, image, view, {**before, "digest": digest, "made_by": store.made_by, "scale": repr(store.scale),
                                    "source": source})
    return source, "prepared", ""
