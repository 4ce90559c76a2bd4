"""How noisy is each unbiased estimator on a trained model's real attention? (no training)

For each labelled image: the attention distribution a over the cells the model may
sample, the features of EVERY such cell, hence the exact pooled feature ``sum_i a_i f_i``
and the exact prediction (what infinitely many samplings would converge to). Then, for
each estimator and number of patches n, ``--draws`` independent samplings reuse those
features (so the estimators see the same draws and the comparison is paired), and we
report per (estimator, n):

* ``rel_mse``: mean ||estimate - exact||^2 / ||exact||^2 of the pooled feature;
* ``flip``: how often one sampling's predicted class differs from the exact one;
* ``accuracy``: mean accuracy of one sampling, i.e. what ``ats predict --n-patches n
  --estimator E`` scores on these images in expectation over seeds (``auto`` in
  prediction is ``threshold``; its row here is its training rule);

and the exact prediction's accuracy (the ceiling sampling noise cannot beat).

    python benchmarks/estimator_variance.py DATASET_DIR_OR_CSV --model models/megapixel-mnist-ats.pt \\
        --images 200 --draws 16 --json benchmarks/estimator_variance.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ats_cli.core.model import pixels_to_float
from ats_cli.core.sampling import attention_distribution, entropy, estimator_threshold, expectation, sample
from ats_cli.core.source import gather_patches, positions_to_offsets, source_sizes
from ats_cli.extensions.pooling import Where
from ats_cli.predict import load_predictor, resolve_inputs

# the two estimators, and auto's training rule (per image: threshold iff n >= perplexity);
# in prediction auto IS threshold
NAMES = ("threshold", "sequential", "auto")


@torch.no_grad()
def exact_terms(model, opened) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [1, K] over the attention grid, its prior and support included, the pooled
    values [K, D] of every cell with a > 0 (what the model's pooling averages); rows of cells
    with a = 0 are zero: they are never drawn before the positive ones)."""
    low = opened.low[None]
    scores = model.attention_net(low)
    att_shape = tuple(scores.shape[-2:])
    mask = None if opened.support is None else opened.support[None]
    prior = model.log_prior(low, att_shape, mask)
    if prior is not None:
        scores = scores + prior[:, None]
    probs = attention_distribution(scores, model.sampling_support(low, att_shape, mask))
    cells = (probs[0] > 0).nonzero()[:, 0]
    offsets = positions_to_offsets(cells[None], att_shape, source_sizes([opened.source]), model.patch_size,
                                   low_size=tuple(low.shape[-2:]), margin=getattr(model.attention_net, "margin", 0))
    patches = pixels_to_float(gather_patches([opened.source], offsets, model.patch_size))
    where = Where(probs, att_shape, cells[None], source_sizes([opened.source]), model.patch_size)
    feats = model.pooling.values(model.patch_features(patches.flatten(0, 1))[None], model.classifier, where)[0]
    full = feats.new_zeros(probs.shape[1], feats.shape[1])
    full[cells] = feats
    return probs, full


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="dataset directory (its test.csv) or dataset CSV with labels")
    ap.add_argument("--model", required=True)
    ap.add_argument("--images", type=int, default=300, help="first N labelled images")
    ap.add_argument("--draws", type=int, default=64, help="samplings per image, estimator and n")
    ap.add_argument("--n", type=int, nargs="+", default=[10, 25, 50, 100])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    torch.set_grad_enabled(False)
    predictor = load_predictor(args.model, "cpu")
    model = predictor.model
    if model.replace:
        raise SystemExit(f"{args.model}: samples with replacement; both estimators are then the plain mean")
    items = [it for it in resolve_inputs([args.data]) if it.label is not None][: args.images]
    if not items:
        raise SystemExit(f"{args.data}: no labelled images")
    open_one = predictor.opener()
    g = torch.Generator().manual_seed(args.seed)
    stats = {(e, n): {"rel_mse": 0.0, "flip": 0.0, "correct": 0.0} for e in NAMES for n in args.n}
    exact_correct, support_sizes, perplexities, t0 = 0, [], [], time.perf_counter()
    for count, item in enumerate(items, 1):
        opened = open_one(item.path, channels=predictor.channels, scale=model.scale, patch_size=model.patch_size)
        probs, feats = exact_terms(model, opened)
        exact = probs[0] @ feats
        exact_pred = int(model.pooling.readout(exact[None], model.classifier).argmax())
        label = predictor.classes.index(item.label)
        exact_correct += exact_pred == label
        support_sizes.append(int((probs > 0).sum()))
        perplexities.append(float(torch.exp(entropy(probs))))
        for n in args.n:
            rows = probs.expand(args.draws, -1)
            draw = sample(rows, n, generator=g)  # one draw per row, shared by the estimators
            picked = feats[draw.indices]  # [draws, n, D]
            for est in NAMES:
                threshold = estimator_threshold(est, draw, rows)
                pooled = expectation(picked, draw.probs, threshold=threshold)
                pred = model.pooling.readout(pooled, model.classifier).argmax(1)
                s = stats[(est, n)]
                s["rel_mse"] += float(((pooled - exact) ** 2).sum(1).mean() / (exact**2).sum())
                s["flip"] += float((pred != exact_pred).float().mean())
                s["correct"] += float((pred == label).float().mean())
        if count % 50 == 0:
            print(f"{count}/{len(items)} images, {time.perf_counter() - t0:.0f} s", flush=True)

    m = len(items)
    rows = [{"estimator": e, "n_patches": n, "rel_mse": s["rel_mse"] / m, "flip_rate": s["flip"] / m,
             "accuracy": s["correct"] / m} for (e, n), s in stats.items()]
    result = {"model": str(args.model), "data": str(args.data), "images": m, "draws": args.draws,
              "seed": args.seed, "exact_accuracy": exact_correct / m,
              "support_cells": [min(support_sizes), max(support_sizes)],
              "perplexity": [min(perplexities), sorted(perplexities)[m // 2], max(perplexities)], "rows": rows,
              "seconds": round(time.perf_counter() - t0, 1)}
    lo, mid, hi = result["perplexity"]
    print(f"{m} images ({min(support_sizes)}-{max(support_sizes)} cells in the support, attention perplexity "
          f"{lo:.0f}/{mid:.0f}/{hi:.0f} min/median/max), {args.draws} draws each; "
          f"exact prediction (every cell): accuracy {result['exact_accuracy']:.1%}")
    print("| n | estimator | rel. MSE of pooled feature | P(class differs from exact) | mean accuracy |")
    print("|---:|---|---:|---:|---:|")
    for n in args.n:
        for e in NAMES:
            r = next(r for r in rows if r["estimator"] == e and r["n_patches"] == n)
            print(f"| {n} | {e} | {r['rel_mse']:.4f} | {r['flip_rate']:.2%} | {r['accuracy']:.2%} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
