"""What the first training steps give the attention: per step, the size of the attention
net's gradient from the classification loss and from the entropy term, the feature net's
and the classifier's, the attention's entropy against its uniform value, and (with the
generator's boxes.json) the attention mass on the label objects and on the distractors,
the share of drawn patches that touch a label object, and what each patch's own logits
(the classifier on its feature alone, what the per-patch loss trains) give its image's
label on the drawn patches that show a label object, a distractor, or only background:
whether the features tell the objects apart yet.

    python benchmarks/first_steps.py DATA [--steps 60] [--boxes PHOTOS/boxes.json]
        [--oracle [--oracle-share S]] [--model RUN/epochs/epoch_NNN.pt] [KEY=VALUE ...]

KEY=VALUE are ``ats train`` settings (``entropy=0``, ``batch_size=8``, ``feature_net=...``);
the rest is settled from the data as ``ats train`` settles it. One process, the CPU.
``--model CKPT`` starts from a checkpoint of ``ats train`` on the same data and settings (an
epoch's, ``RUN/epochs/epoch_NNN.pt``) instead of the initial weights: with ``lr=1e-12``, where
a trained run's attention lies (on the label objects, the distractors or neither) and what its
patches' own logits say there, which an attention that moved far from its start does not tell.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from ats_cli.checkpoint import load_checkpoint
from ats_cli.config import settle_data, view_scale
from ats_cli.core.model import exploration
from ats_cli.core.source import source_shapes
from ats_cli.data.dataset import load_dataset
from ats_cli.data.inputs import ImageDataset, collate
from ats_cli.models import create_model, model_spec
from ats_cli.recipes import resolve_config
from ats_cli.train import _optimizer, step_loss


def _norm(grads) -> float:
    return math.sqrt(sum(float((g.detach() ** 2).sum()) for g in grads if g is not None))


def _parse(kv: list[str]) -> dict:
    out = {}
    for item in kv:
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--boxes", default="")
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--oracle", action="store_true",
                    help="draw only on the label objects (boxes.json): what the feature net learns when every "
                         "patch shows one")
    ap.add_argument("--oracle-share", type=float, default=1.0,
                    help="with --oracle: the share of images drawn only on their objects, the others as trained "
                         "(how many draws on the objects the feature net needs)")
    ap.add_argument("--model", default="", help="start from this checkpoint's weights (RUN/epochs/epoch_NNN.pt)")
    ap.add_argument("settings", nargs="*")
    args = ap.parse_intermixed_args()
    torch.manual_seed(0)
    cfg = resolve_config(data=args.data, out="/tmp/first-steps", workers=0, **_parse(args.settings))
    data = load_dataset(cfg.data)
    settled, _ = settle_data(cfg, data)
    cfg, facts = settled.config, settled.facts
    scale = view_scale(cfg, settled.mpp)
    ds = ImageDataset(data["train"], channels=facts.channels, scale=scale,
                      patch_size=(cfg.patch_size, cfg.patch_size), **cfg.input_options())
    spec = model_spec(cfg, n_classes=data.num_classes, channels=facts.channels, mpp=settled.mpp)
    model = create_model(spec)
    if args.model:  # a trained run's weights; its settings must be these (same data, same KEY=VALUE)
        model.load_state_dict(load_checkpoint(args.model)["model"])
    opt = _optimizer(cfg, model)
    boxes = json.loads(Path(args.boxes).read_text()) if args.boxes else {}
    att = list(model.attention_net.parameters())
    feat = list(model.feature_net.parameters())
    cls = list(model.classifier.parameters())
    print(f"settled: batch {cfg.batch_size}, n_patches {cfg.n_patches}, patch {cfg.patch_size}, scale {scale:g}, "
          f"entropy {cfg.entropy}, feature_net {cfg.feature_net}, lr {cfg.lr}")
    print("step | CE loss (train acc, running) | |g_att| CE | |g_att| H | |g_feat| | |g_cls| | H / H_uniform | "
          "mass on objects | on distractors | drawn on objects | p(label) per patch: objects / distractors / "
          "background")
    g = torch.Generator().manual_seed(1)
    pick = torch.Generator().manual_seed(2)  # which images --oracle-share draws on their objects
    step, acc_avg = 0, 0.0
    model.train()
    while step < args.steps:
        order = torch.randperm(len(ds), generator=g).tolist()
        for start in range(0, len(order) - cfg.batch_size + 1, cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            batch = collate([ds[i] for i in idx])
            support = _oracle_mask(batch, ds, boxes, args.oracle_share, pick) if args.oracle else batch.support
            out = model(batch.low, batch.sources, support_mask=support, generator=g, **batch.views)
            right = (out.logits.argmax(1) == batch.labels).float().mean()
            acc_avg = float(right) if step == 0 else 0.9 * acc_avg + 0.1 * float(right)
            ce = step_loss(model, out, batch.labels) + model.entropy_weight * exploration(out).mean()
            bonus = -model.entropy_weight * exploration(out).mean()
            g_ce = torch.autograd.grad(ce, att + feat + cls, retain_graph=True, allow_unused=True)
            g_h = torch.autograd.grad(bonus, att, retain_graph=True, allow_unused=True)
            opt.zero_grad(set_to_none=True)
            (ce + bonus).backward()
            if cfg.clip_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
            opt.step()
            step += 1
            if step % args.every and step != 1:
                if step >= args.steps:
                    break
                continue
            mass, others, drawn = _on_objects(out, batch, ds, boxes, cfg.patch_size) if boxes else (float("nan"),) * 3
            p_obj, p_dis, p_bg = _patch_label_probs(out, batch, ds, boxes, cfg.patch_size) if boxes else \
                (float("nan"),) * 3
            k = out.attention[0].numel()
            print(f"{step:4d} | {float(ce):.3f} ({acc_avg:.2f}) | {_norm(g_ce[:len(att)]):.2e} | {_norm(g_h):.2e} | "
                  f"{_norm(g_ce[len(att):len(att) + len(feat)]):.2e} | {_norm(g_ce[len(att) + len(feat):]):.2e} | "
                  f"{float(out.entropy.mean()) / math.log(k):.4f} | {mass:.4f} | {others:.4f} | {drawn:.3f} | "
                  f"{p_obj:.3f} / {p_dis:.3f} / {p_bg:.3f}",
                  flush=True)
            if step >= args.steps:
                break


def _objects(ds, i: int, boxes: dict, role: str = "object") -> list:
    """Image ``i``'s boxes of ``role``: "object" (of its label) or "distractor"."""
    key = "/".join(Path(ds.records[i].path).parts[-2:])
    return [o for o in boxes.get(key, []) if o[3] == role]


def _oracle_mask(batch, ds, boxes, share: float = 1.0, pick: torch.Generator | None = None) -> torch.Tensor:
    """[B, h, w] True on the low-res pixels of each image's label objects; with ``share`` < 1
    only for that share of the images (drawn from ``pick``), the others keep their own support."""
    B, _, fh, fw = batch.low.shape
    mask = torch.zeros(B, fh, fw, dtype=torch.bool)
    chosen = torch.rand(B, generator=pick) < share
    for b, i in enumerate(batch.indices.tolist()):
        if not chosen[b]:
            mask[b] = True if batch.support is None else batch.support[b]
            continue
        H, W = source_shapes(batch.sources)[b]
        h, w = (fh, fw) if batch.view_sizes is None else (int(v) for v in batch.view_sizes[b])  # its own view
        for y, x, s, _ in _objects(ds, i, boxes):
            mask[b, int(y * h / H):math.ceil((y + s) * h / H), int(x * w / W):math.ceil((x + s) * w / W)] = True
    return mask


def _on_objects(out, batch, ds, boxes, patch) -> tuple[float, float, float]:
    """Mean attention mass on the label objects' cells and on the distractors', and the
    share of drawn patches whose square overlaps a label object."""
    masses, others, hits, total = [], [], 0, 0
    for b, i in enumerate(batch.indices.tolist()):
        objs = _objects(ds, i, boxes)
        H, W = source_shapes(batch.sources)[b]
        ah, aw = out.grids[b] if out.grids else out.attention[b].shape  # its own grid, top-left of a padded one
        a = out.attention[b, :ah, :aw]
        for found, where in ((objs, masses), (_objects(ds, i, boxes, "distractor"), others)):
            m = torch.zeros_like(a, dtype=torch.bool)
            for y, x, s, _ in found:
                m[int(y * ah / H):math.ceil((y + s) * ah / H), int(x * aw / W):math.ceil((x + s) * aw / W)] = True
            where.append(float(a[m].sum().detach()))
        for oy, ox in out.offsets[b].tolist():
            total += 1
            hits += any(oy < y + s and y < oy + patch and ox < x + s and x < ox + patch for y, x, s, _ in objs)
    return sum(masses) / len(masses), sum(others) / len(others), hits / max(total, 1)


def _patch_label_probs(out, batch, ds, boxes, patch) -> tuple[float, float, float]:
    """Mean probability of the image's label from each drawn patch's own logits
    (``out.patch_logits``), over the patches that overlap a label object, those that overlap
    only a distractor, and the rest (background); nan where a group is empty."""
    probs = torch.softmax(out.patch_logits.detach().float(), dim=-1)
    groups: dict[str, list[float]] = {"object": [], "distractor": [], "background": []}
    for b, i in enumerate(batch.indices.tolist()):
        label = int(batch.labels[b])
        found = {role: _objects(ds, i, boxes, role) for role in ("object", "distractor")}
        for k, (oy, ox) in enumerate(out.offsets[b].tolist()):
            role = next((r for r in ("object", "distractor") if any(
                oy < y + s and y < oy + patch and ox < x + s and x < ox + patch for y, x, s, _ in found[r])),
                "background")
            groups[role].append(float(probs[b, k, label]))
    mean = [sum(v) / len(v) if v else float("nan") for v in groups.values()]
    return mean[0], mean[1], mean[2]


if __name__ == "__main__":
    main()
