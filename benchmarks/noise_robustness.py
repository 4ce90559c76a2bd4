"""How a trained Megapixel MNIST model holds up against each noise family, and without noise.

For every family it generates a fresh test set (paper spec by default: 1500x1500, 5
digits, 50 noise patches; ``ats make-dataset megapixel-mnist`` with ``--noise FAMILY``)
plus a clean set (``--n-noise 0``), predicts each exactly as ``ats predict`` does by
default (the model's patch count and estimator, one sampling, seed 0, one image per
batch) and prints a markdown table: accuracy and its 95% Wilson interval per set.

    python benchmarks/noise_robustness.py --model models/megapixel-mnist-ats.pt \\
        --n 1000 --families all --mnist data/mnist --json robustness.json

Why these choices:

* Only the test split is used. The generator needs at least one training image
  (``--n-train 1``); test images depend only on the seed, the split and their index, so
  that one training image changes nothing that is measured.
* Every set has the same seed, hence the same digits, targets and digit positions
  wherever the placement rule is the same: the rows differ by their noise, not by luck of
  the draw. Use ``--mnist`` with MNIST's own test digits for a model trained on MNIST's
  train digits (the bundled sample digits are all MNIST *training* digits).
* ``--work DIR`` keeps the generated sets; a rerun with the same arguments resumes or
  reuses them instead of rendering again. Without it a temporary folder is used and
  deleted.
* A failed prediction (unreadable file) counts as wrong, and is reported.
* ``--jobs N`` predicts N sets at once, each in a process of its own (the sets are
  generated first, once). On a GPU one process leaves it idle while the next image is
  decoded (benchmarks/gpu.md, "On a GPU"); the figures are the same as with one job,
  since every image is predicted alone with seed 0.

Imports of torch and the library happen inside :func:`run`, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_SEED = 20261125
CLEAN = "clean"


def wilson(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (sound near 0 and 1, unlike p +- 1.96 se)."""
    if n == 0:
        return float("nan"), float("nan")
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: one row per set, in the order measured."""
    lines = ["| noise | images | accuracy | 95% interval |", "|---|---:|---:|---|"]
    for r in rows:
        lo, hi = r["ci95"]
        lines.append(f"| {r['family']} | {r['images']} | {100 * r['accuracy']:.1f}% | "
                     f"{100 * lo:.1f}-{100 * hi:.1f}% |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Model checkpoint (.pt) or run directory.")
    parser.add_argument("--n", type=int, default=1000, help="Test images per set (default 1000).")
    parser.add_argument("--families", default="all",
                        help="Comma-separated noise families, or 'all' (default). The clean set is always added.")
    parser.add_argument("--mnist", type=Path, default=None,
                        help="Digits: MNIST IDX directory or .npz (default: as ats make-dataset finds them).")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"Seed of every set (default {DEFAULT_SEED}).")
    parser.add_argument("--work", type=Path, default=None,
                        help="Keep the generated sets here (reused by a rerun); default: a temporary folder.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the results as JSON here.")
    parser.add_argument("--width", type=int, default=None, help="Canvas width (paper: 1500).")
    parser.add_argument("--height", type=int, default=None, help="Canvas height (paper: 1500).")
    parser.add_argument("--n-noise", type=int, default=None, help="Noise patches per image (paper: 50).")
    parser.add_argument("--workers", type=int, default=None, help="Generator processes (default: CPU count).")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (as ats predict).")
    parser.add_argument("--n-patches", type=int, default=None,
                        help="Patches drawn per image, as ats predict --n-patches (default: the model's own).")
    parser.add_argument("--offline", action="store_true", help="Do not try to download MNIST.")
    parser.add_argument("--jobs", type=int, default=1, help="Sets predicted at once, one process each (default 1).")
    parser.add_argument("--set", default=None, help=argparse.SUPPRESS)  # --jobs' children: this one set only
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.n < 1:
        parser.error("--n must be at least 1")
    if args.n_patches is not None and args.n_patches < 1:
        parser.error("--n-patches must be at least 1")
    return args


def run(argv: list[str] | None = None, log=print) -> dict[str, Any]:
    """Parse ``argv``, measure, print the table; returns what ``--json`` writes."""
    args = parse_args(argv)
    from ats_cli.data.megapixel_mnist import generate_megapixel_mnist, make_config
    from ats_cli.data.mnist import resolve_digits
    from ats_cli.data.noise import FAMILIES, parse_families
    from ats_cli.predict import evaluate, load_predictor, resolve_inputs

    families = list(FAMILIES) if args.families.strip() == "all" else list(parse_families(args.families))
    from ats_cli.checkpoint import CheckpointError

    try:  # first: a wrong --model fails before any rendering, in one line naming the file
        predictor = load_predictor(args.model, args.device)
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    digits = resolve_digits(args.mnist, offline=True if args.offline else None,
                            on_notice=lambda msg: log(f"note: {msg}"))
    spec = {"width": args.width, "height": args.height, "n_noise": args.n_noise}
    work = args.work or Path(tempfile.mkdtemp(prefix="ats-noise-robustness-"))
    patches = args.n_patches or getattr(predictor.model, "patches_now", "?")
    log(f"model {predictor.path} on {predictor.device}, {patches} patches per image; {args.n} test images per set, "
        f"seed {args.seed}; digits: {digits.description}")
    rows = []
    names = [args.set] if args.set else [*families, CLEAN]
    try:
        sets = []
        for family in names:
            noise = {"n_noise": 0} if family == CLEAN else {"noise": family}
            config = make_config("paper", n_train=1, n_val=0, n_test=args.n, seed=args.seed, **{**spec, **noise})
            start = time.perf_counter()
            generate_megapixel_mnist(work / family, config, digits, workers=args.workers)
            sets.append((family, config, time.perf_counter() - start))
        if args.jobs > 1:
            rows = _in_processes(args, sets, work)
        for family, config, generated in sets if args.jobs == 1 else []:
            items = resolve_inputs([work / family / "test.csv"])
            start = time.perf_counter()
            predictions = predictor.predict(items, n_patches=args.n_patches)  # ats predict's defaults unless given
            predicted = time.perf_counter() - start
            evaluation = evaluate(predictions, predictor.classes)
            correct = evaluation.correct if evaluation else 0
            failed = sum(not p.ok for p in predictions)
            rows.append({"family": family, "images": len(items), "correct": correct, "failed": failed,
                         "accuracy": correct / len(items), "ci95": list(wilson(correct, len(items))),
                         "generate_s": round(generated, 1), "predict_s": round(predicted, 1),
                         "config": config.params()})
        for row in rows:
            log(f"{row['family']}: {row['correct']}/{row['images']} = {100 * row['accuracy']:.1f}% "
                f"(generated in {row['generate_s']:.0f} s, predicted in {row['predict_s']:.0f} s"
                + (f"; {row['failed']} FAILED, counted wrong" if row["failed"] else "") + ")")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    log("")
    log(table(rows))
    result = {"model": str(predictor.path), "device": str(predictor.device), "n": args.n, "seed": args.seed,
              "digits": digits.description, "digits_sha256": digits.sha256(), "rows": rows,
              "n_patches": args.n_patches,
              "predict": "ats predict defaults: the model's n_patches (unless n_patches) and estimator, samples 1, "
                         "seed 0, batch 1"}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def _in_processes(args: argparse.Namespace, sets: list, work: Path) -> list[dict[str, Any]]:
    """Each generated set predicted by a child run of this script (``--set NAME``, the same
    model, sets and prediction options), ``args.jobs`` at a time; their rows in the sets'
    order, each with the generation time measured here."""
    import subprocess

    common = [sys.executable, str(Path(__file__).resolve()), "--model", str(args.model), "--n", str(args.n),
              "--seed", str(args.seed), "--device", args.device, "--work", str(work), "--workers", "1"]
    for flag, value in (("--width", args.width), ("--height", args.height), ("--n-noise", args.n_noise),
                        ("--n-patches", args.n_patches), ("--mnist", args.mnist)):
        common += [flag, str(value)] if value is not None else []
    common += ["--offline"] if args.offline else []
    # one torch thread per core between the children: a full pool each would oversubscribe
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.jobs))}
    # this run's own folder for the children's rows: two runs sharing --work (another model on
    # the same sets) once read each other's rows from a shared one
    work.mkdir(parents=True, exist_ok=True)
    parts = Path(tempfile.mkdtemp(prefix="_rows-", dir=work))
    queue, running, failed = [family for family, _, _ in sets], [], []
    while queue or running:
        while queue and len(running) < args.jobs:
            family = queue.pop(0)
            cmd = [*common, "--set", family, "--json", str(parts / f"{family}.json")]
            running.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env), family))
        time.sleep(0.2)
        for proc, family in [r for r in running if r[0].poll() is not None]:
            running.remove((proc, family))
            if proc.returncode:
                failed.append(f"{family} (exit {proc.returncode})")
    if failed:
        raise SystemExit(f"error: predicting these sets failed: {', '.join(failed)}")
    rows = [{**json.loads((parts / f"{family}.json").read_text())["rows"][0], "generate_s": round(generated, 1)}
            for family, _, generated in sets]
    shutil.rmtree(parts, ignore_errors=True)
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
    run()
