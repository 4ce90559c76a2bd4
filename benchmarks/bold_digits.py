"""Does a Megapixel MNIST model count digits, or bright pixels? The bold-minority check.

The label is the majority digit (3 of 5 digits are the target class). The attention
estimator pools patch features weighted by where the attention looked, so a model could
be swayed by a digit that simply occupies more cells: a bold digit is covered by several
overlapping patches, a thin one by one. This script renders the same test layouts twice
-- as generated, and with the two non-target digits made bold (grey-level dilation by a
``(2k+1) x (2k+1)`` square, ``k = --bold``; strokes ~2k px thicker) -- and predicts both
with ``ats predict``'s defaults. A model that weighs each digit alike scores the same on
both; one that weighs ink loses accuracy on the bold set and predicts the bold class.

    python benchmarks/bold_digits.py --model models/megapixel-mnist-ats.pt --n 1000 \\
        --mnist data/mnist --work /tmp/bold --examples 3

Prints a markdown table (accuracy with its 95% Wilson interval, and how often the
prediction is the bold class) and, with ``--examples K``, writes ``ats visualize``
figures of the first K bold images to ``WORK/figures`` to look at.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # noise_robustness, beside this file
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's ats_cli

from noise_robustness import DEFAULT_SEED, wilson  # noqa: E402


def dilate(image, k: int):
    """Grey-level dilation of a uint8 [h, w] by a (2k+1)^2 square (max over the shifts)."""
    import numpy as np

    out = image.copy()
    padded = np.pad(image, k)
    h, w = image.shape
    for dr in range(2 * k + 1):
        for dc in range(2 * k + 1):
            np.maximum(out, padded[dr:dr + h, dc:dc + w], out=out)
    return out


def write_set(out: Path, config, digits, bold: int) -> list[dict[str, str]]:
    """Render the test split of ``config`` into ``out`` (PNG + test.csv); with ``bold`` > 0
    the non-target digits of each image are dilated. Rows carry ``bold_class``."""
    from ats_cli.data.dataset import write_dataset
    from ats_cli.data.megapixel_mnist import _render, encode_png, image_layout
    from ats_cli.io import atomic_write_bytes

    images = digits.x_test
    rows = []
    (out / "test").mkdir(parents=True, exist_ok=True)
    for i in range(config.n_test):
        layout = image_layout(config, digits, "test", i)
        pool = images
        others = [int(idx) for idx, cls in zip(layout.digit_index, layout.digit_classes, strict=True)
                  if cls != layout.target]
        if bold:
            pool = images.copy()
            for idx in others:
                pool[idx] = dilate(images[idx], bold)
        name = f"test/{i:05d}.png"
        atomic_write_bytes(out / name, encode_png(_render(layout, pool, config)))
        other_classes = sorted({int(c) for c in layout.digit_classes if c != layout.target})
        rows.append({**layout.row(name), "bold_class": ";".join(map(str, other_classes))})
    write_dataset(out, [str(c) for c in range(10)], {"test": rows, "train": rows[:1]})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--bold", type=int, default=2, help="Dilation radius k in pixels (default 2).")
    parser.add_argument("--noise", default="reference", help="Noise family of both sets (default reference).")
    parser.add_argument("--mnist", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--examples", type=int, default=0, help="ats visualize figures of this many bold images.")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from ats_cli.checkpoint import CheckpointError
    from ats_cli.data.megapixel_mnist import make_config
    from ats_cli.data.mnist import resolve_digits
    from ats_cli.io import atomic_write_text
    from ats_cli.predict import evaluate, load_predictor, resolve_inputs

    try:  # a wrong --model fails before any rendering, in one line naming the file
        predictor = load_predictor(args.model, "auto")
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    digits = resolve_digits(args.mnist, offline=True)
    config = make_config("paper", n_train=1, n_val=0, n_test=args.n, seed=args.seed, noise=args.noise)
    result = {"model": str(predictor.path), "n": args.n, "bold": args.bold, "noise": args.noise,
              "seed": args.seed, "digits": digits.description, "rows": []}
    print(f"model {predictor.path}; {args.n} images per set, {args.noise} noise, seed {args.seed}, "
          f"bold = dilation radius {args.bold}")
    lines = ["| set | images | accuracy | 95% CI | predicted a bold digit's class |", "|---|---|---|---|---|"]
    for name, bold in (("as generated", 0), (f"2 non-target digits bold (k={args.bold})", args.bold)):
        out = args.work / ("bold" if bold else "plain")
        start = time.perf_counter()
        rows = write_set(out, config, digits, bold)
        preds = predictor.predict(resolve_inputs([out / "test.csv"]))
        ev = evaluate(preds, predictor.classes)
        correct = ev.correct if ev else 0
        to_bold = sum(p.ok and p.prediction in r["bold_class"].split(";") for p, r in zip(preds, rows, strict=True))
        lo, hi = wilson(correct, len(rows))
        lines.append(f"| {name} | {len(rows)} | {100 * correct / len(rows):.1f}% | {100 * lo:.1f}-{100 * hi:.1f}% | "
                     f"{100 * to_bold / len(rows):.1f}% |")
        result["rows"].append({"set": name, "bold": bold, "images": len(rows), "correct": correct,
                               "to_bold_class": to_bold, "seconds": round(time.perf_counter() - start, 1)})
        print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))
    for i in range(args.examples):
        fig = args.work / "figures" / f"bold-{i:05d}.png"
        fig.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "ats_cli", "visualize", str(args.work / "bold" / f"test/{i:05d}.png"),
                        "--model", str(args.model), "--out", str(fig)], check=True)
        print(f"figure: {fig}")
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
