"""Where a trained two-level model looks, and what it makes of what it sees, on slides with
nests: the figures benchmarks/slides.md "Accuracy at 100k²" reads from each run's epoch
checkpoints, to say why a run learned or stayed at chance.

    python benchmarks/nested_attention.py DATA RUN/epochs/epoch_001.pt [more checkpoints]
        [--slides 10] [--split train] [--seed 0]

DATA: an ``ats make-dataset synthetic-slides`` set (``boxes`` in its CSV: the nests). Per
checkpoint, on the first ``--slides`` tumour and normal slides of ``--split``:

- coarse mass on nests: the mean share of the coarse attention on the regions holding a
  nest, the weight nests get in the estimate on average;
- nest in top k: the share of tumour slides where a nest's region is among the ``regions``
  likeliest (the training draw's k);
- fine mass on nest: the mean share of a drawn nest region's fine attention on the nest's
  cells, over the nest regions one evaluation pass (seed ``--seed``) draws;
- logit on nests / on normal: the classifier's tumour-minus-normal logit on a patch
  centred on each nest, and on the four patches of largest estimator weight in each normal
  slide (what a nest must stand out from);
- gain on nests / on normal: the learned patch gain on the same patches (1 without one).

Reads checkpoints with the public predictor (:func:`ats_cli.predict.load_predictor`); no
gradients. A one-level model gets the logit and gain columns only.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np
import torch


def nest_boxes(row: dict) -> list[tuple[int, int, int, int]]:
    """(top, left, height, width) of each nest in a CSV row (level-0 pixels)."""
    from ats_cli.render.records import parse_boxes

    return [box[1:] for box in parse_boxes(row["boxes"])]


def nest_regions(boxes: list[tuple[int, int, int, int]], region: int, cols: int) -> list[int]:
    """Indices, row-major on a grid of ``cols`` columns of ``region``-pixel regions, of the
    regions holding a nest's centre."""
    return sorted({(t + h // 2) // region * cols + (x + w // 2) // region for t, x, h, w in boxes})


def measure(ckpt: str, data: Path, tumour: list[dict], normal: list[dict], seed: int) -> dict[str, float]:
    from ats_cli.core.model import pixels_to_float
    from ats_cli.core.nested import region_grid
    from ats_cli.core.source import gather_patches
    from ats_cli.predict.predictor import load_predictor

    pred = load_predictor(ckpt, "cpu")
    model, opener = pred.model.eval(), pred.opener()
    P = model.patch_size[0]
    nested = hasattr(model, "coarse_attention")

    def open_(row):
        return opener(str(data / row["path"]), channels=3, scale=model.scale, patch_size=model.patch_size)

    def forward(o):
        mask = None if o.support is None else o.support[None]
        return model(o.low[None], [o.source], support_mask=mask, generator=torch.Generator().manual_seed(seed))

    def logits_gains(o, offsets: torch.Tensor) -> tuple[list[float], list[float]]:
        patches = pixels_to_float(gather_patches([o.source], offsets[None], model.patch_size)).flatten(0, 1)
        unit, gain = model.patch_parts(patches)
        lg = model.classifier(unit if gain is None else gain * unit)
        g = torch.ones(len(lg)) if gain is None else gain.flatten()
        return (lg[:, 1] - lg[:, 0]).tolist(), g.tolist()

    r: dict[str, list[float]] = {k: [] for k in ("coarse", "top", "fine", "nest_l", "nest_g", "norm_l", "norm_g")}
    with torch.no_grad():
        for row in tumour:
            o, boxes = open_(row), nest_boxes(row)
            centres = torch.tensor([[t + h // 2 - P // 2, x + w // 2 - P // 2] for t, x, h, w in boxes])
            lg, g = logits_gains(o, centres)
            r["nest_l"] += lg
            r["nest_g"] += g
            if not nested:
                continue
            R = model.region_size
            H, W = o.source.size
            a = model.coarse_attention(o.low[None], (H, W), None if o.support is None else o.support[None])[0]
            cols = region_grid((H, W), R)[1]
            nests = nest_regions(boxes, R, cols)
            r["coarse"].append(float(a[nests].sum()))
            r["top"].append(float(bool(set(a.topk(model.regions).indices.tolist()) & set(nests))))
            out = forward(o)
            for j, (r0, c0) in enumerate(out.region_offsets[0].tolist()):
                fine = out.fine_attention[0, j]
                ah, aw = fine.shape
                for t, x, h, w in boxes:
                    if r0 <= t + h // 2 < r0 + R and c0 <= x + w // 2 < c0 + R:
                        rows = slice(max(0, (t - r0) * ah // R), -(-(t + h - r0) * ah // R))
                        cols_ = slice(max(0, (x - c0) * aw // R), -(-(x + w - c0) * aw // R))
                        r["fine"].append(float(fine[rows, cols_].sum()))
        for row in normal:
            o = open_(row)
            out = forward(o)
            top = out.weights[0].argsort(descending=True)[:4]
            lg, g = logits_gains(o, out.offsets[0, top])
            r["norm_l"] += lg
            r["norm_g"] += g
    return {k: float(np.mean(v)) if v else float("nan") for k, v in r.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", type=Path)
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--slides", type=int, default=10)
    p.add_argument("--split", default="train")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    try:
        rows = list(csv.DictReader(open(args.data / f"{args.split}.csv", newline="")))
    except OSError as e:
        sys.exit(f"error: {e}")
    tumour = [r for r in rows if nest_boxes(r)][: args.slides]
    normal = [r for r in rows if not nest_boxes(r)][: args.slides]
    print("| checkpoint | coarse mass on nests | nest in top k | fine mass on nest | logit on nests | "
          "logit on normal | gain on nests | gain on normal |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    from ats_cli.checkpoint import CheckpointError

    for ck in args.checkpoints:
        try:
            m = measure(ck, args.data, tumour, normal, args.seed)
        except CheckpointError as e:  # names the file: one line, not a traceback
            sys.exit(f"error: {e}")
        print(f"| {ck} | {m['coarse']:.3f} | {m['top']:.0%} | {m['fine']:.2f} | {m['nest_l']:+.2f} | "
              f"{m['norm_l']:+.2f} | {m['nest_g']:.3f} | {m['norm_g']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
