"""Fault injection (issue 21): bad inputs, hostile files, kills, full disks, two writers.

Every case of the issue has a test here that failed before the fix. Everything is small
and lives in tmp dirs; the few tests that need a real second process (a lock holder, a
killed make-dataset parent, a peak-memory measurement) start one.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image
from typer.testing import CliRunner

import ats_cli.predict as predict_mod
import ats_cli.train as train_mod
from ats_cli.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ats_cli.cli import app
from ats_cli.config import TrainConfig
from ats_cli.data.dataset import DatasetError, load_dataset, write_dataset
from ats_cli.data.slides import SlideReadError, open_image
from ats_cli.models import create_model, model_spec
from ats_cli.recipes import resolve_config
from ats_cli.train import TrainingInterrupted, train

runner = CliRunner(env={"COLUMNS": "1000"})  # rich wraps at 80 columns otherwise
ATS = str(Path(sys.executable).with_name("ats"))
TRAIN_ARGS = ["--n-patches", "2", "--patch-size", "16", "--scale", "0.125", "--set", "feature_width=8",
              "--batch-size", "8", "--workers", "0", "--entropy", "0", "--lr", "0.003"]


# ---------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    """A tiny two-class dataset (a striped square somewhere in a 64x64 image): 16 + 8 images."""
    root = tmp_path_factory.mktemp("squares")
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:16, :16]
    patterns = [(yy % 2 == 0), (xx % 2 == 0)]
    rows = {}
    for split, n in (("train", 16), ("test", 8)):
        (root / split).mkdir()
        rows[split] = []
        for i in range(n):
            label = i % 2
            img = np.zeros((64, 64), np.uint8)
            r, c = rng.integers(0, 48, 2)
            img[r:r + 16, c:c + 16] = 80 + 175 * patterns[label]
            Image.fromarray(img).save(root / split / f"{i}.png")
            rows[split].append({"path": f"{split}/{i}.png", "label": ["h", "v"][label]})
    write_dataset(root, ["h", "v"], rows, hints={"channels": 1})
    return root


def _cfg(data, out, **kw):
    base = dict(data=str(data), out=str(out), n_patches=2, patch_size=16, scale=0.125, feature_width=8,
                batch_size=8, epochs=2, workers=0, lr=3e-3, entropy=0.0, seed=0)
    base.update(kw)
    return resolve_config(None, **base)


def _quiet(_line: str) -> None:
    pass


def _epochs(run: Path) -> list[int]:
    return [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = load_checkpoint(a)["model"], load_checkpoint(b)["model"]
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _model(path: Path, channels: int = 1, scale: float = 0.25) -> Path:
    torch.manual_seed(0)
    cfg = TrainConfig(patch_size=16, scale=scale, n_patches=4, feature_width=8)
    spec = model_spec(cfg, n_classes=3, channels=channels)
    save_checkpoint(path, spec=spec, classes=["a", "b", "c"], model=create_model(spec))
    return path


def _png(path: Path, seed: int = 0, size: int = 128, mode: str = "L") -> Path:
    rng = np.random.default_rng(seed)
    shape = (size, size) if mode == "L" else (size, size, 3)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)
    return path


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _bomb_png(path: Path, width: int = 100_000, height: int = 100_000) -> Path:
    """A 100 kB-or-less PNG whose header claims width x height gray pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 1000))
                     + _chunk(b"IEND", b""))
    return path


def _strip_tiff(path: Path, height: int, width: int) -> Path:
    """A gray TIFF stored as ONE Deflate strip of height x width zeros, written without
    holding the image: 20000x20000 (400 MB decoded) is a ~0.4 MB file."""
    comp = zlib.compressobj(1)
    block = b"\0" * (width * max(1, (1 << 22) // width))
    rows_per_block = len(block) // width
    parts, done = [], 0
    while done < height:
        n = min(rows_per_block, height - done)
        parts.append(comp.compress(block if n == rows_per_block else b"\0" * (width * n)))
        done += n
    parts.append(comp.flush())
    data = b"".join(parts)
    tags = [(256, 4, width), (257, 4, height), (258, 3, 8), (259, 3, 8), (262, 3, 1), (273, 4, 0),
            (277, 3, 1), (278, 4, height), (279, 4, len(data)), (284, 3, 1)]
    data_offset = 8 + 2 + 12 * len(tags) + 4
    ifd = struct.pack("<H", len(tags))
    for code, typ, value in tags:
        value = data_offset if code == 273 else value
        ifd += struct.pack("<HHIHH", code, typ, 1, value, 0) if typ == 3 else struct.pack("<HHII", code, typ, 1, value)
    path.write_bytes(b"II*\x00" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0) + data)
    return path


def _peak_rss_mb(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``cmd`` in a child whose only job is to run it, and return its peak RSS (MB)."""
    probe = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stdout.write(p.stdout); sys.stderr.write(p.stderr); "
             "print(f'@@rss {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}'); sys.exit(p.returncode)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "1000"}
    p = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, env=env, timeout=300, **kw)
    rss = int(p.stdout.rsplit("@@rss ", 1)[1].split()[0]) / 1024
    return p, rss


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (killed, not yet reaped by its parent) is dead too
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


# ---------------------------------------------------------------------------- 1. a run directory belongs to one run


def test_1_train_into_a_finished_run_is_refused_and_overwrite_moves_it_aside(squares, tmp_path):
    run = tmp_path / "run"
    first = runner.invoke(app, ["train", str(squares), "--out", str(run), "--epochs", "2", *TRAIN_ARGS])
    assert first.exit_code == 0, first.output
    best = (run / "best.pt").read_bytes()
    again = runner.invoke(app, ["train", str(squares), "--out", str(run), "--epochs", "1", *TRAIN_ARGS])
    assert again.exit_code == 2, again.output
    assert "--resume" in again.output and "--overwrite" in again.output, again.output
    assert (run / "best.pt").read_bytes() == best and _epochs(run) == [1, 2]  # nothing touched

    fresh = runner.invoke(app, ["train", str(squares), "--out", str(run), "--epochs", "1", "--overwrite",
                                *TRAIN_ARGS])
    assert fresh.exit_code == 0, fresh.output
    old = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(old) == 1 and str(old[0].name) in fresh.output, fresh.output
    assert (old[0] / "best.pt").read_bytes() == best and _epochs(old[0]) == [1, 2]  # nothing lost
    assert _epochs(run) == [1] and sorted(p.name for p in (run / "epochs").iterdir()) == ["epoch_001.pt"]
    both = runner.invoke(app, ["train", "--resume", str(run), "--overwrite"])
    assert both.exit_code == 2 and "not both" in both.output, both.output


def test_1_library_train_refuses_a_directory_holding_a_run(squares, tmp_path):
    train(_cfg(squares, tmp_path / "run", epochs=1), log=_quiet)
    with pytest.raises(ValueError, match="--resume"):
        train(_cfg(squares, tmp_path / "run", epochs=1), log=_quiet)


# ---------------------------------------------------------------------------- 2. one writer at a time


def test_2_a_second_train_into_a_directory_in_use_is_refused(squares, tmp_path):
    run = tmp_path / "run"
    started, go_on = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold(phase, step, total, info):  # the first run waits inside its first epoch
        started.set()
        go_on.wait(60)

    def first():
        try:
            train(_cfg(squares, run, epochs=1), progress=hold, log=_quiet)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert started.wait(60)
        second = runner.invoke(app, ["train", str(squares), "--out", str(run), "--epochs", "1", *TRAIN_ARGS])
        resumed = runner.invoke(app, ["train", "--resume", str(run)])
        overwritten = runner.invoke(app, ["train", str(squares), "--out", str(run), "--overwrite", *TRAIN_ARGS])
    finally:
        go_on.set()
        thread.join(60)
    assert not errors, errors
    for result in (second, resumed, overwritten):
        assert result.exit_code == 2, result.output
        assert f"pid {os.getpid()}" in result.output and "in use" in result.output, result.output
    assert _epochs(run) == [1] and not list(tmp_path.glob("run.old-*"))
    assert not (run / ".ats-train.lock").exists()  # released at the end


def test_2_a_lock_left_by_a_killed_process_is_taken_over(squares, tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from ats_cli.runtime import RunLock; "
         "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)", str(run)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = json.loads((run / ".ats-train.lock").read_text())
        assert lock["pid"] == holder.pid and lock["host"]
        busy = runner.invoke(app, ["train", str(squares), "--out", str(run), "--epochs", "1", *TRAIN_ARGS])
        assert busy.exit_code == 2 and f"pid {holder.pid}" in busy.output, busy.output
    finally:
        holder.kill()  # kill -9: the lock file stays behind, its owner is dead
        holder.wait()
    assert (run / ".ats-train.lock").exists()
    took = runner.invoke(app, ["train", str(squares), "--out", str(run), "--epochs", "1", *TRAIN_ARGS])
    assert took.exit_code == 0, took.output
    assert _epochs(run) == [1]


# ---------------------------------------------------------------------------- 3. bounded memory for every reader


def test_3_a_tiff_strip_over_the_pixel_budget_is_refused_naming_the_limit_and_the_flag(tmp_path):
    model = _model(tmp_path / "m.pt")
    tif = _strip_tiff(tmp_path / "strip.tif", 1200, 1000)
    result = runner.invoke(app, ["predict", str(tif), "-m", str(model), "--max-pixels", "1000000"])
    assert result.exit_code == 1, result.output
    assert "strip.tif" in result.output and "1,200,000" in result.output and "1,000,000" in result.output
    assert "--max-pixels" in result.output and "ATS_MAX_PIXELS" in result.output, result.output
    assert "Traceback" not in result.output
    # the header alone is fine to show, and within the budget the file predicts
    assert runner.invoke(app, ["info", str(tif), "--max-pixels", "1000000"]).exit_code == 0
    ok = runner.invoke(app, ["predict", str(tif), "-m", str(model), "--max-pixels", "2000000"])
    assert ok.exit_code == 0, ok.output
    # PNG and JPEG: checked from the header, before decoding
    big = _png(tmp_path / "big.png", size=1100)
    res = runner.invoke(app, ["predict", str(big), "-m", str(model), "--max-pixels", "1000000"])
    assert res.exit_code == 1 and "1,210,000" in res.output and "--max-pixels" in res.output, res.output


def test_3_the_environment_variable_sets_the_budget(tmp_path, monkeypatch):
    tif = _strip_tiff(tmp_path / "strip.tif", 1200, 1000)
    monkeypatch.setenv("ATS_MAX_PIXELS", "1000000")
    with pytest.raises(SlideReadError, match="over the limit of 1,000,000"):
        open_image(tif).low_res((10, 10))


def test_3_a_tiff_bomb_is_refused_in_bounded_memory(tmp_path):
    model = _model(tmp_path / "m.pt")
    bomb = _strip_tiff(tmp_path / "bomb.tif", 20_000, 20_000)
    assert bomb.stat().st_size < 2_000_000
    started = time.perf_counter()
    p, rss = _peak_rss_mb([ATS, "predict", str(bomb), "-m", str(model)])
    assert p.returncode == 1, p.stdout + p.stderr
    assert "bomb.tif" in p.stderr and "--max-pixels" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert rss < 1500, rss
    assert time.perf_counter() - started < 30


def test_3_the_low_res_view_read_in_bands_equals_the_whole_read(monkeypatch):
    import torch.nn.functional as F

    import ats_cli.data.images as images
    from ats_cli.core.source import low_res_view
    from ats_cli.data.inputs import low_res_view as banded_view
    from ats_cli.data.slides import ArrayReader

    rng = np.random.default_rng(0)
    for shape, size in (((301, 257, 3), (37, 31)), ((200, 300, 1), (25, 38)), ((64, 64, 3), (64, 64))):
        image = rng.integers(0, 256, shape, dtype=np.uint8)
        x = torch.from_numpy(image).permute(2, 0, 1)
        whole = F.interpolate(x[None].float(), size=size, mode="bilinear", align_corners=False, antialias=True)[0]
        whole = whole.permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()  # how slides did it
        for band_bytes in (images.BAND_BYTES, 4096):  # one band, many bands
            monkeypatch.setattr(images, "BAND_BYTES", band_bytes)
            assert np.array_equal(ArrayReader(image).low_res(size), whole), (shape, band_bytes)
            assert torch.equal(banded_view(x, 0.125), low_res_view(x, 0.125)), (shape, band_bytes)


# ---------------------------------------------------------------------------- 4. ats info goes on past a bad file


def test_4_info_goes_on_past_a_decompression_bomb_png(tmp_path):
    good, good2 = _png(tmp_path / "good.png"), _png(tmp_path / "good2.png", 1)
    bomb = _bomb_png(tmp_path / "bomb.png")
    result = runner.invoke(app, ["info", str(good), str(bomb), str(good2)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "good2.png" in result.output and "good.png" in result.output
    assert "bomb.png" in result.output and "10,000,000,000" in result.output, result.output
    assert "1 of 3 file(s) failed" in result.output, result.output
    model = _model(tmp_path / "m.pt")
    pred = runner.invoke(app, ["predict", str(good), str(bomb), "-m", str(model)])
    assert pred.exit_code == 1 and "bomb.png" in pred.output and "1 predicted, 1 failed" in pred.output, pred.output


# ---------------------------------------------------------------------------- 5. non-finite weights and outputs


def test_5_a_checkpoint_with_a_nan_weight_is_refused_naming_the_file(tmp_path):
    ckpt = load_checkpoint(_model(tmp_path / "m.pt"))
    name = next(k for k, v in ckpt["model"].items() if v.is_floating_point() and v.numel() > 1)
    ckpt["model"][name].view(-1)[3] = float("nan")
    torch.save(ckpt, tmp_path / "nan.pt")
    with pytest.raises(CheckpointError, match=rf"nan\.pt.*{name}.*NaN"):
        load_checkpoint(tmp_path / "nan.pt")
    result = runner.invoke(app, ["predict", str(_png(tmp_path / "g.png")), "-m", str(tmp_path / "nan.pt")])
    assert result.exit_code == 2 and "nan.pt" in result.output and "NaN" in result.output, result.output


def test_5_a_nan_probability_is_an_error_for_that_image(tmp_path):
    ckpt = load_checkpoint(_model(tmp_path / "m.pt"))
    for v in ckpt["model"].values():  # finite weights whose products overflow to inf, then NaN
        if v.is_floating_point():
            v.mul_(1e30)
    torch.save(ckpt, tmp_path / "huge.pt")
    image = _png(tmp_path / "g.png")
    result = runner.invoke(app, ["predict", str(image), "-m", str(tmp_path / "huge.pt"), "--out",
                                 str(tmp_path / "p.csv")])
    assert result.exit_code == 1, result.output
    assert "g.png" in result.output and "not finite" in result.output, result.output
    assert "nan" not in (tmp_path / "p.csv").read_text()


# ---------------------------------------------------------------------------- 6. an epoch's record is atomic


class _Killed(BaseException):
    """Stands for kill -9 (not an Exception: nothing may catch it on the way out)."""


def _epoch_end_writers() -> list[str]:
    return [n for n in ("save_checkpoint", "append_metrics", "_plot_curves") if hasattr(train_mod, n)]


def _arm_at_epoch_end(epoch: int, monkeypatch, fault):
    """Wrap the writers of train.py; after the last step of ``epoch`` the ``fault(k, when)``
    callback sees every write of that epoch's end (k-th write, 'before'/'after')."""
    state = {"armed": False, "k": 0}

    def progress(phase, step, total, info):
        state["armed"] = info["epoch"] == epoch and step == total  # off again once the next epoch starts

    for name in _epoch_end_writers():
        real = getattr(train_mod, name)

        def wrapper(*a, _real=real, **kw):
            if not state["armed"]:
                return _real(*a, **kw)
            k = state["k"]
            state["k"] += 1
            fault(k, "before")
            out = _real(*a, **kw)
            fault(k, "after")
            return out

        monkeypatch.setattr(train_mod, name, wrapper)
    return progress, state


@pytest.fixture(scope="module")
def straight(squares, tmp_path_factory):
    run = tmp_path_factory.mktemp("straight") / "run"
    train(_cfg(squares, run, epochs=3), log=_quiet)
    return run


@pytest.fixture(scope="module")
def epoch_end_writes(squares, tmp_path_factory) -> int:
    """How many writes epoch 2's end makes (counted once for both faults)."""
    with pytest.MonkeyPatch.context() as m:
        progress, state = _arm_at_epoch_end(2, m, lambda k, when: None)
        train(_cfg(squares, tmp_path_factory.mktemp("count") / "run", epochs=3), progress=progress, log=_quiet)
    return state["k"]


@pytest.mark.parametrize("fault", ["kill", "disk full"])
@pytest.mark.draws_curves
def test_6_a_kill_or_full_disk_at_every_point_of_the_epoch_end_never_duplicates_or_loses_an_epoch(
        squares, straight, epoch_end_writes, tmp_path, monkeypatch, fault):
    points = [(k, "before") for k in range(epoch_end_writes)] + [(epoch_end_writes - 1, "after")]
    assert len(points) >= 4
    for point in points:
        run = tmp_path / f"{point[0]}-{point[1]}"

        def inject(k, when, point=point):
            if (k, when) == point:
                raise _Killed() if fault == "kill" else OSError(errno.ENOSPC, "No space left on device")

        with monkeypatch.context() as m:
            progress, _ = _arm_at_epoch_end(2, m, inject)
            with pytest.raises((_Killed, OSError, ValueError)):
                train(_cfg(squares, run, epochs=3), progress=progress, log=_quiet)
        history = train(_cfg(squares, run, epochs=3), resume=True, log=_quiet)
        assert [h["epoch"] for h in history] == [1, 2, 3], point
        assert _epochs(run) == [1, 2, 3], point
        _same_weights(run / "last.pt", straight / "last.pt")
        assert load_checkpoint(run / "best.pt")["epoch"] == load_checkpoint(straight / "best.pt")["epoch"], point
        ours = [json.loads(x)["test_acc"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        theirs = [json.loads(x)["test_acc"] for x in (straight / "metrics.jsonl").read_text().splitlines()]
        assert ours == theirs, point


def test_6_a_full_disk_is_one_line_naming_the_run(squares, tmp_path, monkeypatch):
    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train_mod, "save_checkpoint", full)
    result = runner.invoke(app, ["train", str(squares), "--out", str(tmp_path / "run"), "--epochs", "1",
                                 *TRAIN_ARGS])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "No space left on device" in result.output and "run" in result.output, result.output


# ---------------------------------------------------------------------------- 7. the weaker ones


def test_7_an_unwritable_predict_out_fails_before_any_prediction(tmp_path, monkeypatch):
    model, image = _model(tmp_path / "m.pt"), _png(tmp_path / "g.png")
    (tmp_path / "file").write_text("not a directory")
    called = []
    monkeypatch.setattr(predict_mod.Predictor, "predict", lambda self, *a, **kw: called.append(1) or [])
    result = runner.invoke(app, ["predict", str(image), "-m", str(model), "--out", str(tmp_path / "file" / "p.csv")])
    assert result.exit_code == 2, result.output
    assert "cannot write" in result.output and "p.csv" in result.output and not called, result.output
    vis = runner.invoke(app, ["visualize", str(image), "-m", str(model), "--out", str(tmp_path / "file" / "v.png")])
    assert vis.exit_code == 2 and "cannot write" in vis.output, vis.output


def test_7_ctrl_c_in_predict_saves_the_rows_done_and_says_so(tmp_path, monkeypatch):
    model = _model(tmp_path / "m.pt")
    images = [_png(tmp_path / f"g{i}.png", i) for i in range(3)]
    real = predict_mod.open_input

    def interrupt_second(path, **kw):
        if Path(path) == images[1]:
            raise KeyboardInterrupt
        return real(path, **kw)

    monkeypatch.setattr(predict_mod.predictor, "open_input", interrupt_second)  # where Predictor finds it
    out = tmp_path / "p.csv"
    try:
        result = runner.invoke(app, ["predict", *map(str, images), "-m", str(model), "--out", str(out)])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped ats predict")
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.output and str(out) in result.output, result.output
    rows = out.read_text().splitlines()
    assert len(rows) == 2 and "g0.png" in rows[1]


def test_7_ctrl_c_during_evaluation_saves_the_epochs_steps(squares, straight, tmp_path, monkeypatch):
    real, calls = train_mod.evaluate, []

    def interrupt_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(train_mod, "evaluate", interrupt_second)
    run = tmp_path / "run"
    try:
        with pytest.raises(TrainingInterrupted, match="evaluat.*--resume"):
            train(_cfg(squares, run, epochs=3), log=_quiet)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C during evaluation escaped without saving")
    ckpt = load_checkpoint(run / "last.pt")
    assert ckpt["epoch"] == 1 and ckpt["samples"] == 16  # epoch 2's steps are all there
    monkeypatch.setattr(train_mod, "evaluate", real)
    history = train(_cfg(squares, run, epochs=3), resume=True, log=_quiet)
    assert [h["epoch"] for h in history] == [1, 2, 3] and _epochs(run) == [1, 2, 3]
    _same_weights(run / "last.pt", straight / "last.pt")


def test_7_a_truncated_tiff_is_reported_as_truncated(tmp_path):
    rng = np.random.default_rng(0)
    tif = tmp_path / "t.tif"
    tifffile.imwrite(tif, rng.integers(0, 256, (256, 256, 3), dtype=np.uint8), tile=(64, 64), compression="zlib")
    data = tif.read_bytes()
    cut = tmp_path / "cut.tif"
    cut.write_bytes(data[: len(data) // 2])
    model = _model(tmp_path / "m.pt", channels=1)
    result = runner.invoke(app, ["predict", str(cut), "-m", str(model)])
    assert result.exit_code == 1, result.output
    assert "cut.tif" in result.output and "truncated" in result.output, result.output
    assert "channels" not in result.output
    with pytest.raises(SlideReadError, match="truncated"):
        open_image(cut)


def test_7_a_tile_decode_error_names_the_file_and_the_tile(tmp_path):
    rng = np.random.default_rng(0)
    tif = tmp_path / "t.tif"
    tifffile.imwrite(tif, rng.integers(0, 256, (256, 256), dtype=np.uint8), tile=(64, 64), compression="zlib")
    with tifffile.TiffFile(tif) as t:
        offset, n = int(t.pages[0].dataoffsets[5]), int(t.pages[0].databytecounts[5])
    data = bytearray(tif.read_bytes())
    data[offset:offset + n] = bytes(rng.integers(0, 256, n, dtype=np.uint8))
    tif.write_bytes(bytes(data))
    with open_image(tif) as slide:
        slide.read_region(0, 0, 64, 64)  # a region away from the corrupt tile reads fine
        with pytest.raises(SlideReadError, match=r"t\.tif: cannot decode tile 5 \(row 64, column 64\) of level 0"):
            slide.read_region(64, 64, 64, 64)


def test_7_make_dataset_workers_do_not_outlive_a_killed_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys, time\n"
        "from ats_cli.data.generation import run_generation\n"
        "class SlowJob:\n"
        "    def __init__(self, d):\n"
        "        self.d = d\n"
        "    def run_chunk(self, split, indices):\n"
        "        open(os.path.join(self.d, f'worker-{os.getpid()}'), 'w').close()\n"
        "        time.sleep(120)\n"
        "        return []\n"
        "if __name__ == '__main__':\n"
        "    run_generation(os.path.join(sys.argv[1], 'out'), {'name': 'slow', 'version': 1, 'params': {}},\n"
        "                   SlowJob(sys.argv[1]), {'train': 4, 'test': 4}, dataset={'classes': ['a']},\n"
        "                   workers=2, chunk_size=1)\n")
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = [int(p.name.split("-")[1]) for p in tmp_path.glob("worker-*")]
            time.sleep(0.1)
        assert len(workers) == 2
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    try:
        deadline = time.monotonic() + 10
        while any(map(_pid_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_pid_alive, workers)), "workers outlived their parent"
    finally:
        for pid in workers:
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_7_a_csv_with_an_unclosed_quote_is_named_as_such(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    _png(root / "a.png")
    _png(root / "b.png", 1)
    (root / "dataset.json").write_text(json.dumps({"classes": ["cat", "dog"]}))
    (root / "train.csv").write_text('path,label\n"a.png,cat\nb.png,dog\n')
    (root / "test.csv").write_text("path,label\nb.png,dog\n")
    with pytest.raises(DatasetError, match=r"train\.csv:2: .*quote") as err:
        load_dataset(root)
    assert "missing file" not in str(err.value)
    model = _model(tmp_path / "m.pt")
    result = runner.invoke(app, ["predict", str(root / "train.csv"), "-m", str(model)])
    assert result.exit_code == 1 and "quote" in result.output and "not found" not in result.output, result.output


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_7_a_blocked_checkpoint_never_advises_weights_only_false(tmp_path, capsys):
    evil = tmp_path / "evil.pt"
    torch.save({"format": "ats-checkpoint", "payload": _Evil()}, evil)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(evil)
    message = str(err.value)
    assert "evil.pt" in message and "print" in message
    assert "weights_only" not in message and "trust" not in message, message
    assert "this must never run" not in capsys.readouterr().out
    result = runner.invoke(app, ["predict", str(_png(tmp_path / "g.png")), "-m", str(evil)])
    assert result.exit_code == 2 and "weights_only" not in result.output, result.output
