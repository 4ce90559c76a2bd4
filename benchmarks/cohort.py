"""Benchmark: `ats predict DIR --out FILE` on a folder of slides, in slides/minute, with and
without prefetch (--no-prefetch) and with --devices 1 and 2.

Writes one N x N pyramidal TIFF and the untrained model of benchmarks/slides.py (its
timing does not depend on the weights), hard-links the slide COUNT times into a folder
(distinct files to ats; the reads come from the page cache after the first round, as on a
machine whose slides are cached or on fast local disk), then runs every configuration
ROUNDS times, interleaved, each in a fresh process with --overwrite. Reports ats's own
"N slides in T s: X slides/minute" line (T: from the first slide to the merged CSV, no
start-up) and the wall time of the whole command (start-up and, for --devices 2, torchrun's
included).

``--latency-ms L`` adds an in-process comparison of prefetch on/off in which opening a slide
first waits L ms (``time.sleep``, standing for the open and thumbnail read of slow or
network storage, which waits without using the CPU), ms per slide over ROUNDS passes.

Usage: python benchmarks/cohort.py --size 10000 --count 16 --rounds 2 --out /tmp/cohortbench [--latency-ms 100]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from slides import make_model, write_slide  # noqa: E402

CONFIGS = [("1", "--prefetch"), ("1", "--no-prefetch"), ("2", "--prefetch"), ("2", "--no-prefetch")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/cohortbench"))
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--skip-cli", action="store_true", help="only the --latency-ms comparison")
    a = ap.parse_args()
    folder = a.out / "slides"
    folder.mkdir(parents=True, exist_ok=True)
    model, slide = a.out / "model.pt", a.out / f"slide_{a.size}.tif"
    make_model(model)
    if not slide.exists():
        write_slide(slide, a.size)
    for i in range(a.count):
        link = folder / f"s{i:03d}.tif"
        if not link.exists():
            os.link(slide, link)
    if a.latency_ms:
        latency(model, folder, a.latency_ms, a.rounds)
    if a.skip_cli:
        return
    print("| --devices | prefetch | round | slides/minute (ats) | T s (ats) | wall s (command) | load |")
    print("|---|---|---|---|---|---|---|")
    for r in range(a.rounds):
        for devices, prefetch in CONFIGS:
            cmd = [sys.executable, "-m", "ats_cli", "predict", str(folder), "-m", str(model), "--out",
                   str(a.out / "preds.csv"), "--overwrite", "--device", "cpu", "--devices", devices, prefetch]
            t = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            wall = time.perf_counter() - t
            found = re.search(r"(\d+) slides in ([\d.]+) s: ([\d.]+) slides/minute", done.stdout)
            assert done.returncode == 0 and found, done.stdout + done.stderr
            print(f"| {devices} | {prefetch[2:]} | {r + 1} | {float(found[3]):.1f} | {float(found[2]):.1f} | "
                  f"{wall:.1f} | {os.getloadavg()[0]:.2f} |", flush=True)


def latency(model: Path, folder: Path, ms: float, rounds: int) -> None:
    sys.path.insert(0, str(ROOT))
    from ats_cli.predict import load_predictor, resolve_inputs

    predictor = load_predictor(model, "cpu")
    items = resolve_inputs([folder])
    opener = predictor.opener()

    def slow_open(path, **kw):
        time.sleep(ms / 1000)
        return opener(path, **kw)

    print(f"| open latency ms | prefetch | round | ms per slide (in process, {len(items)} slides) |")
    print("|---|---|---|---|")
    for r in range(rounds):
        for prefetch in (True, False):
            t = time.perf_counter()
            predictor.predict(items, reader=slow_open, prefetch=prefetch)
            per = 1000 * (time.perf_counter() - t) / len(items)
            print(f"| {ms:.0f} | {'on' if prefetch else 'off'} | {r + 1} | {per:.0f} |", flush=True)


if __name__ == "__main__":
    main()
