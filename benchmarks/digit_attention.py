"""Does the attention weigh every digit alike? Per-digit attention of a Megapixel MNIST model.

The label is the majority of 5 digits (3 of the target class). The model's pooled
feature is the attention-weighted mean of patch features, so with a feature net that
reads each digit right, the class it converges to (as the patches drawn grow) is the
*mass-weighted* vote: each digit counts with the attention mass around it. That vote is
the majority only when the digits get similar masses: a digit with 20 times the mass of
another is counted 20 times. This script measures, on a dataset's test images (the
``digits`` column of boxes that ``ats make-dataset megapixel-mnist`` writes):

* the model's accuracy when drawing ``--n-patches`` patches (default: its own count);
* the draws that hold at least half a digit, and how many of the 5 digits they reach;
* the attention mass on the digits: the cells whose patch would hold a digit whole;
* per image, the largest digit mass over the smallest (median over images);
* the accuracy of the mass-weighted vote (what the pooled estimate tends to with many
  patches and a perfect feature net), beside the count vote of the digits drawn;
* the draws that hold no digit (at most 10% of one) and how loudly they vote: the top of
  the softmax of the classifier on each one's feature alone (0.10 = no vote, 1 = a sure
  digit), median over them and the share above 0.5.

    python benchmarks/digit_attention.py --model M.pt --data DATA [--n 300] [--n-patches 20]

Prints one markdown table row per model (several ``--model`` allowed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's ats_cli

HEADER = ("| model | images | patches | accuracy | digit draws | digits reached | mass on digits | "
          "max/min digit mass | mass-weighted vote | count vote of digits drawn | noise draws | "
          "their vote (median) | noise draws voting > 0.5 |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def _vote(weights: dict[int, float], label: int) -> bool:
    """True when ``label`` alone has the largest weight."""
    best = max(weights.values(), default=0.0)
    return weights.get(label, 0.0) == best > 0 and sum(v == best for v in weights.values()) == 1


def measure(model_path: str, data: str, n: int, n_patches: int | None, seed: int = 0) -> dict[str, Any]:
    import numpy as np
    import torch

    from ats_cli.checkpoint import load_model
    from ats_cli.core.source import positions_to_offsets
    from ats_cli.data import load_dataset
    from ats_cli.data.images import ImageReadError, read_image
    from ats_cli.data.inputs import low_res_view
    from ats_cli.data.megapixel_mnist import box_fractions
    from ats_cli.render.records import parse_boxes

    model, ckpt = load_model(model_path)
    channels = int(ckpt["spec"]["channels"])
    ds = load_dataset(data)
    records = ds["test"][:n]
    k = n_patches or model.patches_now
    gen = torch.Generator().manual_seed(seed)
    rows: dict[str, list[float]] = {key: [] for key in ("right", "draws", "reached", "mass", "ratio", "mass_vote",
                                                        "count_vote", "noise")}
    noise_votes: list[float] = []
    for rec in records:
        boxes = parse_boxes(rec.extra.get("digits"))
        if not boxes:
            raise SystemExit(f"error: {rec.path}: no 'digits' boxes in its row of {data}/test.csv")
        classes = [ds.classes.index(name) for name, *_ in boxes]
        rects = [box for _, *box in boxes]
        try:
            image = read_image(rec.path, channels)
        except ImageReadError as e:  # names the file
            raise SystemExit(f"error: {e}") from None
        low = low_res_view(image, model.scale)[None]
        with torch.no_grad():
            out = model(low, image[None], n_patches=k, generator=gen)
        rows["right"].append(float(out.logits.argmax(1).item() == rec.label))
        # the draws: which digit (if any) each holds at least half of
        valid = out.sampled_probs[0].numpy() > 0
        cover = box_fractions(out.offsets[0].numpy()[valid], rects, model.patch_size)
        drawn = cover.argmax(1)[cover.max(1) >= 0.5].tolist()
        noise = cover.max(1) < 0.1
        rows["noise"].append(int(noise.sum()))
        votes = out.patch_logits[0][torch.from_numpy(valid)].softmax(-1).amax(-1)
        noise_votes += votes[torch.from_numpy(noise)].tolist()
        rows["draws"].append(len(drawn))
        rows["reached"].append(len(set(drawn)))
        counts: dict[int, float] = {}
        for d in set(drawn):
            counts[classes[d]] = counts.get(classes[d], 0) + 1
        rows["count_vote"].append(float(_vote(counts, rec.label)))
        # the attention mass around each digit: the cells whose patch (where the model
        # would read it) holds the digit whole
        att = out.attention[0]
        cells = torch.arange(att.numel())[None]
        corners = positions_to_offsets(cells, tuple(att.shape), tuple(image.shape[-2:]), model.patch_size,
                                       low_size=tuple(low.shape[-2:]), margin=getattr(model.attention_net, "margin", 0))
        whole = box_fractions(corners[0].numpy(), rects, model.patch_size) >= 1.0  # [cells, digits]
        masses = att.flatten().double().numpy() @ whole
        rows["mass"].append(float(masses.sum()))
        rows["ratio"].append(float(masses.max() / max(masses.min(), 1e-12)))
        weights: dict[int, float] = {}
        for c, m in zip(classes, masses.tolist(), strict=True):
            weights[c] = weights.get(c, 0.0) + m
        rows["mass_vote"].append(float(_vote(weights, rec.label)))
    return {"model": model_path, "images": len(records), "patches": k,
            "accuracy": float(np.mean(rows["right"])), "digit_draws": float(np.mean(rows["draws"])),
            "digits_reached": float(np.mean(rows["reached"])), "mass_on_digits": float(np.median(rows["mass"])),
            "mass_ratio": float(np.median(rows["ratio"])), "mass_vote": float(np.mean(rows["mass_vote"])),
            "count_vote": float(np.mean(rows["count_vote"])), "noise_draws": float(np.mean(rows["noise"])),
            "noise_vote": float(np.median(noise_votes)) if noise_votes else float("nan"),
            "noise_loud": float(np.mean(np.array(noise_votes) > 0.5)) if noise_votes else float("nan")}


def row(r: dict[str, Any]) -> str:
    return (f"| {r['model']} | {r['images']} | {r['patches']} | {100 * r['accuracy']:.1f}% | {r['digit_draws']:.1f} | "
            f"{r['digits_reached']:.2f} of 5 | {100 * r['mass_on_digits']:.0f}% | {r['mass_ratio']:.1f} | "
            f"{100 * r['mass_vote']:.1f}% | {100 * r['count_vote']:.1f}% | {r['noise_draws']:.1f} | "
            f"{r['noise_vote']:.2f} | {100 * r['noise_loud']:.0f}% |")


def main(argv: list[str] | None = None, log=print) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, help="a checkpoint; repeat for several")
    ap.add_argument("--data", required=True, help="a Megapixel MNIST dataset (its test split is read)")
    ap.add_argument("--n", type=int, default=300, help="test images (default 300)")
    ap.add_argument("--n-patches", type=int, default=None, help="patches drawn (default: each model's own)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the draws")
    args = ap.parse_args(argv)
    results = []
    log(HEADER)
    for m in args.model:
        results.append(measure(m, args.data, args.n, args.n_patches, args.seed))
        log(row(results[-1]))
    return results


if __name__ == "__main__":
    main()
