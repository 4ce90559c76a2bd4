"""Plot test error per epoch of one or more consecutive training stages (docs/training.md).

    python tools/plot_training_curve.py OUT.png LABEL=RUN_DIR/metrics.jsonl [LABEL=...] [--reference]
        [--title TEXT] [--target ACCURACY_PERCENT]

Stages are drawn one after the other on a shared epoch axis (a curriculum: stage 2
starts from stage 1's weights with ``ats train --init``). ``--reference`` marks the 2019
reference's Megapixel MNIST plateau (test error near 90% until epoch ~210 in the curve
published with the 2019 repository idiap/attention-sampling, docs/examples.md);
``--target 95`` draws the accuracy a released model is asked to reach.
The per-epoch table (markdown, for a model card) is printed to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="PNG to write")
    parser.add_argument("stages", nargs="+", metavar="LABEL=METRICS_JSONL", help="one per stage, in training order")
    parser.add_argument("--reference", action="store_true", help="mark the 2019 reference's plateau")
    parser.add_argument("--title", default="Megapixel MNIST, attention sampling (10 patches of 50x50), 2-core CPU")
    parser.add_argument("--target", type=float, default=None, help="accuracy (percent) a release is asked for")
    opts = parser.parse_args(argv)
    bad = [s for s in opts.stages if "=" not in s]
    if bad:
        parser.error(f"stages are LABEL=METRICS_JSONL, got {bad[0]!r}")
    reference, title, target, out = opts.reference, opts.title, opts.target, opts.out
    stages = []
    for label, path in (s.split("=", 1) for s in opts.stages):
        try:
            lines = Path(path).read_text().splitlines()
            rows = [json.loads(line) for line in lines if line.strip()]
        except (OSError, json.JSONDecodeError) as e:
            parser.error(f"{path}: cannot read metrics ({e})")
        if not rows:
            parser.error(f"{path}: no epochs in it")
        stages.append((label, rows))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    # tab10 repeats its colours after 10 stages; more stages continue with dark ones that
    # cannot be mistaken for the first ten
    colors = list(plt.get_cmap("tab10").colors) + ["black", "saddlebrown", "darkslateblue", "olive", "teal"]
    start = 0
    table = ["| stage | epoch | train acc | test acc | attention entropy (nats) | samples/s | training s |",
             "|---|---|---|---|---|---|---|"]
    for i, (label, rows) in enumerate(stages):
        table += [f"| {label} | {r['epoch']} | {100 * r['train_acc']:.1f}% | {100 * r['test_acc']:.1f}% | "
                  f"{r['entropy']:.2f} | {r['samples_per_s']:.0f} | {r['samples'] / r['samples_per_s']:.0f} |"
                  for r in rows]
        epochs = [start + r["epoch"] for r in rows]
        color = colors[i % len(colors)]
        ax.plot(epochs, [100 * (1 - r["test_acc"]) for r in rows], "o-", ms=3, label=label, color=color)
        ax.plot(epochs, [100 * (1 - r["train_acc"]) for r in rows], ":", color=color)
        if start:
            ax.axvline(start + 0.5, color="grey", lw=0.8)
        start = epochs[-1]
    if reference:
        ax.axhline(90, color="red", ls="--", lw=1, label="2019 reference: ~90% until epoch ~210")
    if target is not None:
        ax.axhline(100 - target, color="green", ls="--", lw=1, label=f"target: {target:g}% accuracy")
    ax.plot([], [], "k-", label="test error (solid), train error (dotted)")
    ax.set_xlabel("epoch (stages one after the other)")
    ax.set_ylabel("error (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")
    print("\n".join(table))


if __name__ == "__main__":
    main(sys.argv[1:])
