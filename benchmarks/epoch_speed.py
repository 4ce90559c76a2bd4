"""A whole CPU training epoch, before and after: one ``ats train`` command run from two
source trees, interleaved (A B A B ...), so that the load of a shared machine falls on both.

    git worktree add /tmp/ats-before 5b31de4                 # the tree to compare against
    PYTHONPATH=. python benchmarks/epoch_speed.py DATA --before /tmp/ats-before \
        [--after .] [--epochs 3] [--rounds 2] [--workers 0 --workers auto] [--json out.json]

Each run is ``python -m ats_cli train DATA --out RUN --epochs N --seed 0 [--workers W]``
with ``PYTHONPATH`` set to the tree. A whole epoch is the time between two consecutive
"epoch k/N:" lines of its output: training steps, batch-norm recalibration, evaluation,
checkpoints and the curves figure, everything the loop does once per epoch. Epoch 1 also
holds what runs once before it (and, after, making the prepared entries if there are none
yet), so the figure is the mean over epochs 2..N; the command's wall time is kept beside it.
The runs' ``metrics.jsonl`` are compared epoch by epoch (train loss, test accuracy), which is
how a change that should not move the result curve is seen not to.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+):")


def run_once(tree: Path, data: Path, out: Path, epochs: int, workers: str) -> dict:
    cmd = [sys.executable, "-m", "ats_cli", "train", str(data), "--out", str(out), "--epochs", str(epochs),
           "--seed", "0"]
    if workers != "auto":
        cmd += ["--workers", workers]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    marks: dict[int, float] = {}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=tempfile.gettempdir()) as proc:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            m = EPOCH_LINE.match(line.strip())
            if m:
                marks[int(m.group(1))] = time.perf_counter()
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} (PYTHONPATH={tree}) failed:\n{''.join(lines[-20:])}")
    epoch_s = [marks[k] - marks[k - 1] for k in range(2, epochs + 1)]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"wall_s": wall, "first_epoch_end_s": marks[1] - start, "epoch_s": epoch_s,
            "samples_per_s": [m["samples_per_s"] for m in metrics],  # the training's alone, not the curve's
            "curve": [{k: m[k] for k in ("epoch", "train_loss", "train_acc", "test_loss", "test_acc", "entropy")}
                      for m in metrics]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path)
    ap.add_argument("--before", type=Path, required=True, help="source tree of the 'before' commit")
    ap.add_argument("--after", type=Path, default=ROOT, help="source tree of the 'after' commit (this one)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="before/after pairs per --workers value")
    ap.add_argument("--workers", action="append", help="--workers of ats train ('auto': not given); repeatable")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.epochs < 2:
        ap.error("--epochs must be >= 2: a whole epoch is measured between two epochs' ends")
    workers = args.workers or ["0", "auto"]
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    results: dict[str, dict[str, list[dict]]] = {w: {"before": [], "after": []} for w in workers}
    with tempfile.TemporaryDirectory() as tmp:
        for w in workers:
            for r in range(args.rounds):
                for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    res = run_once(trees[side], args.data.resolve(), Path(tmp) / f"{side}-{w}-{r}", args.epochs, w)
                    results[w][side].append(res)
                    print(f"workers {w} round {r + 1} {side}: epochs 2..{args.epochs} "
                          f"{', '.join(f'{s:.2f}' for s in res['epoch_s'])} s; wall {res['wall_s']:.1f} s", flush=True)
    summary = {}
    for w, sides in results.items():
        row = {}
        for side, runs in sides.items():
            row[side] = {"epoch_s": statistics.mean(s for run in runs for s in run["epoch_s"]),
                         "wall_s": statistics.mean(run["wall_s"] for run in runs), "curve": runs[0]["curve"],
                         "same_curve_every_run": all(run["curve"] == runs[0]["curve"] for run in runs)}
        row["ratio"] = row["before"]["epoch_s"] / row["after"]["epoch_s"]
        summary[w] = row
        print(f"\n--workers {w}: whole epoch {row['before']['epoch_s']:.2f} s before, {row['after']['epoch_s']:.2f} s "
              f"after: {row['ratio']:.2f}x (wall {row['before']['wall_s']:.1f} / {row['after']['wall_s']:.1f} s)")
        print("epoch | train loss before | after | test acc before | after")
        for b, a in zip(row["before"]["curve"], row["after"]["curve"], strict=True):
            print(f"{b['epoch']} | {b['train_loss']:.6f} | {a['train_loss']:.6f} | {b['test_acc']:.3f} | "
                  f"{a['test_acc']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results,
                                         "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
