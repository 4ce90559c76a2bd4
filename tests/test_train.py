"""`ats train`: learning, metrics and checkpoints, exact resumption, safe loading, config."""

from __future__ import annotations

import importlib
import json
import pickle
import re
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from ats_cli.checkpoint import CheckpointError, load_checkpoint, load_model
from ats_cli.cli import app
from ats_cli.config import ConfigError
from ats_cli.data.dataset import write_dataset
from ats_cli.data.images import ImageReadError
from ats_cli.recipes import resolve_config
from ats_cli.train import TrainingInterrupted, train

cli_train = importlib.import_module("ats_cli.cli.train")  # the module; the package exports the command


def _write_squares_dataset(root, n_train=48, n_test=16, size=64, box=16, seed=0, *, period=2, floor=80,
                           n_noise=0, channels=1, names=("horizontal", "vertical")):
    """A bright square at a random place whose stripe direction (class) is invisible at
    low resolution: the model must find it with the attention and read it in a patch.
    ``n_noise`` decoy squares of random dots (as bright on average, so alike at low
    resolution; none overlapping) make finding it harder; ``period`` and ``floor`` set the
    stripes (every ``period``-th row or column at 255, the others at ``floor``). ``channels``
    3: the same images tinted pink, as RGB (something for a stain jitter to vary)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:box, :box]
    patterns = [(yy % period == 0), (xx % period == 0)]
    rows = {}
    for split, n in (("train", n_train), ("test", n_test)):
        (root / split).mkdir(parents=True)
        rows[split] = []
        for i in range(n):
            label = int(rng.integers(2))
            img = np.zeros((size, size), np.uint8)
            taken: list[tuple[int, int]] = []
            for k in range(1 + n_noise):
                while True:
                    r, c = (int(v) for v in rng.integers(0, size - box, 2))
                    if all(abs(r - a) >= box or abs(c - b) >= box for a, b in taken):
                        break
                taken.append((r, c))
                if k == 0:
                    img[r:r + box, c:c + box] = floor + (255 - floor) * patterns[label]
                else:
                    img[r:r + box, c:c + box] = 255 * (rng.random((box, box)) < 1 / period)
            if channels == 3:
                img = (img[..., None] * np.array([1.0, 0.55, 0.8])).astype(np.uint8)
            Image.fromarray(img).save(root / split / f"{i}.png")
            rows[split].append({"path": f"{split}/{i}.png", "label": names[label]})
    write_dataset(root, list(names), rows, hints={"channels": channels})
    return root


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    return _write_squares_dataset(tmp_path_factory.mktemp("squares"))


def _cfg(data, out, **kw):
    # constant lr: the resume test extends a 1-epoch run to 2, which under the default cosine
    # schedule is a different schedule from a 2-epoch run, by design
    base = dict(data=str(data), out=str(out), n_patches=2, patch_size=16, scale=0.125, feature_width=8,
                batch_size=8, epochs=2, workers=0, lr=3e-3, entropy=0.0, seed=0, schedule="constant")
    base.update(kw)
    return resolve_config(None, **base)


def _weights(run):
    return load_checkpoint(run / "last.pt")["model"]


@pytest.mark.draws_curves
def test_two_epochs_lower_the_loss_and_write_the_run_directory(squares, tmp_path):
    history = train(_cfg(squares, tmp_path / "run", epochs=3), log=lambda s: None)
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    for key in ("train_loss", "train_acc", "test_loss", "test_acc", "entropy", "samples_per_s", "ms_per_sample",
                "peak_mem_mb"):
        assert key in lines[0]
    for name in ("last.pt", "best.pt", "config.json", "curves.png", "epochs/epoch_001.pt", "epochs/epoch_003.pt"):
        assert (run / name).is_file(), name
    assert json.loads((run / "config.json").read_text())["n_patches"] == 2
    model, ckpt = load_model(run / "best.pt")
    assert ckpt["classes"] == ["horizontal", "vertical"] and not model.training


def test_a_val_split_chooses_best_pt_and_the_test_figure_is_that_epochs(squares, tmp_path, monkeypatch):
    """With a val.csv, best.pt is the epoch with the best validation accuracy, and the line
    that ends the run quotes that epoch's test accuracy, not the best test accuracy (the
    maximum over epochs of a noisy figure, an optimistic one). Scripted accuracies: val
    peaks at epoch 2, test at epoch 1. Negative control: without val.csv the test split
    chooses (epoch 1), and the line says so."""
    import shutil

    import ats_cli.train as train_mod
    from ats_cli.data.dataset import load_dataset

    data = tmp_path / "with-val"
    shutil.copytree(squares, data)
    dataset = load_dataset(data)
    rows = {split: [{"path": str(r.path), "label": dataset.classes[r.label]} for r in dataset[split]]
            for split in ("train", "test")}
    rows["train"], val = rows["train"][:-8], rows["train"][-8:]
    write_dataset(data, dataset.classes, {**rows, "val": val}, hints={"channels": 1})
    script = {"val": [0.5, 0.9, 0.6], "test": [0.95, 0.4, 0.6]}
    calls = {"val": 0, "test": 0}
    real = train_mod.evaluate

    def scripted(model, loader, device, **kw):
        out = real(model, loader, device, **kw)
        split = "val" if len(loader.batch_sampler) == 1 else "test"  # 8 val images: one batch of 8; 16 test: two
        out["acc"] = script[split][calls[split]]
        calls[split] += 1
        return out

    monkeypatch.setattr(train_mod, "evaluate", scripted)
    result = CliRunner().invoke(app, ["train", str(data), "--out", str(tmp_path / "run"), "--epochs", "3",
                                      "--n-patches", "2", "--patch-size", "16", "--scale", "0.125",
                                      "--set", "feature_width=8", "--batch-size", "8", "--workers", "0"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_acc"] for r in lines] == script["val"] and [r["test_acc"] for r in lines] == script["test"]
    assert load_checkpoint(tmp_path / "run" / "best.pt")["epoch"] == 2
    assert "done: best val accuracy 0.900 at epoch 2 (best.pt), its test accuracy 0.400" in result.output

    calls.update(val=0, test=0)
    result = CliRunner().invoke(app, ["train", str(squares), "--out", str(tmp_path / "no-val"), "--epochs", "3",
                                      "--n-patches", "2", "--patch-size", "16", "--scale", "0.125",
                                      "--set", "feature_width=8", "--batch-size", "8", "--workers", "0"])
    assert result.exit_code == 0, result.output
    assert load_checkpoint(tmp_path / "no-val" / "best.pt")["epoch"] == 1
    assert "done: best test accuracy 0.950 at epoch 1 (best.pt; chosen on the test split, no val.csv)" in result.output


def test_workers_0_still_prepares_with_the_auto_count(squares, tmp_path, monkeypatch):
    """--workers 0 is about the loader (no forks, no shared memory); preparing the images is
    a one-off decode in processes of its own, so it keeps the auto count (here a CPU: 2)."""
    import ats_cli.data.prepared as prepared_mod
    from ats_cli.train import AUTO_WORKERS_CPU

    seen, real = [], prepared_mod.prepare_for_run

    def spy(*args, **kwargs):
        seen.append(kwargs["workers"])
        return real(*args, **kwargs)

    monkeypatch.setattr(prepared_mod, "prepare_for_run", spy)
    train(_cfg(squares, tmp_path / "run", epochs=1, workers=0), log=lambda s: None)
    assert seen == [AUTO_WORKERS_CPU]


def test_resume_equals_an_uninterrupted_run(squares, tmp_path):
    train(_cfg(squares, tmp_path / "straight"), log=lambda s: None)
    # stop after epoch 1, then extend to 2 epochs
    train(_cfg(squares, tmp_path / "resumed", epochs=1), log=lambda s: None)
    train(_cfg(squares, tmp_path / "resumed"), resume=True, log=lambda s: None)
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture
def interactive_sigint():
    """Python's own Ctrl-C handler for the test: a test run started in the background by a
    non-interactive shell inherits SIGINT ignored (which ats rightly keeps ignored)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.draws_curves
def test_ctrl_c_while_an_epoch_is_being_saved_finishes_the_save_and_stops(squares, tmp_path, monkeypatch,
                                                                          interactive_sigint):
    """Ctrl-C while epoch 1's checkpoints, metrics and curves are written (the first
    matplotlib import can take seconds; CI once sent its signal right then) does not cut
    the save short with a traceback: the epoch is saved whole, the run stops with
    TrainingInterrupted, and --resume goes on with epoch 2, as an uninterrupted run."""
    import os
    import signal

    import ats_cli.train as train_module

    train(_cfg(squares, tmp_path / "straight"), log=lambda s: None)
    append = train_module.append_metrics

    def interrupted_append(run, record):
        if record["epoch"] == 1:
            os.kill(os.getpid(), signal.SIGINT)  # delivered here, in the middle of the saves
        append(run, record)

    monkeypatch.setattr(train_module, "append_metrics", interrupted_append)
    with pytest.raises(TrainingInterrupted, match="end of epoch 1"):
        train(_cfg(squares, tmp_path / "cut"), log=lambda s: None)
    assert (tmp_path / "cut" / "curves.png").is_file()
    assert len((tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()) == 1
    assert load_checkpoint(tmp_path / "cut" / "last.pt")["epoch"] == 1
    history = train(_cfg(squares, tmp_path / "cut"), resume=True, log=lambda s: None)
    assert [h["epoch"] for h in history] == [1, 2]
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "cut")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_ctrl_c_mid_epoch_saves_and_resume_is_exact(squares, tmp_path):
    train(_cfg(squares, tmp_path / "straight"), log=lambda s: None)

    def interrupt(phase, step, total, info):
        if info["epoch"] == 2 and step == 3:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted, match="--resume"):
        train(_cfg(squares, tmp_path / "cut"), progress=interrupt, log=lambda s: None)
    ckpt = load_checkpoint(tmp_path / "cut" / "last.pt")
    assert (ckpt["epoch"], ckpt["step"]) == (1, 3)
    history = train(_cfg(squares, tmp_path / "cut"), resume=True, log=lambda s: None)
    assert [h["epoch"] for h in history] == [1, 2]
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "cut")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_init_starts_from_another_runs_weights_and_checks_they_fit(squares, tmp_path):
    # a feature net without batch norm: its running statistics would move at any learning rate
    net = "mnist-features"
    train(_cfg(squares, tmp_path / "first", epochs=3, feature_net=net), log=lambda s: None)
    first = load_checkpoint(tmp_path / "first" / "best.pt")
    # ~0 learning rate: the run keeps the weights it started from (had --init been ignored,
    # they would be the seed's random initialisation, far from the trained ones)
    train(_cfg(squares, tmp_path / "tuned", epochs=1, lr=1e-12, init=str(tmp_path / "first" / "best.pt"),
               feature_net=net), log=lambda s: None)
    tuned = _weights(tmp_path / "tuned")
    for k, v in first["model"].items():
        if v.is_floating_point():
            torch.testing.assert_close(tuned[k], v, rtol=0, atol=1e-6, msg=k)
    with pytest.raises(CheckpointError, match="networks"):
        train(_cfg(squares, tmp_path / "wider", feature_width=12, init=str(tmp_path / "first" / "best.pt"),
                   feature_net=net), log=lambda s: None)


def test_init_transfers_the_networks_to_other_classes_and_another_pooling(squares, tmp_path):
    """Transfer: --init from a run with other classes and a counts pooling takes the two
    networks; the classifier (other classes) starts from its own initialisation and the
    "none" logit (a counts pooling's) is not used; the log line says so."""
    net = "mnist-features"
    train(_cfg(squares, tmp_path / "source", epochs=1, feature_net=net, pooling="counts", none_class="on"),
          log=lambda s: None)
    source = load_checkpoint(tmp_path / "source" / "best.pt")["model"]
    assert "pooling.none.weight" in source
    other = _write_squares_dataset(tmp_path / "other", names=("rows", "columns"))
    lines: list[str] = []
    train(_cfg(other, tmp_path / "target", epochs=1, lr=1e-12, feature_net=net,
               init=str(tmp_path / "source" / "best.pt")), log=lines.append)
    target = _weights(tmp_path / "target")
    for k, v in source.items():
        if k.startswith(("attention_net.", "feature_net.")) and v.is_floating_point():
            torch.testing.assert_close(target[k], v, rtol=0, atol=1e-6, msg=k)
    assert not torch.allclose(target["classifier.weight"], source["classifier.weight"], atol=1e-3)
    assert "pooling.none.weight" not in target
    [said] = [line for line in lines if line.startswith("initialised the model from")]
    assert "took attention_net, feature_net" in said and "initialisation: classifier" in said
    assert "not used: classifier, pooling.none" in said and "['horizontal', 'vertical']" in said
    assert any("feature_train all: the feature net starts from init" in line for line in lines)


def test_feature_lr_zero_freezes_the_encoder_and_its_batch_norms(squares, tmp_path):
    # small-cnn has batch norms: frozen means their running statistics too, through training
    # (evaluation mode) and the end-of-epoch recalibration, while the rest of the model learns
    train(_cfg(squares, tmp_path / "first", epochs=1), log=lambda s: None)
    first = load_checkpoint(tmp_path / "first" / "best.pt")["model"]
    train(_cfg(squares, tmp_path / "frozen", epochs=1, feature_lr=0.0, init=str(tmp_path / "first" / "best.pt")),
          log=lambda s: None)
    for name in ("last.pt", "best.pt"):
        after = load_checkpoint(tmp_path / "frozen" / name)["model"]
        features = [k for k in after if k.startswith("feature_net.")]
        assert any("running_mean" in k for k in features)
        for k in features:
            assert torch.equal(after[k], first[k]), (name, k)
        assert not torch.equal(after["classifier.weight"], first["classifier.weight"])
    # a fraction of --lr: the feature net moves, in a parameter group of its own
    train(_cfg(squares, tmp_path / "gentle", epochs=1, feature_lr=0.1, init=str(tmp_path / "first" / "best.pt")),
          log=lambda s: None)
    opt = load_checkpoint(tmp_path / "gentle" / "last.pt")["optimizer"]
    assert [g["lr_scale"] for g in opt["param_groups"]] == [1.0, 0.1]
    assert opt["param_groups"][1]["lr"] == pytest.approx(0.1 * opt["param_groups"][0]["lr"])
    gentle = _weights(tmp_path / "gentle")
    conv = next(k for k in first if k.startswith("feature_net.") and k.endswith("weight"))
    assert not torch.equal(gentle[conv], first[conv])
    with pytest.raises(ConfigError, match="no feature network"):
        _cfg(squares, tmp_path / "cnn", method="cnn", feature_lr=0.0)


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


# torch warns about the hostile pickle's protocol before refusing it: expected here
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_checkpoints_never_unpickle_arbitrary_objects(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"format": "ats-checkpoint", "payload": _Evil()}, evil)
    with pytest.raises(CheckpointError, match="evil.pt"):
        load_checkpoint(evil)
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps({"a": 1}) + b"garbage")
    with pytest.raises(CheckpointError, match="raw.pt"):
        load_checkpoint(raw)
    plain = tmp_path / "plain.pt"
    torch.save({"weights": torch.zeros(2)}, plain)
    with pytest.raises(CheckpointError, match="not an ats checkpoint"):
        load_checkpoint(plain)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")


def test_config_file_then_flags(tmp_path):
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text("n_patches = 7\nlr = 0.01\nepochs = 3\n")
    cfg = resolve_config(cfg_file, epochs=5, data="d", out="o")
    assert (cfg.n_patches, cfg.lr, cfg.epochs) == (7, 0.01, 5)
    cfg_file.write_text("n_pathces = 7\n")
    with pytest.raises(ConfigError, match="n_pathces"):
        resolve_config(cfg_file)
    with pytest.raises(ConfigError, match="optimizer"):
        resolve_config(None, optimizer="lbfgs")
    with pytest.raises(ConfigError, match="estimator must be one of auto, threshold, sequential"):
        resolve_config(None, estimator="mean")
    cfg_file.write_text('estimator = "sequential"\n')
    assert resolve_config(cfg_file).estimator == "sequential"


def test_cli_train_says_what_it_settled_and_resume_keeps_it_as_it_is(squares, tmp_path, monkeypatch):
    run = tmp_path / "run"
    args = ["--n-patches", "2", "--patch-size", "16", "--set", "feature_width=8", "--batch-size", "8", "--workers", "0"]
    first = CliRunner().invoke(app, ["train", str(squares), "--out", str(run), "--epochs", "1", *args])
    assert first.exit_code == 0, first.output
    assert "settled from the data" in first.output
    for line in ("n_patches 2: given", "scale 1: the training images' typical long side is 64 px",
                 "eval_n_patches 4: twice n_patches", "min_brightness 0.15: a black background"):
        assert line in first.output
    config, settled = (json.loads((run / name).read_text()) for name in ("config.json", "settled.json"))
    assert (config["scale"], config["min_brightness"], config["augment"]) == (1.0, 0.15, "none")
    assert "min_brightness 0.15: a black background" in " ".join(settled["reasons"])

    def look_again(*args, **kwargs):
        raise AssertionError("--resume looked at the data again")

    monkeypatch.setattr("ats_cli.train.settle_data", look_again)
    again = CliRunner().invoke(app, ["train", "--resume", str(run), "--epochs", "2"])
    assert again.exit_code == 0, again.output
    assert "settled from the data" not in again.output
    assert json.loads((run / "config.json").read_text()) == {**config, "epochs": 2}
    assert json.loads((run / "settled.json").read_text()) == settled


def test_cli_train_runs_and_reports(squares, tmp_path, monkeypatch):
    # CliRunner's output is not a terminal, like a batch job's log: progress comes as lines
    monkeypatch.setattr(cli_train, "LOG_EVERY_S", 0.0)
    result = CliRunner().invoke(app, ["train", str(squares), "--out", str(tmp_path / "run"), "--epochs", "1",
                                      "--n-patches", "2", "--patch-size", "16", "--scale", "0.125",
                                      "--set", "feature_width=8", "--batch-size", "8", "--workers", "0"])
    assert result.exit_code == 0, result.output
    assert "best test accuracy" in result.output
    assert re.search(r"epoch 1: step \d+/\d+, loss \d\.\d{3} acc", result.output), result.output
    bad = CliRunner().invoke(app, ["train", str(tmp_path / "nope"), "--out", str(tmp_path / "r2")])
    assert bad.exit_code == 1 and "nope" in bad.output


# ---------------------------------------------------------------------------- TensorBoard (optional)


@pytest.fixture
def fake_tensorboard(monkeypatch):
    """torch.utils.tensorboard with a SummaryWriter that keeps what it is given (the tests
    must not depend on the package being installed); returns the writers made."""
    made = []

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None):
            self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, {}, False
            made.append(self)

        def add_scalar(self, tag, value, step):
            self.scalars[tag, step] = value

        def flush(self):
            pass

        def close(self):
            self.closed = True

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    return made


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_shows_each_epochs_record_once_across_a_resume(squares, tmp_path, fake_tensorboard):
    run = tmp_path / "run"
    train(_cfg(squares, run, epochs=1), log=lambda s: None)
    train(_cfg(squares, run), resume=True, log=lambda s: None)
    first, second = fake_tensorboard
    assert first.log_dir == second.log_dir == str(run / "tb") and first.closed and second.closed
    assert (first.purge_step, second.purge_step) == (1, 2)  # the resumed writer hides epoch 2 onward of the first
    shown = {**first.scalars, **second.scalars}
    for record in _metrics(run):  # metrics.jsonl is the record; TensorBoard shows the same numbers
        e = record["epoch"]
        assert shown["loss/train", e] == record["train_loss"] and shown["loss/test", e] == record["test_loss"]
        assert shown["accuracy/train", e] == record["train_acc"] and shown["accuracy/test", e] == record["test_acc"]
        assert shown["attention/entropy", e] == record["entropy"] and shown["lr", e] == record["lr"]
        assert shown["samples_per_s", e] == record["samples_per_s"]


def test_a_failing_tensorboard_costs_one_warning_line_not_the_run(squares, tmp_path, fake_tensorboard, monkeypatch):
    def full_disk(self, tag, value, step):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sys.modules["torch.utils.tensorboard"].SummaryWriter, "add_scalar", full_disk)
    lines = []
    history = train(_cfg(squares, tmp_path / "run"), log=lines.append)
    assert [h["epoch"] for h in history] == [1, 2] and len(_metrics(tmp_path / "run")) == 2
    warnings = [line for line in lines if "TensorBoard" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], lines
    assert len(fake_tensorboard) == 1 and fake_tensorboard[0].closed  # no second try


def test_without_tensorboard_installed_nothing_is_said_or_written(squares, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what `import tensorboard` sees when it is absent
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    lines = []
    train(_cfg(squares, tmp_path / "run", epochs=1), log=lines.append)
    assert not any("TensorBoard" in line for line in lines) and not (tmp_path / "run" / "tb").exists()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT-ignored"])
def test_a_scheduler_stop_saves_the_run_like_ctrl_c(squares, tmp_path, sig):
    """SIGTERM (SLURM's preemption, `timeout`, `kill`) saves the state and exits 130, as
    Ctrl-C does; so does SIGINT for a run started in the background by a non-interactive
    shell, which inherits SIGINT ignored (`timeout -s INT` would otherwise not stop it)."""
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sig == "SIGINT-ignored" else None
    proc = subprocess.Popen([sys.executable, "-m", "ats_cli", "train", str(squares), "--out", str(run),
                             "--epochs", "500", "--n-patches", "2", "--patch-size", "16", "--scale", "0.125",
                             "--set", "feature_width=8", "--batch-size", "4", "--workers", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ignore)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() and time.monotonic() < deadline:  # one epoch done: training
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signal.SIGTERM if sig == "SIGTERM" else signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert re.search(r"state saved|are saved to|last state saved", out), out
    assert load_checkpoint(run / "last.pt") is not None


def test_workers_auto_feeds_a_gpu_from_every_cpu_and_none_for_prepared_images_on_a_cpu(monkeypatch):
    """--workers -1 (the default): on CUDA the process's CPUs shared among the node's
    processes, capped; on a CPU device 2 for images read from their files and none for
    prepared ones (the step's own cores are then worth more than a worker); a number
    given is kept, and below -1 is refused."""
    from ats_cli.config import TrainConfig
    from ats_cli.train import AUTO_WORKERS_MAX, loader_workers

    assert TrainConfig().workers == -1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert loader_workers(-1, cuda) == 12 and loader_workers(-1, cpu) == 2
    assert loader_workers(-1, cpu, prepared=True) == 0 and loader_workers(-1, cuda, prepared=True) == 12
    assert loader_workers(0, cuda) == 0 and loader_workers(5, cpu) == 5 and loader_workers(5, cpu, prepared=True) == 5
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert loader_workers(-1, cuda) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert loader_workers(-1, cuda) == AUTO_WORKERS_MAX
    with pytest.raises(ConfigError, match="workers must be >= 0, or -1"):
        resolve_config(None, workers=-2)


def test_best_pt_breaks_a_tie_in_accuracy_by_the_later_epoch():
    """selection_score: accuracy first, then the later epoch, whatever the loss says; the
    validation split when there is one, whatever the test split says."""
    from ats_cli.train import selection_score

    history = [{"epoch": 1, "test_acc": 0.9, "test_loss": 0.33}, {"epoch": 2, "test_acc": 0.875, "test_loss": 0.30},
               {"epoch": 3, "test_acc": 0.9, "test_loss": 0.53}, {"epoch": 4, "test_acc": 0.85, "test_loss": 0.20}]
    assert max(history, key=selection_score)["epoch"] == 3
    history[2]["test_acc"] = 0.875  # control: a higher accuracy wins over a later epoch
    assert max(history, key=selection_score)["epoch"] == 1
    with_val = [dict(h, val_acc=0.8, val_loss=h["epoch"] / 10) for h in history]
    with_val[0]["val_acc"] = 0.85
    assert max(with_val, key=selection_score)["epoch"] == 1
    with_val[0]["val_acc"] = 0.8
    assert max(with_val, key=selection_score)["epoch"] == 4


@pytest.mark.parametrize(("name", "content", "kind"), [
    ("notes.txt", b"my notes\n", "a text file"),
    ("dataset.json", b'{"classes": ["a", "b"]}\n', "a JSON file"),
    ("photo.png", b"\x89PNG\r\n\x1a\n" + bytes(64), "a PNG image"),
    ("empty.pt", b"", "an empty file"),
    ("noise.bin", bytes(range(1, 256)) * 4,
     "a binary file of another kind: torch.save writes a zip archive or a pickle"),
], ids=["text", "json", "png", "empty", "binary"])
def test_a_file_that_is_plainly_not_a_checkpoint_is_named_with_what_it_is(tmp_path, name, content, kind):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    message = str(err.value)
    assert message.startswith(f"{path}: not an ats checkpoint ({kind})"), message
    assert "best.pt" in message and "Python object" not in message and "cannot be read" not in message


def test_a_patch_larger_than_the_images_is_refused_before_anything_is_prepared(tmp_path):
    data = _write_squares_dataset(tmp_path / "data", n_train=4, n_test=2, size=32, box=8)
    prepared = []
    with pytest.raises(ImageReadError) as err:
        train(_cfg(data, tmp_path / "run", patch_size=48), log=prepared.append)
    message = str(err.value)
    assert "smaller than the 48x48 patch (and 5 more" in message and "give --patch-size 32 or less" in message
    assert not any("prepared" in line for line in prepared), prepared
    assert not list(data.rglob("*.npy")) and not (data / ".ats-prepared").exists()


def test_a_numpy_archive_given_as_a_model_is_named_for_what_it_is(tmp_path):
    path = tmp_path / "digits.npz"
    np.savez(path, x_train=np.zeros(3), y_train=np.zeros(3))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(err.value).startswith(f"{path}: not an ats checkpoint (a NumPy .npz archive of x_train.npy, "
                                     "y_train.npy)"), str(err.value)


def test_the_curves_are_drawn_at_the_last_epoch_and_at_most_every_so_often_before(squares, tmp_path,
                                                                                          monkeypatch):
    """curves.png costs more than a small run's epoch: drawn at the last epoch, and before
    it only once PLOT_EVERY_S have passed since the last drawing or the start (here never,
    then always)."""
    import ats_cli.train as train_module

    drawn = []
    monkeypatch.setattr(train_module, "_plot_curves", lambda history, path: drawn.append(len(history)))
    monkeypatch.setattr(train_module, "PLOT_EVERY_S", 1e9)
    train(_cfg(squares, tmp_path / "rare", epochs=4), log=lambda s: None)
    assert drawn == [4]
    drawn.clear()
    monkeypatch.setattr(train_module, "PLOT_EVERY_S", 0.0)
    train(_cfg(squares, tmp_path / "every", epochs=4), log=lambda s: None)
    assert drawn == [1, 2, 3, 4]
