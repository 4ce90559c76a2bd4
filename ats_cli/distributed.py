"""Several processes, one training run: the few places where torch.distributed matters.

``torchrun`` (or ``ats train --devices N``, which builds the torchrun command for one
machine) starts one process per GPU, or N processes on CPU, and sets ``RANK``,
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
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from ats_cli.runtime import resolve_device

__all__ = ["Dist", "from_env", "process_group", "shard_batches", "all_reduce", "broadcast_buffers", "from_main",
           "launch_command", "launch", "run_launched", "check_devices", "exit_worker"]

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
    return [sys.executable, "-m", "ats_cli.distributed", "--standalone", f"--nproc-per-node={nproc}",
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
    nothing and avoids the abort."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


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
