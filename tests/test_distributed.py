"""Training in several processes (torch.distributed, gloo on CPU): same weights as one
process with the same global batch, rank 0 alone writes, resume with another number of
processes, ``ats train --devices 2`` end to end, DDP without unused parameters, --amp on CPU."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_train import _write_squares_dataset
from typer.testing import CliRunner

import ats_cli.core.model
import ats_cli.train
from ats_cli import nets
from ats_cli.checkpoint import load_checkpoint
from ats_cli.cli import app
from ats_cli.core import ATSModel, Draw, low_res_view
from ats_cli.models import create_model
from ats_cli.recipes import resolve_config
from ats_cli.runtime import Dist, launch_command, shard_batches
from ats_cli.train import TrainingInterrupted, train

N_TRAIN = 48


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    return _write_squares_dataset(tmp_path_factory.mktemp("squares"), n_train=N_TRAIN)


@pytest.fixture
def one_thread():
    """Two processes on two cores: one intra-op thread each, and the same for the
    single-process reference runs (also much faster when the machine is busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(data, out, **kw):
    base = dict(data=str(data), out=str(out), n_patches=2, patch_size=16, scale=0.125, feature_width=8,
                batch_size=8, epochs=2, workers=0, optimizer="sgd", lr=0.05, entropy=0.01, seed=0,
                device="cpu",  # gloo and the CPU float32 fallback, also on a machine with GPUs
                # equal weights need a feature net without batch norm (each rank normalises its
                # own half of the batch) and a schedule that extending 1 epoch to 2 leaves alone
                feature_net="mnist-features", schedule="constant")
    base.update(kw)
    return resolve_config(None, **base)


def _fixed_noise_sample(probs, n, *, replace=False, generator=None, exists=None):
    """Gumbel-top-k with the SAME noise for every image and every step.

    The patches drawn for an image are then a deterministic function of that image's
    attention, whatever the batch it is in, the process that handles it or the RNG
    state. With the real sampler two ranks draw from other streams than one process
    does, so their weights could only agree in distribution; with this one they must
    agree up to floating-point summation order. It is still a valid draw (positions
    distinct, in draw order, with the next key as the threshold) and the real estimator
    runs on it.
    """
    noise = torch.rand(probs.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    keys = torch.log(probs.detach().double()) - torch.log(-torch.log(noise.clamp(1e-300, 1 - 1e-16)))
    top = keys.topk(n + 1, dim=1)
    indices = top.indices[:, :n]
    return Draw(indices, probs.gather(1, indices), top.values[:, n])


def _interrupt_at(progress_value):
    """Wrap ``_lr_at`` (called by every rank at the start of every step) to stop there,
    as Ctrl-C under torchrun does: it reaches all ranks."""
    real = ats_cli.train._lr_at

    def lr_at(cfg, progress):
        if abs(progress - progress_value) < 1e-9:
            raise KeyboardInterrupt
        return real(cfg, progress)

    return lr_at


def _watch_writes(*dirs):
    """Record every file opened for writing, directory made or file renamed under ``dirs``
    by this process (PEP 578 audit hooks see all of them, whoever makes the call)."""
    writes = []
    dirs = tuple(str(d) for d in dirs)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND

    def hook(event, args):
        if event == "open" and str(args[0]).startswith(dirs) and (args[2] or 0) & write_flags:
            writes.append(("open", str(args[0])))
        elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove") and str(args[0]).startswith(dirs):
            writes.append((event, str(args[0])))

    sys.addaudithook(hook)
    return writes


def _worker(rank, world_size, store, data, root):
    """One of the two processes: join the group (as torchrun would), then train."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        ats_cli.core.model.sample = _fixed_noise_sample
        writes = _watch_writes(root / "ddp", root / "half", root / "cut")
        train(_cfg(data, root / "ddp"), log=lambda s: None)  # 2 epochs, 8 images per process per step
        train(_cfg(data, root / "half"), resume=True, log=lambda s: None)  # 1 epoch by 1 process, then 2
        ats_cli.train._lr_at = _interrupt_at(1 + 16 / N_TRAIN)  # epoch 2, after one step
        with pytest.raises(TrainingInterrupted):
            train(_cfg(data, root / "cut"), log=lambda s: None)
        if rank == 0:
            assert any("last.pt" in path for _, path in writes)  # the hook does see the writes
        else:
            assert writes == [], f"rank {rank} wrote {writes}"
    finally:
        dist.destroy_process_group()


def _max_diff(a, b):
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def test_two_processes_give_the_weights_of_one_process_with_the_same_global_batch(squares, tmp_path, one_thread,
                                                                                  monkeypatch):
    """2 processes x 8 images = 1 process x 16 images per step, also across resumption.

    Why this must hold: each rank's loss is the mean over its 8 images and DDP averages
    the two gradients, which is the gradient of the mean over the 16; clipping and the SGD
    step then act on the same gradient. The patches are drawn by a sampler that depends
    only on each image's attention (see _fixed_noise_sample), so the two runs compute the
    same thing in another order. Measured: the largest weight difference is 2e-7 (float32
    round-off) for updates of up to 7e-2, while one process with 8 images per step (the
    control: another global batch) ends 3e-2 away; the tolerance is 1e-5.

    Also checked: resuming at an epoch boundary with another number of processes (run
    'half': 1 process, then 2) and mid-epoch ('cut': 2 processes stopped after one step of
    epoch 2, then 1 process), and that rank 1 writes no file at all.
    """
    monkeypatch.setattr(ats_cli.core.model, "sample", _fixed_noise_sample)
    one = tmp_path / "one"
    train(_cfg(squares, one, batch_size=16), log=lambda s: None)
    train(_cfg(squares, tmp_path / "half", batch_size=16, epochs=1), log=lambda s: None)
    train(_cfg(squares, tmp_path / "control", batch_size=8), log=lambda s: None)

    mp.spawn(_worker, args=(2, str(tmp_path / "store"), squares, tmp_path), nprocs=2)

    ckpt = load_checkpoint(tmp_path / "cut" / "last.pt")
    assert (ckpt["epoch"], ckpt["step"], ckpt["samples"], ckpt["world_size"]) == (1, 1, 16, 2)
    history = train(_cfg(squares, tmp_path / "cut", batch_size=16), resume=True, log=lambda s: None)
    assert [(h["epoch"], h["world_size"], h["samples"]) for h in history] == [(1, 2, 48), (2, 1, 48)]

    reference = load_checkpoint(one / "last.pt")
    torch.manual_seed(0)  # the runs' seed: their initial weights
    assert _max_diff(reference["model"], create_model(reference["spec"]).state_dict()) > 1e-2  # they did train
    for run in ("ddp", "half", "cut"):
        assert _max_diff(load_checkpoint(tmp_path / run / "last.pt")["model"], reference["model"]) < 1e-5, run
    assert _max_diff(load_checkpoint(tmp_path / "control" / "last.pt")["model"], reference["model"]) > 1e-3
    metrics = [json.loads(x) for x in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    single = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    for m, s in zip(metrics, single, strict=True):  # metrics are reduced over the ranks
        assert m["world_size"] == 2 and m["samples"] == s["samples"] == N_TRAIN
        for key in ("train_loss", "train_acc", "test_loss", "test_acc", "entropy"):
            assert m[key] == pytest.approx(s[key], abs=1e-5), key


def test_cli_devices_2_end_to_end_then_resume_in_one_process(squares, tmp_path, one_thread):
    """`ats train --devices 2` starts torchrun with two CPU (gloo) processes; only rank 0
    reports; the run then continues in a single process with --resume."""
    run = tmp_path / "run"
    args = ["train", str(squares), "--out", str(run), "--epochs", "1", "--n-patches", "2", "--patch-size", "16",
            "--scale", "0.125", "--set", "feature_width=8", "--batch-size", "4", "--workers", "0", "--device", "cpu"]
    done = subprocess.run([sys.executable, "-m", "ats_cli", *args, "--devices", "2"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("done: best test accuracy") == 1 and done.stdout.count("epoch 1/1") == 1
    (record,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert (record["world_size"], record["samples"]) == (2, N_TRAIN)
    names = {p.name for p in run.iterdir()} - {"tb"}  # tb/: where tensorboard is installed (docs/training.md)
    assert names == {"config.json", "settled.json", "metrics.jsonl", "last.pt", "best.pt", "curves.png", "epochs"}
    assert json.loads((run / "config.json").read_text())["batch_size"] == 4  # per process, as given

    resumed = CliRunner().invoke(app, ["train", "--resume", str(run), "--epochs", "2"])
    assert resumed.exit_code == 0, resumed.output
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(x["epoch"], x["world_size"]) for x in lines] == [(1, 2), (2, 1)]


def test_devices_is_refused_under_torchrun_and_the_launch_command(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    result = CliRunner().invoke(app, ["train", str(tmp_path), "--out", str(tmp_path / "r"), "--devices", "2"])
    assert result.exit_code == 2 and "torchrun" in result.output
    cmd = launch_command(4, ["data", "--out", "run"])
    assert cmd[:2] == [sys.executable, "-m"] and "--standalone" in cmd and "--nproc-per-node=4" in cmd
    assert cmd[-6:] == ["-m", "ats_cli", "train", "data", "--out", "run"]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shard_batches_split_every_global_batch_evenly(world_size):
    """Every rank gets as many batches, of equal size within a step; together the ranks
    cover order[start:] exactly once, plus at most world_size - 1 padding images at the
    end; one process gets plain batches."""
    for n in (1, 5, 16, 17, 48, 50):
        order = list(range(100, 100 + n))
        for batch_size in (1, 3, 8):
            for start in {0, min(n, batch_size * world_size), n}:
                shards = [shard_batches(order, start, batch_size, Dist(r, world_size)) for r in range(world_size)]
                assert len({len(s) for s in shards}) == 1
                seen = []
                for step in zip(*shards, strict=True):
                    assert len({len(b) for b in step}) == 1 and 0 < len(step[0]) <= batch_size
                    seen += [i for b in step for i in b]
                assert seen[:n - start] == order[start:]
                assert len(seen) - (n - start) < world_size
                if world_size == 1:
                    assert shards[0] == [order[i:i + batch_size] for i in range(start, n, batch_size)]


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("feature_net", nets.available("features"))
def test_every_parameter_gets_a_gradient_in_every_step(feature_net, replace, one_thread):
    """Why DDP needs no find_unused_parameters: every parameter is in the graph of the loss
    at every step (the attention net through the sampled probabilities and the entropy,
    even when its zero-initialised last layer makes its gradient zero). A parameter
    without a gradient would make DDP fail at the next step instead."""
    for attention_net in nets.available("attention"):
        for entropy_weight, min_brightness in ((0.0, 0.0), (0.01, 0.5)):
            torch.manual_seed(0)
            model = ATSModel(nets.create(attention_net, in_channels=1, width=4),
                             nets.create(feature_net, in_channels=1, width=4), 3, n_patches=3,
                             patch_size=(16, 16), scale=0.25, replace=replace, entropy_weight=entropy_weight,
                             support={"name": "bright", "threshold": min_brightness} if min_brightness else None)
            images = (torch.rand(2, 1, 64, 64) * 255).to(torch.uint8)
            out = model(low_res_view(images, 0.25), images, generator=torch.Generator().manual_seed(0))
            model.loss(out, torch.tensor([0, 2])).backward()
            missing = [name for name, p in model.named_parameters() if p.grad is None]
            assert not missing, (attention_net, feature_net, missing)


def test_amp_on_cpu_warns_once_and_trains_in_float32(squares, tmp_path, one_thread):
    logs = []
    train(_cfg(squares, tmp_path / "bf16", epochs=1, amp="bf16"), log=logs.append)
    train(_cfg(squares, tmp_path / "fp32", epochs=1), log=lambda s: None)
    warnings = [line for line in logs if "warning" in line and "--amp" in line]  # not ats_cli.diagnose's
    assert len(warnings) == 1 and "--amp bf16" in warnings[0] and "float32" in warnings[0]
    a = load_checkpoint(tmp_path / "bf16" / "last.pt")
    b = load_checkpoint(tmp_path / "fp32" / "last.pt")
    assert a["history"][0]["amp"] == "none"
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


_FAKE_TORCHRUN = """
import os, subprocess, sys, time
from pathlib import Path
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # a worker, in torchrun's group
Path(sys.argv[1]).write_text(f"{worker.pid} {os.getpid()}\\n")
time.sleep(300)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_the_launcher_stops_its_workers(tmp_path, sig):
    """`kill` of the `ats ... --devices N` process (or Ctrl-C) reaches torchrun and its
    workers, and the launcher waits for them: nothing is left running unseen."""
    pids = tmp_path / "pids"
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from ats_cli.runtime import run_launched; "
                               f"sys.exit(run_launched([sys.executable, '-c', {_FAKE_TORCHRUN!r}, {str(pids)!r}]))"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent),
                                                          os.environ.get("PYTHONPATH", "")])})
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not pids.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [int(pid) for pid in pids.read_text().split()]  # the worker, then torchrun
        time.sleep(0.5)  # the launcher has its handlers by then: it set them before starting torchrun
        launcher.send_signal(sig)
        assert launcher.wait(timeout=30) == 128 + sig
        deadline = time.monotonic() + 10
        while any(map(_running, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_running, workers))
    finally:
        launcher.kill()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
