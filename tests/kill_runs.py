"""``kill -9`` of ``ats train`` and ``ats predict`` at random moments, each followed by a
rerun that must finish with the same result as an uninterrupted run (issue #67).

The preparation's loop is tests/kill_prepare.py; this is the same for the two commands a
user most often loses to a killed job (an out-of-memory kill, a pre-empted node). Used by
tests/test_kill_runs.py with a few kills; the full loops:

    PYTHONPATH=. python tests/kill_runs.py train   [KILLS] [SEED]   # default 20 kills
    PYTHONPATH=. python tests/kill_runs.py predict [KILLS] [SEED]

Training: each iteration starts ``ats train DATA --out RUN`` on a tiny dataset, kills it,
then reruns it the way a user would: ``--resume RUN`` when RUN holds a full state (last.pt,
or best.pt alone), else the same command, and that with ``--overwrite`` if it is refused
(train refuses a RUN that holds a run: docs/runs-and-inputs.md). The
result is the model, optimizer-free: RUN/last.pt's weights, bit for bit on the CPU, and
RUN/metrics.jsonl without its timing fields.

Prediction: each iteration starts ``ats predict IMAGES --model M --out preds.csv``, kills
it, then reruns the same command, which resumes from the part files
(docs/predict-visualize.md); the result is preds.csv, byte for byte.

It prints one line per kill (when it came, what the killed run had left, what the rerun
did) and exits non-zero on the first failure: a rerun that hangs (a lock of the killed
run), is refused, or ends with another result than the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
import kill_prepare  # noqa: E402

ATS = kill_prepare.ATS
FINISH_S = 120  # a rerun after a kill must finish within this (an uninterrupted run takes a few seconds)
# Tiny nets on 64x64 images, 3 epochs: a run of a few seconds, most of it starting Python.
TRAIN = ["--epochs", "3", "--n-patches", "2", "--patch-size", "8", "--set", "feature_width=8",
         "--set", "attention_width=4", "--workers", "0", "--scale", "0.25", "--seed", "0"]
# When a line was measured, not what was learnt: these differ between any two runs.
TIMING = ("samples_per_s", "ms_per_sample", "peak_mem_mb", "seconds", "time", "wall_s", "elapsed_s")


def env() -> dict:
    out = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "CUDA_VISIBLE_DEVICES": ""}
    out.pop("ATS_PREPARED", None)
    return out


def make_images(root: Path, n: int = 30, size: int = 96) -> Path:
    """``n`` grey noise PNGs to predict."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (size, size), dtype=np.uint8)).save(root / f"{i:02d}.png")
    return root


def train_result(run: Path) -> tuple[dict, list[dict]]:
    """What a finished run learnt: last.pt's model weights and the metrics lines without timing."""
    import torch

    state = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return state["model"], [{k: v for k, v in x.items() if k not in TIMING} for x in lines]


def same_weights(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train(data: Path, run: Path, extra: list[str], timeout: float = FINISH_S) -> subprocess.CompletedProcess:
    if extra[:1] == ["--resume"]:
        cmd = [*ATS, "train", *extra]
    else:
        cmd = [*ATS, "train", str(data), "--out", str(run), *TRAIN, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout)


# Several samplings per image: the predicting itself lasts about a second, so that kills land between rows.
PREDICT = ["--samples", "8", "--seed", "0"]


def predict_cmd(images: Path, model: Path, out: Path) -> list[str]:
    return [*ATS, "predict", str(images), "--model", str(model), "--out", str(out), *PREDICT]


def predict(images: Path, model: Path, out: Path, timeout: float = FINISH_S) -> subprocess.CompletedProcess:
    return subprocess.run(predict_cmd(images, model, out), capture_output=True, text=True, env=env(), timeout=timeout)


def _predicted(text: str) -> int:
    """How many inputs a finished ``ats predict`` predicted itself (the others were done already)."""
    found = re.search(r"^(\d+) images? in ", text, re.M)
    return int(found.group(1)) if found else 0


def _kill(proc: subprocess.Popen) -> list[int]:
    """SIGKILL ``proc``; its children (if any) must end with it. Returns the ones that did not."""
    kids = kill_prepare.children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while any(map(kill_prepare.alive, kids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    orphans = [pid for pid in kids if kill_prepare.alive(pid)]
    for pid in orphans:  # ours: never left running, whatever the verdict
        os.kill(pid, signal.SIGKILL)
    return orphans


def _wait_for(proc: subprocess.Popen, ready, limit: float = FINISH_S) -> float:
    """Wait until ``ready()`` (or ``proc`` ended); the seconds waited."""
    t0 = time.monotonic()
    while not ready() and proc.poll() is None and time.monotonic() - t0 < limit:
        time.sleep(0.01)
    return time.monotonic() - t0


def _last(done: subprocess.CompletedProcess) -> str:
    lines = [x for x in (done.stdout or done.stderr).strip().splitlines() if x.strip()]
    return lines[-1].strip()[:150] if lines else ""


def reference_run(root: Path) -> tuple[Path, Path, float, float, float]:
    """The tiny dataset and an uninterrupted training run on it (made once per ``root``, then
    reused): its data, run directory, seconds in all, seconds to its first epoch's checkpoint
    and seconds from there to its last epoch's."""
    data, ref, timing = root / "data", root / "reference", root / "reference.json"
    if timing.exists():
        t = json.loads(timing.read_text())
        return data, ref, t["whole"], t["first"], t["epochs"]
    shutil.rmtree(data, ignore_errors=True)
    shutil.rmtree(ref, ignore_errors=True)
    kill_prepare.make_dataset(data, n=16, size=64)
    start = time.monotonic()
    proc = subprocess.Popen([*ATS, "train", str(data), "--out", str(ref), *TRAIN],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
    first = _wait_for(proc, lambda: (ref / "epochs" / "epoch_001.pt").exists())  # the first epoch's checkpoint
    epochs = _wait_for(proc, lambda: (ref / "epochs" / "epoch_003.pt").exists())  # from there to the last one
    out = proc.communicate(timeout=FINISH_S)[0]
    whole = time.monotonic() - start
    assert proc.returncode == 0, out
    timing.write_text(json.dumps({"whole": whole, "first": first, "epochs": epochs}))
    return data, ref, whole, first, epochs


def train_loop(root: Path, kills: int, seed: int = 0, say=print) -> list[dict]:
    """Kill ``ats train`` ``kills`` times at random moments, each followed by the rerun a user
    would give; raises AssertionError on the first failure."""
    data, ref, whole, first, epochs = reference_run(root)
    weights, metrics = train_result(ref)
    assert [m["epoch"] for m in metrics] == [1, 2, 3], metrics
    rng = random.Random(seed)
    results = []
    for k in range(kills):
        run = root / f"run{k}" / "run"
        run.parent.mkdir(parents=True)
        proc = subprocess.Popen([*ATS, "train", str(data), "--out", str(run), *TRAIN],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
        t0 = time.monotonic()
        if k % 2 == 0:  # any moment: starting, settling, locking, training, saving, plotting
            time.sleep(rng.uniform(0.0, whole))
        else:  # a moment between the first epoch's checkpoint and the last's: resuming is what is tested
            _wait_for(proc, lambda run=run: (run / "epochs" / "epoch_001.pt").exists())
            time.sleep(rng.uniform(0.0, epochs))
        at = time.monotonic() - t0
        finished = proc.poll() is not None
        orphans = _kill(proc)
        assert not orphans, f"kill {k + 1}: processes {orphans} outlived their killed parent"
        left = sorted(p.name for p in run.iterdir()) if run.is_dir() else []
        epochs_left = len(list((run / "epochs").glob("*.pt"))) if (run / "epochs").is_dir() else 0
        # What a user reruns: --resume when there is a full state (last.pt, or best.pt alone: an
        # epoch's end writes it first), else the same command, and --overwrite when that is refused.
        refused = ""
        try:
            if (run / "last.pt").exists() or (run / "best.pt").exists():
                how = ["--resume", str(run)]
                after = train(data, run, how)
            else:
                how = []
                after = train(data, run, how)
                if after.returncode != 0 and "already holds a run" in after.stderr:
                    refused = _last(after)
                    how = ["--overwrite"]
                    after = train(data, run, how)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"kill {k + 1} at {at:.2f} s: `ats train {' '.join(how)}` did not finish "
                                 f"in {FINISH_S} s") from None
        result = {"kill": k + 1, "at_s": round(at, 2), "had_finished": finished, "left": left,
                  "epochs_left": epochs_left, "rerun": " ".join(how[:1]) or "same command",
                  "refused_first": refused, "rc": after.returncode, "next": _last(after)}
        if after.returncode != 0:
            say(json.dumps(result))
            raise AssertionError(f"kill {k + 1} at {at:.2f} s: the rerun failed:\n{after.stdout}{after.stderr}")
        w, m = train_result(run)
        result["same_weights"] = same_weights(w, weights)
        result["same_metrics"] = m == metrics
        say(json.dumps(result))
        assert result["same_weights"] and result["same_metrics"], (
            f"kill {k + 1} at {at:.2f} s: the run differs from the uninterrupted one "
            f"(weights {'same' if result['same_weights'] else 'differ'}, metrics "
            f"{'same' if result['same_metrics'] else 'differ: ' + json.dumps(m) + ' vs ' + json.dumps(metrics)})")
        results.append(result)
        shutil.rmtree(run.parent)
    return results


def predict_model(root: Path) -> Path:
    """The model the predict loop runs (made once per ``root``): the training loop's
    architecture, untrained and written in this process. What is compared is two runs' CSVs,
    not their accuracy, and an ``ats train`` run for it would cost a process start-up and
    three epochs (twice in the suite when pytest-xdist runs the two loops apart)."""
    import torch

    from ats_cli.checkpoint import save_checkpoint
    from ats_cli.config import TrainConfig
    from ats_cli.models import create_model, model_spec

    path = root / "model.pt"
    if not path.exists():
        torch.manual_seed(0)
        cfg = TrainConfig(n_patches=2, patch_size=8, feature_width=8, attention_width=4, scale=0.25)
        spec = model_spec(cfg, n_classes=2, channels=1)
        save_checkpoint(path, spec=spec, classes=["a", "b"], model=create_model(spec))
    return path


def predict_loop(root: Path, kills: int, seed: int = 0, say=print) -> list[dict]:
    """Kill ``ats predict --out`` ``kills`` times at random moments, each followed by the same
    command; raises AssertionError on the first failure."""
    model = predict_model(root)
    images = make_images(root / "images")
    start = time.monotonic()
    done = predict(images, model, root / "reference.csv")
    whole = time.monotonic() - start
    assert done.returncode == 0, done.stdout + done.stderr
    reference = (root / "reference.csv").read_bytes()
    assert reference.count(b"\n") == 31, reference
    work = float(re.search(r"images in ([\d.]+) s", done.stdout).group(1))  # predicting, after starting up
    rng = random.Random(seed)
    results = []
    for k in range(kills):
        out = root / f"p{k}" / "preds.csv"
        out.parent.mkdir(parents=True)
        parts = lambda out=out: sorted(out.parent.glob("preds.csv.part-*"))  # noqa: E731
        proc = subprocess.Popen(predict_cmd(images, model, out), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env())
        t0 = time.monotonic()
        if k % 2 == 0:  # any moment of the run
            time.sleep(rng.uniform(0.0, whole))
        else:  # a moment while it appends rows to its part file
            _wait_for(proc, lambda parts=parts: any(p.stat().st_size > 0 for p in parts()))
            time.sleep(rng.uniform(0.0, work))
        at = time.monotonic() - t0
        finished = proc.poll() is not None
        orphans = _kill(proc)
        assert not orphans, f"kill {k + 1}: processes {orphans} outlived their killed parent"
        rows_left = sum(max(p.read_bytes().count(b"\n") - 1, 0) for p in parts())
        left = sorted(p.name for p in out.parent.iterdir())
        try:
            after = predict(images, model, out)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"kill {k + 1} at {at:.2f} s: the rerun did not finish in {FINISH_S} s") from None
        text = after.stdout + after.stderr
        result = {"kill": k + 1, "at_s": round(at, 2), "had_finished": finished, "left": left,
                  "rows_in_parts": rows_left, "predicted_on_rerun": _predicted(text),
                  "took_over_lock": "took over its lock" in text, "rc": after.returncode,
                  "next": _last(after)}
        if after.returncode != 0:
            say(json.dumps(result))
            raise AssertionError(f"kill {k + 1} at {at:.2f} s: the rerun failed:\n{text}")
        result["same_csv"] = out.read_bytes() == reference
        result["left_after"] = sorted(p.name for p in out.parent.iterdir() if p.name != "preds.csv")
        say(json.dumps(result))
        assert result["same_csv"], f"kill {k + 1} at {at:.2f} s: preds.csv differs from the uninterrupted one"
        results.append(result)
        shutil.rmtree(out.parent)
    return results


if __name__ == "__main__":
    import tempfile

    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what not in ("train", "predict"):
        sys.exit("usage: python tests/kill_runs.py train|predict [KILLS] [SEED]")
    kills = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        results = (train_loop if what == "train" else predict_loop)(Path(tmp), kills, seed)
        print(f"{len(results)} kills of ats {what}, each followed by a rerun that finished with the same "
              f"result as the uninterrupted run ({sum(not r['had_finished'] for r in results)} killed while "
              f"running) in {time.monotonic() - t0:.0f} s")
