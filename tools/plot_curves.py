#!/usr/bin/env python
"""Draw the test curves of several runs on one figure (docs/img/transfer-curves.png):
each run's ``metrics.jsonl``, its test score per epoch, against the epoch and against the
training time. Deterministic; reads nothing but the runs.

    PYTHONPATH=. python tools/plot_curves.py OUT.png "from scratch=RUN1" "frozen=RUN2" ... \
        [--title TEXT] [--target 0.9]

The score is the macro-F1 where a run records one (multi-label), else the accuracy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ats_cli.io import atomic_path


def read_curve(run: Path) -> tuple[list[int], list[float], list[float], str]:
    """(epochs, scores, cumulative training minutes, score name) of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{run}/metrics.jsonl: no epochs")
    key = "test_macro_f1" if "test_macro_f1" in rows[0] else "test_acc"
    minutes, total = [], 0.0
    for r in rows:
        total += r["samples"] * r["ms_per_sample"] / 60000
        minutes.append(total)
    return [r["epoch"] for r in rows], [r[key] for r in rows], minutes, key


def plot(out: Path, runs: list[tuple[str, Path]], title: str, target: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    names = set()
    for label, run in runs:
        epochs, scores, minutes, key = read_curve(run)
        names.add(key)
        by_epoch.plot(epochs, scores, marker="o", label=label)
        by_time.plot(minutes, scores, marker="o", label=label)
    score = " / ".join(sorted("macro-F1" if n == "test_macro_f1" else "accuracy" for n in names))
    for ax, xlabel in ((by_epoch, "epoch"), (by_time, "training time (min, in steps)")):
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    by_epoch.set_ylabel(f"test {score}")
    by_epoch.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    parser.add_argument("--title", default="")
    parser.add_argument("--target", type=float, default=None, help="a dashed line at this score")
    args = parser.parse_args()
    runs = []
    for item in args.runs:
        label, sep, run = item.partition("=")
        if not sep:
            raise SystemExit(f"{item}: expected LABEL=RUN_DIR")
        runs.append((label, Path(run)))
    plot(args.out, runs, args.title, args.target)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
