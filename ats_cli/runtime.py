"""Where and how a run runs: its device, its processes, its directory.

One module for what surrounds the training loop (and ``ats predict``'s) without being
the method: the device and how the process stops (signals, peak memory), the processes
of a run of several (torch.distributed; a plain run is the group of one), and the run
directory one run owns.

**Device and signals.** ``auto`` is CUDA when present, else the CPU; peak memory is read
per device; SIGTERM and SIGINT stop a run as Ctrl-C does, and what must not be cut in
half (a checkpoint being written) finishes before the stop takes effect
(:func:`deferred_interrupts`).

**Processes: several processes, one training run, the few places where torch.distributed
matters.** ``torchrun`` (or ``ats train --devices N``, which builds the torchrun command
for one machine) starts one process per GPU, or N processes on CPU, and sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in each. The training
loop then needs only:

* :func:`process_group`: join the group from those variables (NCCL on GPU, gloo on CPU)
  and pick this process's device (``cuda:LOCAL_RANK``);
* :func:`shard_batches`: this rank's part of every global batch of an epoch;
* :func:`all_reduce` and :func:`from_main`: global metrics, and rank 0's checkpoint on
  every rank (so other nodes need not see the run directory);
* :func:`launch`: ``--devices N`` as one torchrun call (:func:`run_launched` for any
  sub-command: ``ats predict --devices N`` uses it too; it stops the workers when it is
  stopped);
* :func:`exit_worker`: how a worker of several leaves (see there).

With ``WORLD_SIZE`` unset (a plain ``ats train``) every helper is a no-op and no process
group is created, so the single-process path is exactly what it was. The CUDA/NCCL
branches are the standard ones; the tests exercise gloo on CPU.

**The directory: a run directory belongs to one run** (ownership, the writer's lock, the
epoch journal). ``ats train --out RUN`` writes ``config.json``, ``settled.json``
(:mod:`ats_cli.config`), ``metrics.jsonl``, ``last.pt``, ``best.pt``, ``epochs/`` and
``curves.png`` into RUN. Four rules keep it trustworthy:

* **One run per directory.** A directory that holds a run (a checkpoint or metrics) is
  continued with ``--resume RUN`` or replaced on purpose with ``--overwrite``, which
  moves the old run aside to ``RUN.old-YYYYmmdd-HHMMSS`` (nothing is deleted); a new run
  is never mixed into an old one.
* **One writer at a time.** The writer holds ``RUN/.ats-train.lock`` (its pid, host,
  start time and command inside) under an OS file lock (``flock``) for as long as it
  runs. The OS drops that lock when the process ends, however it ends (kill -9
  included), so a lock file left behind by a dead process is stale and the next writer
  takes it over; the lock of a live writer refuses every other writer with its pid and
  host. No forked worker holds it (:mod:`ats_cli.io`), and a lock still held after
  its recorded writer died (by processes that inherited it) is taken over too. Where
  the file system has no locks, the pid alone decides (same host only).
* **An epoch's record is atomic.** At the end of an epoch the checkpoints are written
  first (``epochs/epoch_NNN.pt``, ``best.pt``, then ``last.pt``, which marks the epoch
  done) and the ``metrics.jsonl`` line last; ``--resume`` rewrites ``metrics.jsonl``
  from ``last.pt``'s history. An interruption anywhere in between (kill -9, a full
  disk) therefore neither duplicates nor loses an epoch.
* **A resume continues the same run.** ``--resume`` starts from the newest full
  training state in RUN (:func:`resume_state`): ``last.pt``, or ``best.pt`` when a full
  disk stopped the epoch's end after writing it (both hold the weights, optimizer and
  history; the newer epoch wins). A run records its data's identity
  (:func:`run_data_identity`: the class order, and for each split the number of rows and
  a digest of their paths and labels), and a resume against other data is refused
  (:func:`check_run_data`): another ``train.csv`` would continue the epoch's order and
  position in it (image 18 of 10) over other images, reordered classes would save the
  head under the wrong names, and another ``val.csv`` would choose ``best.pt`` across
  epochs scored on different rows; the result would be neither run. So is a resume whose
  settings build another model (``--method``, a network): one line naming what changed,
  instead of PyTorch's state_dict dump.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from ats_cli.io import alive, atomic_write_text, end_process, held, owner_gone, released

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

__all__ = ["resolve_device", "peak_memory_mb", "reset_peak_memory", "stop_signals_interrupt", "Deferred",
           "deferred_interrupts", "Dist", "from_env", "process_group", "shard_batches", "all_reduce",
           "broadcast_buffers", "from_main", "launch_command", "launch", "run_launched", "check_devices",
           "exit_worker", "interrupted_line", "LOCK_NAME", "RESUMABLE", "RunDirError", "RunLock", "append_metrics",
           "check_run_data", "check_training_set", "claim", "failed_save", "holds_run", "make_dirs", "move_aside",
           "prepare_run", "resumable", "resume_state", "rewrite_metrics", "run_data_identity", "settings_changed",
           "training_set_identity"]


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' = CUDA when present, else CPU; anything else is passed to torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available on this machine")
    return device


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak bytes allocated by tensors since the last reset. CPU: the process's peak
    resident set size so far (ru_maxrss; it cannot be reset, so it is a high-water mark)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _stop_handlers(choose: Callable[[int, Any], Any]) -> Iterator[None]:
    """Within the block, each stop signal's handler is ``choose(sig, previous)`` (None: the
    previous one stays); the previous handlers come back on exit. Off the main thread
    (where Python allows no handlers) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig, handler in previous.items():
        chosen = choose(sig, handler)
        if chosen is not None:
            signal.signal(sig, chosen)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM stops the work as Ctrl-C does (KeyboardInterrupt: training
    saves its state and stops), and so does SIGINT where it was ignored.

    Why: a batch scheduler ends a job with SIGTERM (SLURM on preemption or at the time
    limit, ``timeout``, ``kill``), and a job started in the background by a non-interactive
    shell inherits SIGINT *ignored*, so ``timeout -s INT`` or ``kill -INT`` would not reach
    it: either way the epoch's work would be lost. The previous handlers come back on exit.
    Off the main thread (where Python allows no handlers) it does nothing."""

    def choose(sig, previous):
        if sig == signal.SIGTERM:
            return _interrupt
        return signal.default_int_handler if previous == signal.SIG_IGN else None

    with _stop_handlers(choose):
        yield


class Deferred:
    """What :func:`deferred_interrupts` saw: ``stopped`` is True when a stop signal came."""

    stopped: bool = False


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[Deferred]:
    """Within the block, Ctrl-C and SIGTERM are noted instead of acted on; the caller checks
    ``.stopped`` after it and stops cleanly.

    Why: training writes an epoch's checkpoints, its metrics line and its curves in one
    block; an interrupt in the middle (the first matplotlib import can take seconds) used to
    surface as a traceback and exit 1 although the epoch was saved. Deferred, the block
    finishes and the run stops with "interrupted at the end of epoch N". Where SIGINT is
    ignored it stays ignored. Off the main thread it defers nothing."""
    seen = Deferred()

    def note(signum, frame) -> None:
        seen.stopped = True

    with _stop_handlers(lambda sig, previous: None if previous == signal.SIG_IGN else note):
        yield seen


# ------------------------------------------------------------------- the run's processes

T = TypeVar("T")


@dataclass(frozen=True)
class Dist:
    """Where this process stands: its global rank, the number of processes, its GPU index."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, draws progress bars and writes files."""
        return self.rank == 0


def from_env() -> Dist:
    """The process's place from torchrun's variables (a single process when unset), or from
    a process group that the caller already initialised."""
    if dist.is_available() and dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    try:
        return Dist(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                    int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as e:
        raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers ({e})") from None


@contextlib.contextmanager
def process_group(device_name: str = "auto", timeout: datetime.timedelta | None = None
                  ) -> Iterator[tuple[Dist, torch.device]]:
    """Join the process group when ``WORLD_SIZE`` > 1 and yield ``(Dist, device)``.

    On GPU each process drives ``cuda:LOCAL_RANK`` (so ``--device`` may say ``cuda`` but
    not which one). A group that the caller already initialised is used and left open;
    one created here is destroyed on exit. ``timeout``: how long a collective may wait
    for the slowest rank (PyTorch's default, 30 min for gloo, when None); prediction's
    final barrier waits for the rank with the slowest share.
    """
    ctx = from_env()
    device = resolve_device(device_name)
    created = False
    if ctx.enabled:
        if device.type == "cuda":
            if device_name not in ("auto", "cuda"):
                raise ValueError(f"--device {device_name} with {ctx.world_size} processes: each process uses "
                                 "cuda:LOCAL_RANK; give --device cuda (or auto)")
            if ctx.local_rank >= torch.cuda.device_count():
                raise ValueError(f"LOCAL_RANK {ctx.local_rank} but only {torch.cuda.device_count()} GPU(s) here; "
                                 "start at most one process per GPU (--nproc-per-node)")
            device = torch.device("cuda", ctx.local_rank)
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            extra = {} if timeout is None else {"timeout": timeout}
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **extra)
            created = True
    try:
        yield ctx, device
        if created:
            # Leave together: a rank that tears its group down while rank 0 is still
            # writing checkpoints aborted now and then at exit ("terminate called without
            # an active exception", gloo, 2 CPU processes). Only on a normal exit: after an
            # error the other ranks may be gone and a barrier would wait for them.
            dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()


def shard_batches(order: Sequence[int], start: int, batch_size: int, ctx: Dist) -> list[list[int]]:
    """This rank's batches for the rest of an epoch, from position ``start`` of its order.

    ``batch_size`` is per process, so a step consumes a GLOBAL batch of
    ``batch_size * world_size`` images: ``order[start + g*G : start + (g+1)*G]`` with
    ``G = batch_size * world_size``; rank r takes the r-th of ``world_size`` equal,
    contiguous slices of it. Equal slices matter: DDP averages the ranks' gradients with
    equal weights, which is the gradient of the mean loss over the global batch only if
    every rank averaged over as many images. So a short last batch that does not divide
    evenly is padded with images from the start of the order (at most world_size - 1
    repeats per epoch, as DistributedSampler does). With one process this is plain
    batching of ``order[start:]``.
    """
    order = list(order)
    world = ctx.world_size
    out = []
    for g in range(start, len(order), batch_size * world):
        batch = order[g:g + batch_size * world]
        pad = -len(batch) % world
        batch += [order[i % len(order)] for i in range(pad)]
        k = len(batch) // world
        out.append(batch[ctx.rank * k:(ctx.rank + 1) * k])
    return out


def all_reduce(values: Sequence[float], ctx: Dist, device: torch.device, op: str = "sum") -> list[float]:
    """Sum (or max) a few numbers over all processes; one collective, float64. A single
    process gets its values back untouched."""
    if not ctx.enabled:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


def broadcast_buffers(model: torch.nn.Module, ctx: Dist) -> None:
    """Give every rank rank 0's buffers (batch-norm running statistics). DDP broadcasts
    them before each forward pass, but the last training step leaves each rank with its
    own update; evaluation and the checkpoint must agree on one set."""
    if ctx.enabled:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def from_main(fn: Callable[[], T], ctx: Dist) -> T:
    """Run ``fn`` on rank 0 only and give every rank its result (or its exception).

    Used to read the checkpoint on resume: only rank 0's machine needs the run directory,
    and an unreadable file raises the same clear error on every rank instead of leaving
    the others waiting in a collective.
    """
    if not ctx.enabled:
        return fn()
    box: list[Any] = [None]
    if ctx.is_main:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # re-raised below, on every rank
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def launch_command(nproc: int, train_args: Sequence[str], command: str = "train") -> list[str]:
    """The torchrun command that runs ``ats COMMAND ARGS`` in ``nproc`` processes on this
    machine (``--standalone``: a private rendezvous on a free local port). It is
    ``torchrun ARGS`` run through this module's ``__main__`` (see :func:`_torchrun`)."""
    return [sys.executable, "-m", "ats_cli.runtime", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "ats_cli", command, *train_args]


def check_devices(nproc: int, device: str | None) -> None:
    """``--devices N`` on a GPU machine (unless ``--device cpu``) needs N GPUs: one per process."""
    if torch.cuda.is_available() and device != "cpu" and nproc > torch.cuda.device_count():
        raise ValueError(f"--devices {nproc} but this machine has {torch.cuda.device_count()} GPU(s)")


def run_launched(command: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run a :func:`launch_command` and return its exit status (128 + the signal when this
    process was told to stop).

    torchrun and its workers run in a process group of their own, and SIGINT and SIGTERM
    received here are passed on to that whole group; then this process waits for them to
    stop. Killing the launcher (``kill PID``, a job scheduler's SIGTERM) thus stops the
    workers too, instead of leaving them running unseen; Ctrl-C in a terminal reaches
    them once, through here, and rank 0 still saves what is done before it exits."""
    started: list[subprocess.Popen] = []
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        for proc in started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():  # where Python lets signals be handled
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        started.append(subprocess.Popen(list(command), env=env, process_group=0))
        if received:  # told to stop while torchrun was being started
            forward(received[-1], None)
        rc = started[0].wait()
    except BaseException:  # anything else that stops this process: the workers go with it
        forward(signal.SIGTERM, None)
        for proc in started:
            proc.wait()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + received[0] if received else rc


def exit_worker(code: int = 0) -> NoReturn:
    """End a worker of several processes now, after its process group is destroyed:
    flush the output and ``os._exit``. A normal interpreter exit after
    ``destroy_process_group`` aborted now and then with "terminate called without an
    active exception" (gloo, 2 CPU processes: a gloo thread still unwinding at exit);
    nothing is left to run at that point, so skipping the interpreter's teardown loses
    nothing and avoids the abort. (The console script ends every command alike, after the
    atexit handlers: :func:`ats_cli.cli.exit_now`; a worker has none left to run.)"""
    end_process(code)


def launch(nproc: int, config: dict[str, Any], *, resume: bool) -> int:
    """``ats train --devices N``: run the resolved ``config`` in N processes; the exit status.

    The configuration was resolved (and validated) once, here; the workers read it from a
    temporary JSON file, so they run exactly it, whatever flags produced it. Ctrl-C (or
    SIGTERM) is passed on to torchrun, which passes it on to the workers: rank 0 saves the
    state and all stop; this process waits for that instead of killing torchrun half-way.
    """
    check_devices(nproc, config.get("device"))
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="ats-train-", delete=False) as f:
        json.dump(config, f)
    try:
        where = ["--resume", config["out"]] if resume else [config["data"], "--out", config["out"]]
        return run_launched(launch_command(nproc, [*where, "--config", f.name]))
    finally:
        os.unlink(f.name)


def _torchrun(argv: Sequence[str]) -> None:
    """``torchrun ARGV``, without the traceback that torchrun prints when Ctrl-C stops it:
    by then it has passed the signal on and the workers have saved and stopped."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    try:
        main(list(argv))
    except SignalException:
        sys.exit(130)


if __name__ == "__main__":
    _torchrun(sys.argv[1:])


# ------------------------------------------------------------------- the run's directory

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
        suspect = None
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError as e:
                raise RunDirError(f"{self.run}: cannot write the run directory ({e.strerror or e})") from None
            try:
                if not self._lock(fd):
                    holder = self._read(fd)
                    if not owner_gone(holder):
                        raise self._busy(holder)
                    if holder != suspect:  # seen twice, a moment apart: a new writer records itself just after locking
                        suspect = holder
                        os.close(fd)
                        time.sleep(0.25)
                        continue
                    # held, but not by its recorded owner, which is gone: by processes that
                    # inherited it (ats_cli.io); a new lock file leaves them holding nothing
                    self.took_over = holder
                    with contextlib.suppress(OSError):
                        if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                            self.path.unlink()
                    os.close(fd)
                    continue
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
            self._fd = held(fd)  # closed in every forked child: a worker never holds the run
            if self.took_over:
                print(f"{self.run}: took over its lock {self.path} from {_holder_text(self.took_over)}, which is no "
                      "longer running", file=sys.stderr, flush=True)
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
        pid = int(holder.get("pid", 0))
        return same_host and pid > 0 and not alive(pid)  # no pid recorded: not known to be gone

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()
        released(self._fd)
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


def prepare_run(run: str | os.PathLike[str], *, resume: bool, overwrite: bool) -> Path | None:
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


def interrupted_line(run: str | os.PathLike[str]) -> str:
    """The one line for a training run stopped (Ctrl-C, SIGTERM) between the phases that
    save their own position: it names a saved state only if one exists, since a run
    stopped before its first epoch's end (while preparing, say) has none."""
    states = resumable(run)
    if not states:
        return (f"interrupted before the first epoch was saved: {run} holds no state to resume; start the run again "
                "(the same command)")
    return (f"interrupted; the last state saved is {states[0]} (written whole or not at all); continue with "
            "--resume")


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


def run_data_identity(data: Any) -> dict[str, Any]:
    """What a run records of its dataset (``data``: :class:`~ats_cli.data.dataset.Dataset`),
    everything a resume must find unchanged: the training set's identity
    (:func:`training_set_identity`, at the top level as runs before this recorded it), the
    class order (it gives each output of the head its name: reordered, the head trained
    on the old order would be saved under the new names) and each held-out split's
    identity (``val.csv`` chooses ``best.pt`` across the epochs, so every epoch must be
    scored on the same rows; ``test.csv`` is what the history reports)."""
    identity = training_set_identity(data["train"], data.root)
    identity["classes"] = list(data.classes)
    identity["splits"] = {split: training_set_identity(records, data.root)
                          for split, records in data.splits.items() if split != "train"}
    return identity


def check_run_data(path: str | os.PathLike[str], ckpt: Mapping[str, Any], now: Mapping[str, Any],
                   root: str | os.PathLike[str]) -> None:
    """Refuse to resume the state at ``path`` (checkpoint ``ckpt``) on a dataset ``now``
    (:func:`run_data_identity`; ``root``: its directory, for the message) that differs from
    the one the run started on in anything that changes the result: the class order, the
    training rows, or a held-out split's rows (one appearing or going included). The
    class order is checked against the checkpoint's own ``classes``, so runs saved before
    the splits were recorded are checked for it too; their held-out splits are not
    (nothing to compare with). One line naming what changed and the way on."""
    root = Path(root)
    recorded = ckpt.get("train_set") or {}
    then_classes = recorded.get("classes", ckpt.get("classes"))
    fix = "resume on the data the run started with, or start a new run (--overwrite, or another --out)"
    if then_classes is not None and list(then_classes) != list(now["classes"]):
        same = sorted(then_classes) == sorted(now["classes"])
        what = "the classes in another order" if same else "other classes"
        raise RunDirError(f"{path}: {root / 'dataset.json'} now lists {what} ({', '.join(now['classes'])}) than "
                          f"this run was trained with ({', '.join(then_classes)}); resuming would save its head "
                          f"under the wrong class names: {fix}")
    check_training_set(path, recorded, now, str(root / "train.csv"))
    splits_then, splits_now = recorded.get("splits"), now["splits"]
    if splits_then is None:
        return
    changed = []
    for split in sorted(set(splits_then) | set(splits_now)):
        a, b = splits_then.get(split), splits_now.get(split)
        if a is None:
            changed.append(f"{split}.csv is new")
        elif b is None:
            changed.append(f"{split}.csv is gone")
        elif a.get("digest") != b["digest"]:
            swapped = [o for o in splits_then if o != split and splits_then[o].get("digest") == b["digest"]]
            changed.append(f"{split}.csv now lists {swapped[0]}.csv's rows" if swapped
                           else f"{split}.csv lists other rows ({b['images']} images, was {a.get('images')})")
    if changed:
        raise RunDirError(f"{path}: the held-out splits in {root} changed since this run started "
                          f"({'; '.join(changed)}); its epochs would be scored, and best.pt chosen, on different rows: "
                          + fix)


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
                      "over other images: resume on the data it was trained on, or start a new run (--overwrite, or "
                      "another --out)")


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
