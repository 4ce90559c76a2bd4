"""Where a two-level model's coarse attention starts on slides with nests: for each rarity
prior (weight, cap) and region temperature, how much of the coarse attention lies on the
regions holding a nest, how spread it is, and how often the regions drawn include one.

    python benchmarks/coarse_prior.py DATA --region-size 4096 --coarse-px 64 [--slides 20]
        [--split train] [--k 16] [--weights 2 4 10] [--caps 0 3.5 4.5] [--temperatures 0.1]

DATA: an ``ats make-dataset synthetic-slides`` set (virtual slides or TIFFs; ``boxes`` in its
CSV). A two-level model with random weights: its coarse net's last layer starts at zero, so
the coarse attention at the start of training is the prior's alone (each region's score the
``t``-log-mean-exp of its cells' ``weight * min(r, cap)``, over the tissue). Per setting,
over the first ``--slides`` tumour slides: the share of slides where the ``--k`` regions
drawn without replacement (Gumbel top-k, 200 draws) include a nest's region; the mean
coarse attention on nest regions, which is the weight nests get in the estimate on average;
the median of exp(entropy), the number of regions the mass is spread over; the median of
the largest region's mass (near 1: the estimate is one region's).
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # nested_attention, beside this file
from nested_attention import nest_boxes, nest_regions  # noqa: E402

DRAWS = 200


def rarity_cells(data: Path, split: str, slides: int, region: int, coarse_px: int):
    """Per tumour slide: (r of each coarse cell [K], the cells' regions [K], the kept cells
    [K] or None, the number of regions, the nest regions)."""
    from ats_cli.checkpoint import save_checkpoint
    from ats_cli.config import TrainConfig
    from ats_cli.core.nested import cell_regions, region_grid
    from ats_cli.models import create_model, model_spec
    from ats_cli.predict.predictor import load_predictor

    cfg = TrainConfig(levels=2, regions=4, region_size=region, coarse_px=coarse_px, patch_size=64, n_patches=4,
                      scale=0.125, rarity_prior=1.0, rarity_cap=0.0, min_brightness=0.0, tissue_mask="on",
                      patch_gain="off")  # uncapped at weight 1: log_prior is r itself
    spec = model_spec(cfg.validate(), n_classes=2, channels=3)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.pt"
        torch.manual_seed(0)
        save_checkpoint(path, spec=spec, classes=["normal", "tumor"], model=create_model(spec))
        predictor = load_predictor(str(path), "cpu")
    model, opener = predictor.model.eval(), predictor.opener()
    rows = [r for r in csv.DictReader(open(data / f"{split}.csv")) if nest_boxes(r)][:slides]
    for row in rows:
        o = opener(str(data / row["path"]), channels=3, scale=model.scale, patch_size=model.patch_size)
        H, W = o.source.size
        grid = region_grid((H, W), region)
        low, mask = o.low[None], None if o.support is None else o.support[None]
        with torch.no_grad():
            att_shape = tuple(model.coarse_net(low).shape[-2:])
            r = model.log_prior(low, att_shape, mask)  # weight 1: r itself, a cell's largest
            keep = model.sampling_support(low, att_shape, mask)
        cells = cell_regions(att_shape, tuple(low.shape[-2:]), getattr(model.coarse_net, "margin", 0), (H, W),
                             region, "cpu")
        nests = nest_regions(nest_boxes(row), region, grid[1])
        yield r.flatten(1), cells, None if keep is None else keep.flatten(1), grid[0] * grid[1], nests


def measure(slides, settings, k: int, seed: int = 0) -> dict:
    from ats_cli.core.nested import region_scores

    g = torch.Generator().manual_seed(seed)
    out = {s: [] for s in settings}
    for r, cells, keep, n_regions, nests in slides:
        for weight, cap, t in settings:
            cell = weight * (r if not cap else r.clamp(max=cap))
            logp = torch.log_softmax(region_scores(cell, cells, n_regions, keep, t)[0], 0)
            a = logp.exp()
            gumbel = logp[None] - torch.log(-torch.log(torch.rand(DRAWS, n_regions, generator=g)))
            drawn = gumbel.topk(min(k, int(torch.isfinite(logp).sum())), 1).indices
            hit = torch.isin(drawn, torch.tensor(nests)).any(1).float().mean()
            ent = -(a * torch.where(a > 0, logp, torch.zeros_like(logp))).sum()
            out[(weight, cap, t)].append((float(hit), float(a[nests].sum()), float(ent.exp()), float(a.max())))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", type=Path)
    p.add_argument("--region-size", type=int, required=True)
    p.add_argument("--coarse-px", type=int, required=True)
    p.add_argument("--slides", type=int, default=20)
    p.add_argument("--split", default="train")
    p.add_argument("--k", type=int, default=16, help="regions drawn (a model's --eval-regions)")
    p.add_argument("--weights", type=float, nargs="+", default=[2.0, 4.0, 10.0])
    p.add_argument("--caps", type=float, nargs="+", default=[0.0, 3.5, 4.5], help="0: no cap")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.1])
    a = p.parse_args()
    slides = list(rarity_cells(a.data, a.split, a.slides, a.region_size, a.coarse_px))
    settings = [(w, c, t) for t in a.temperatures for w in a.weights for c in a.caps]
    result = measure(slides, settings, a.k)
    print(f"{len(slides)} tumour slides of {a.data / a.split}, regions {a.region_size}, coarse px {a.coarse_px}, "
          f"k {a.k}")
    print("| weight | cap | temperature | slides drawing a nest region | mass on nest regions | exp(H), median "
          "| largest region's mass, median |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for (w, c, t), v in result.items():
        v = np.array(v)
        print(f"| {w:g} | {c:g} | {t:g} | {100 * v[:, 0].mean():.0f}% | {v[:, 1].mean():.3f} "
              f"| {np.median(v[:, 2]):.1f} | {np.median(v[:, 3]):.3f} |")


if __name__ == "__main__":
    main()
