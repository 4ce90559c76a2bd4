"""Benchmark: `ats train` epochs on synthetic slides of 3k, 20k and 50k pixels a side.

For each size: writes ``--unique`` synthetic slides (ats_cli.data.synthetic_slides, in
bands) in a fresh process each, recording the time and peak RSS of writing one; makes a
dataset of ``--n`` training slides (hard links cycling over the unique ones: the same
bytes read under other names, so the view cache treats them as different slides) and one
test slide (a link to the first); then runs ``python -m ats_cli train`` twice in a fresh
process each, with a tiny model, ``--workers 2``, and the auto settings given explicitly
(so that no training image is read before epoch 1):

* cached (the default): epoch 1 makes every low-res view and tissue mask and stores them
  under RUN/cache/views (cold), epoch 2 reads them back (warm);
* uncached (``ATS_VIEW_CACHE=off``): one epoch, every view made from the file;
* same view (cached, 2 epochs, warm epoch reported): ``--scale 96/side``, the low-res view
  of a 3072-pixel slide at 1/32 (96x96), whatever the side: what an epoch costs when the
  attention network's input does not grow with the slide.

Epoch time is the training loop's (metrics.jsonl: samples / samples_per_s), without the
test evaluation; peak RSS is the largest of the training process and its DataLoader
workers (``resource.getrusage(RUSAGE_CHILDREN)`` of a wrapper process, as benchmarks/slides.py).

Usage: python benchmarks/slide_training.py --sizes 3072 20000 50000 --out /tmp/slidetrain
Prints a Markdown table; copy it into benchmarks/slides.md with the machine and `uptime`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's ats_cli, not an installed one
sys.path.insert(0, str(ROOT / "benchmarks"))
from slides import measure  # noqa: E402  (benchmarks/slides.py: wall time and peak RSS of a fresh process)

TRAIN = ["--epochs", "{epochs}", "--batch-size", "4", "--n-patches", "12", "--patch-size", "64", "--scale", "0.03125",
         "--feature-net", "small-cnn", "--set", "feature_width=8", "--set", "attention_width=4", "--workers", "2",
         "--device", "cpu", "--augment", "colour+flips", "--set", "rarity_prior=2", "--set", "min_brightness=0"]


def write_slide(path: Path, size: int, index: int) -> tuple[float, float]:
    code = ("from ats_cli.data import synthetic_slides as ss;"
            f"c=ss.SyntheticSlidesConfig(size={size}).validate();"
            f"layout,bands=ss.render_slide_bands(c,'train',{index});"
            f"ss.write_pyramid_bands({str(path)!r},bands,({size},{size}),mpp=c.mpp)")
    return measure(["-c", code])


def make_dataset(folder: Path, size: int, n: int, unique: int) -> list[tuple[float, float]]:
    """The dataset; returns (seconds, peak RSS MB) of writing each distinct slide (kept in
    ``write_costs.json``, so a rerun that finds the slides reports what writing them took)."""
    from ats_cli.data.synthetic_slides import CLASSES, RECIPE, SyntheticSlidesConfig

    (folder / "train").mkdir(parents=True, exist_ok=True)
    (folder / "test").mkdir(exist_ok=True)
    record = folder / "write_costs.json"
    costs = json.loads(record.read_text()) if record.exists() else []
    for u in range(unique):
        slide = folder / f"slide_{u}.tif"
        if not slide.exists():
            costs.append(write_slide(slide, size, u))
            record.write_text(json.dumps(costs))
    rows = ["path,label"]
    for i in range(n):
        link = folder / "train" / f"{i:04d}.tif"
        if not link.exists():
            os.link(folder / f"slide_{i % unique}.tif", link)
        rows.append(f"train/{i:04d}.tif,{CLASSES[i % unique % 2]}")
    (folder / "train.csv").write_text("\n".join(rows) + "\n")
    if not (folder / "test" / "0000.tif").exists():
        os.link(folder / "slide_0.tif", folder / "test" / "0000.tif")
    (folder / "test.csv").write_text(f"path,label\ntest/0000.tif,{CLASSES[0]}\n")
    hints = SyntheticSlidesConfig(size=size).hints()
    (folder / "dataset.json").write_text(json.dumps({"format": "ats-dataset", "version": 1, "classes": CLASSES,
                                                     "splits": ["train", "test"], "hints": hints,
                                                     "recipe": RECIPE}))
    return costs


def train(data: Path, run: Path, epochs: int, cache: bool, scale: float = 1 / 32) -> tuple[list[float], float, float]:
    shutil.rmtree(run, ignore_errors=True)
    flags = [a.format(epochs=epochs) for a in TRAIN]
    flags[flags.index("--scale") + 1] = repr(scale)
    args = ["-m", "ats_cli", "train", str(data), "--out", str(run), *flags]
    old = os.environ.get("ATS_VIEW_CACHE")
    os.environ["ATS_VIEW_CACHE"] = "" if cache else "off"
    try:
        wall, rss = measure(args)
    finally:
        if old is None:
            os.environ.pop("ATS_VIEW_CACHE")
        else:
            os.environ["ATS_VIEW_CACHE"] = old
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["samples"] / r["samples_per_s"] for r in records], wall, rss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[3072, 20_000, 50_000])
    ap.add_argument("--n", type=int, default=8, help="training slides per size")
    ap.add_argument("--unique", type=int, nargs="+", default=[8, 2, 1],
                    help="distinct slides written per size (the rest are hard links); one value per size")
    ap.add_argument("--out", type=Path, default=Path("/tmp/slidetrain"))
    a = ap.parse_args()
    uniques = (a.unique + a.unique[-1:] * len(a.sizes))[:len(a.sizes)]
    print("| side | slides (distinct) | file MB | write 1 slide s | write peak RSS MB | epoch uncached s | "
          "epoch 1 cached (cold) s | epoch 2 cached (warm) s | train peak RSS MB | warm epoch, 96x96 view s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size, unique in zip(a.sizes, uniques, strict=True):
        data = a.out / f"data_{size}"
        costs = make_dataset(data, size, a.n, unique)
        write_s = sum(c[0] for c in costs) / len(costs) if costs else float("nan")
        write_rss = max((c[1] for c in costs), default=float("nan"))
        plain, _, _ = train(data, a.out / f"run_{size}_off", 1, cache=False)
        cached, _, rss = train(data, a.out / f"run_{size}", 2, cache=True)
        same_view, _, _ = train(data, a.out / f"run_{size}_96", 2, cache=True, scale=96 / size)
        mb = (data / "slide_0.tif").stat().st_size / 2**20
        print(f"| {size:,} | {a.n} ({unique}) | {mb:,.0f} | {write_s:.0f} | {write_rss:,.0f} | {plain[0]:.1f} | "
              f"{cached[0]:.1f} | {cached[1]:.1f} | {rss:,.0f} | {same_view[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
