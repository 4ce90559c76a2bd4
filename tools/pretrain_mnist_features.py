"""Stage 1 of the robust Megapixel MNIST recipe: teach the feature network what a digit is,
on patches cut around the digits the generator placed, and the attention network where the
digits are, before ``ats train`` learns from the image labels.

    python tools/pretrain_mnist_features.py DATA OUT.pt [--images 4000] [--epochs 3]
        [--attention-net NAME --attention-width W --feature-net NAME --feature-width W]
        [--scale S] [--attention-epochs 5] [--check FRESH_SET ...]
    ats train DATA --init OUT.pt  (same network flags and --scale)  ...

Why: in attention sampling the feature network learns only through the image's label,
pooled over the sampled patches. On a mix of noise families, three of which look like
digits (fragments of other digits, printed glyphs, pen strokes), that signal is weak and
training from scratch plateaued at ~70% (benchmarks/README.md, "Noise robustness"): the
feature net never learns that a fragment of a 7 is not a 7 (the clean set scored no
higher than the noisy ones). Megapixel MNIST records each digit's box (the ``digits``
column of the dataset's CSV, written by ``ats make-dataset megapixel-mnist``), so the
feature net can first be taught that directly: a patch holding one whole digit is labelled
with its class, a patch that holds no part of a digit -- noise, or black -- with an
eleventh class, "none"; patches where a digit is cut in half or two digits meet are left
out. Only the training split is read (its digits come from MNIST's training digits, its
noise from the families it was generated with: held-out families stay unseen).

"None" has to hold for noise the training never showed, and a net that learned it only
from the training families reads an unseen shape that happens to look like a small digit
(two stacked bubbles: an 8) as that digit. So each image also gives ``--shrunken`` "none"
patches holding one or two of its own digits shrunk to 0.3-0.6 of their size, half of
the pairs set side by side (:func:`shrunken_digits`): in Megapixel MNIST every digit comes
at MNIST's size, so a digit-like shape at half that size, or two of them together, is
noise, whatever drew it -- a fact about the task, not about any noise family. ``--check``
measures the point: it reads the noise and digit patches of other datasets (fresh sets of
held-out families) with the trained head (benchmarks/README.md, "Stage 1", has the figures
with and without).

A patch read as "none" still votes in ``ats train``: the pooled feature is the attention-
weighted mean of unit-norm features, and its ten digit logits still differ. So the ten
digit logits are also trained to be equal on "none" patches (``--none-uniform``, weight 0.5
by default: :func:`uniform_loss`): then a noise patch adds the same to every logit and does
not vote, whatever its attention mass. ``--patch-gain on`` (another way, off by default)
also trains ats train's patch gain (``ATSModel``: ``softplus(w . phi(x) + b)`` times the
unit feature) towards 1 on a digit patch and 0 on a "none" one (squared error), for ``ats
train --init OUT.pt --patch-gain on``: noise then adds (almost) nothing to the pooled
feature while every digit still weighs about alike, which counting needs.

The attention net is taught too (``--attention-epochs``, stage 1b): on the low-res views
ats train makes (``--scale``, as ats train's), its distribution is fitted by cross-entropy
to one that gives every digit of the image the same mass, spread over the cells whose patch
holds that digit whole (:func:`attention_targets`). Why: from the image labels alone the
attention learns slowly and unevenly -- after three epochs on a 3,000-image mix a run
put 12-17 times more mass on one digit than on another (median over images), and the
pooled feature, which tends to the mass-weighted vote of the digits, then follows the
heaviest digit instead of the majority (benchmarks/digit_attention.py, benchmarks/README.md
"Stage 1"). The views come from the same training images; held-out families stay unseen.

The output is an ordinary ats checkpoint of the model ``ats train`` builds with the same
network flags, so ``ats train --init`` takes it: the feature network as trained here; the
classifier's rows are the patch head's rows for the ten digits (the pooled feature is the
attention-weighted mean of the patches' unit features, so the image's logits start as the
weighted mean of its patches' logits: a vote among the patches the attention draws); the
attention network as taught in stage 1b (at its fresh initialisation with
``--attention-epochs 0``). A start for ``ats train --init``, not a model to predict with.
Not the thesis's setting, which trains from the image labels only: a model trained this
way says so in its card.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

NONE = "none"  # the eleventh patch class: no digit in the patch
WHOLE = 0.75  # a digit counts as in the patch when this much of its box is inside ...
TOUCH = 0.10  # ... and as absent when at most this much is: in between, the patch is left out
LIT_PATCHES = 8  # patches per image centred on random lit pixels (mostly noise: 50 noise boxes, 5 digits)
RANDOM_PATCHES = 2  # and anywhere (mostly black)
SMALL_PATCHES = 3  # "none" patches holding shrunken digits of the image (see shrunken_digits)
SMALL_SCALE = (0.3, 0.6)  # their size relative to the digits': a digit at half size is not a digit here
SMALL_ADJACENT = 0.5  # chance that a second small digit is set right beside the first (see shrunken_digits)
SMALL_GAP = (0.75, 1.1)  # then the distance of their centres over the sum of their ink radii (< 1: they touch)
NONE_UNIFORM = 0.5  # weight of uniform_loss (outlier exposure's weight in its paper)
ATTENTION_EPOCHS = 5  # stage 1b (see attention_targets)


def _boxes(extra: dict[str, str], where: str, classes: list[str]) -> list[list[int]]:
    """The row's digit boxes as [class index, row, col, h, w] (the ``digits`` column)."""
    from ats_cli.geojson import parse_boxes

    boxes = parse_boxes(extra.get("digits"))
    if not boxes or any(name not in classes for name, *_ in boxes):
        raise SystemExit(f"error: {where}: no usable 'digits' column of boxes of the dataset's classes (make the "
                         "data with ats make-dataset megapixel-mnist)")
    return [[classes.index(name), *box] for name, *box in boxes]


def _label(top: int, left: int, size: int, boxes: list[list[int]]) -> int | None:
    """The digit class wholly inside the patch, 10 (none) when no digit touches it, None when ambiguous."""
    from ats_cli.data.megapixel_mnist import box_fractions

    frac = box_fractions([top, left], [b[1:] for b in boxes], (size, size))[0]
    inside = {int(b[0]) for b, f in zip(boxes, frac, strict=True) if f >= WHOLE}
    touching = int((frac > TOUCH).sum())
    if touching == 0:
        return 10
    if len(inside) == 1 and touching == 1:
        return inside.pop()
    return None


def uniform_loss(digit_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the ten digit logits' softmax to the uniform distribution, mean over
    the rows; log(10) at its minimum, where the ten logits are equal.

    Why (``--none-uniform``): ats train's classifier starts as the head's ten digit rows and
    the pooled feature is the attention-weighted mean of the patches' features, so an image's
    logits start as the weighted sum of its patches' digit logits. The eleventh row makes a
    noise patch *classified* as none, but its ten digit logits still differ -- for a ring pair
    they lean to 8 -- and it votes with its whole attention mass. With the ten equal, it adds
    the same amount to every logit, which the softmax ignores: noise stops voting whatever
    its mass. This is outlier exposure (Hendrycks, Mazeika & Dietterich, ICLR 2019) applied
    to the patches the generator says hold no digit."""
    import torch.nn.functional as F

    return -F.log_softmax(digit_logits, dim=1).mean(1).mean()


def read_example(path: str, boxes: list[list[int]], size: int, seed: int, shrunken: int = SMALL_PATCHES,
                 view: tuple[float, tuple[int, int], int] | None = None):
    """One image, decoded once: its labelled patches (:func:`cut_patches`) and, with ``view``
    = (scale, attention map shape, margin), its low-res view and digit cells for stage 1b
    (:func:`attention_example`; else None, None). None for an image that cannot be read,
    with a line on stderr naming it."""
    from ats_cli.data.images import ImageReadError, read_image

    try:
        image = read_image(path, channels=1)
    except (ImageReadError, OSError) as e:
        print(f"skipped: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)  # the message names the file
        return None
    patches, labels = cut_patches(image[0].numpy(), boxes, size, seed, shrunken)
    low, cells = attention_example(image, boxes, size, *view) if view else (None, None)
    return patches, labels, low, cells


def cut_patches(image: np.ndarray, boxes: list[list[int]], size: int, seed: int,
                shrunken: int = SMALL_PATCHES) -> tuple[np.ndarray, np.ndarray]:
    """Labelled patches [n, size, size] (uint8) and labels [n] from one image [H, W] (uint8):
    one per digit (placed at random so that the digit is whole inside), LIT_PATCHES centred
    on lit pixels and RANDOM_PATCHES anywhere, each labelled by :func:`_label` (ambiguous
    ones dropped), then ``shrunken`` "none" patches made by :func:`shrunken_digits`."""
    height, width = image.shape
    rng = np.random.default_rng(seed)
    corners = []
    for _, r, col, h, w in boxes:
        corners.append((r - rng.integers(0, max(1, size - h + 1)), col - rng.integers(0, max(1, size - w + 1))))
    lit = np.flatnonzero(image > 0)
    for i in rng.choice(lit, size=min(LIT_PATCHES, lit.size), replace=False) if lit.size else []:
        corners.append((i // width - size // 2, i % width - size // 2))
    for _ in range(RANDOM_PATCHES):
        corners.append((rng.integers(0, height - size + 1), rng.integers(0, width - size + 1)))
    patches, labels = [], []
    for top, left in corners:
        top, left = int(np.clip(top, 0, height - size)), int(np.clip(left, 0, width - size))
        label = _label(top, left, size, boxes)
        if label is not None:
            patches.append(image[top : top + size, left : left + size])
            labels.append(label)
    for _ in range(shrunken if boxes else 0):  # a base may be an earlier shrunken patch: up to 4 small digits
        nones = [p for p, y in zip(patches, labels, strict=True) if y == 10]
        base = nones[int(rng.integers(len(nones)))] if nones else np.zeros((size, size), np.uint8)
        patches.append(shrunken_digits(image, boxes, base, rng))
        labels.append(10)
    return np.array(patches, dtype=np.uint8).reshape(-1, size, size), np.array(labels, dtype=np.int64)


def shrunken_digits(image: np.ndarray, boxes: list[list[int]], base: np.ndarray,
                    rng: np.random.Generator, count: int | None = None, adjacent: bool | None = None) -> np.ndarray:
    """``base`` (a "none" patch) with ``count`` (default: one or two) of the image's digits
    pasted in, each shrunk to SMALL_SCALE of its size: a negative labelled "none".

    Why: in Megapixel MNIST every digit is drawn at MNIST's own size, so a digit-like shape
    at half that size is noise, whatever made it. Without this the feature net learns
    "none" only from the noise families it is trained on, and an unseen family whose
    shapes happen to look like a small digit (two stacked circles, an 8) is read as that
    digit. A property of the task, not of any noise family: it teaches nothing about a
    particular held-out family's look.

    ``adjacent`` (default: with probability SMALL_ADJACENT): the second digit is set right
    beside the first, in a random direction, touching it or a pixel or two away (centres
    SMALL_GAP times the sum of their ink radii apart), instead of anywhere. Why: two small
    shapes side by side or stacked span a whole digit's height, and a net taught only with
    scattered small digits still read two small 0s stacked as an 8 (one in five at half
    size, measured on the 2026-11-25 release: benchmarks/README.md, "Side-by-side pairs and
    the object prior"). Two small
    digits next to each other are two small digits, not one of the usual size: again a fact
    of the task, made from the image's own digits."""
    from PIL import Image

    out = base.copy()
    size = out.shape[0]
    n = int(rng.integers(1, 3)) if count is None else count
    beside = bool(rng.random() < SMALL_ADJACENT) if adjacent is None else adjacent
    previous = (0.0, 0.0, 0.0)  # (centre row, centre col, ink radius) of the last digit pasted
    for k in range(n):
        _, r, c, h, w = boxes[int(rng.integers(len(boxes)))]
        digit = image[r : r + h, c : c + w]
        s = rng.uniform(*SMALL_SCALE)
        sh, sw = max(1, round(h * s)), max(1, round(w * s))
        small = np.asarray(Image.fromarray(digit).resize((sw, sh), Image.Resampling.BILINEAR, reducing_gap=2.0))
        rows, cols = np.flatnonzero(small.any(1)), np.flatnonzero(small.any(0))
        if rows.size:  # the ink's centre and radius inside the small box
            ink = ((rows[0] + rows[-1]) / 2, (cols[0] + cols[-1]) / 2,
                   max(rows[-1] - rows[0], cols[-1] - cols[0]) / 2 + 0.5)
        else:
            ink = (sh / 2, sw / 2, 0.0)
        if k and beside:  # beside the digit pasted before (previous)
            angle = rng.uniform(0.0, 2 * np.pi)
            dist = (previous[2] + ink[2]) * rng.uniform(*SMALL_GAP)
            top = round(previous[0] + dist * np.sin(angle) - ink[0])
            left = round(previous[1] + dist * np.cos(angle) - ink[1])
            top, left = int(np.clip(top, 0, size - sh)), int(np.clip(left, 0, size - sw))
        else:
            top, left = int(rng.integers(0, size - sh + 1)), int(rng.integers(0, size - sw + 1))
        out[top : top + sh, left : left + sw] = np.maximum(out[top : top + sh, left : left + sw], small)
        previous = (top + ink[0], left + ink[1], ink[2])
    return out


def attention_example(image, boxes: list[list[int]], size: int, scale: float, att_shape: tuple[int, int],
                      margin: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The low-res view [h, w] (float16) that ats train makes of the image [1, H, W] (uint8
    tensor) and, for each of its digits, the attention cells whose patch (where ats train
    would cut it) holds the digit whole."""
    import torch

    from ats_cli.core.geometry import positions_to_offsets
    from ats_cli.data.inputs import low_res_view
    from ats_cli.data.megapixel_mnist import box_fractions

    low = low_res_view(image, scale)
    cells = torch.arange(att_shape[0] * att_shape[1])[None]
    corners = positions_to_offsets(cells, att_shape, tuple(image.shape[-2:]), (size, size),
                                   low_size=tuple(low.shape[-2:]), margin=margin)[0].numpy()
    whole = box_fractions(corners, [b[1:] for b in boxes], (size, size)) >= 1.0  # [cells, digits]
    return low[0].numpy().astype(np.float16), [np.flatnonzero(whole[:, j]) for j in range(len(boxes))]


def attention_targets(model, views: np.ndarray, digit_cells: list[list[np.ndarray]], att_shape: tuple[int, int]
                      ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per image, the distribution the attention is taught, as (cells, probabilities, digit
    of each cell): each digit gets the same mass, spread evenly over its cells that the
    brightness support keeps (ats train never samples the others). Equal mass per digit
    because the label is the majority of the digits: the pooled feature tends to the
    mass-weighted vote, which is the majority only when every digit weighs alike
    (benchmarks/digit_attention.py measures it)."""
    import torch

    out = []
    for i in range(0, len(views), 64):
        low = torch.from_numpy(views[i : i + 64].astype(np.float32))[:, None]
        keep = model.support(low, att_shape)
        keep = (torch.ones(len(low), att_shape[0] * att_shape[1], dtype=torch.bool) if keep is None
                else keep.flatten(1)).numpy()
        for k, cells in zip(keep, digit_cells[i : i + 64], strict=True):
            kept = [(d, c[k[c]]) for d, c in enumerate(cells)]
            kept = [(d, c) for d, c in kept if len(c)]
            if not kept:
                out.append((np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64)))
                continue
            out.append((np.concatenate([c for _, c in kept]),
                        np.concatenate([np.full(len(c), 1.0 / (len(c) * len(kept)), np.float32) for _, c in kept]),
                        np.concatenate([np.full(len(c), d) for d, c in kept])))
    return out


def _targets_dense(targets, att_shape: tuple[int, int], device):
    import torch

    t = torch.zeros(len(targets), att_shape[0] * att_shape[1])
    for row, (idx, prob, _) in zip(t, targets, strict=True):
        row.index_add_(0, torch.from_numpy(idx), torch.from_numpy(prob))  # a cell may hold two digits whole
    return t.to(device)


def _log_attention(model, views: np.ndarray, att_shape: tuple[int, int], device):
    """log a [B, cells] of the model's attention on these views (-inf off the support, as
    ats train samples it), and the support [B, cells] (None = every cell)."""
    import torch

    from ats_cli.core.sampling import attention_distribution

    low = torch.from_numpy(views.astype(np.float32))[:, None].to(device)
    keep = model.support(low, att_shape)
    keep = None if keep is None else keep.flatten(1)
    return attention_distribution(model.attention_net(low), support=keep, log=True), keep


def train_attention(model, views: np.ndarray, targets, att_shape: tuple[int, int], *, epochs: int, lr: float,
                    batch_size: int, seed: int, device, log=print) -> None:
    """Fit the attention net's distribution to ``targets`` (cross-entropy), on the views."""
    import torch

    net = model.attention_net
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * -(-len(views) // batch_size))
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(1, epochs + 1):
        net.train()
        order, total, t0 = torch.randperm(len(views), generator=gen).numpy(), 0.0, time.time()
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            log_a, keep = _log_attention(model, views[idx], att_shape, device)
            if keep is not None:  # 0 * -inf: the target is 0 wherever the support is not
                log_a = log_a.masked_fill(~keep, 0.0)
            loss = -(_targets_dense([targets[j] for j in idx], att_shape, device) * log_a).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        log(f"attention epoch {epoch}: cross-entropy {total / len(views):.3f}, {time.time() - t0:.0f}s")


def attention_masses(model, views: np.ndarray, targets, att_shape: tuple[int, int], device
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Per image, the attention's mass on the digits' cells, and the largest digit's mass
    over the smallest's (1 = every digit weighs alike); images without a target are skipped."""
    import torch

    mass, ratio = [], []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(views), 64):
            probs = _log_attention(model, views[i : i + 64], att_shape, device)[0].exp().cpu().numpy()
            for row, (idx, _, digit) in zip(probs, targets[i : i + 64], strict=True):
                if len(idx):
                    per_digit = np.bincount(digit, weights=row[idx])[np.unique(digit)]
                    mass.append(per_digit.sum())
                    ratio.append(per_digit.max() / max(per_digit.min(), 1e-12))
    return np.array(mass), np.array(ratio)


def attention_report(model, views: np.ndarray, targets, att_shape: tuple[int, int], device) -> str:
    mass, ratio = attention_masses(model, views, targets, att_shape, device)
    return (f"attention mass on the digits median {100 * np.median(mass):.0f}%, largest/smallest digit "
            f"{np.median(ratio):.1f}")


def _attention_shape(model, path: str, scale: float, device) -> tuple[int, int]:
    """The attention map's shape on the views of a set (every Megapixel MNIST image of a set
    has one size)."""
    import torch

    from ats_cli.core.geometry import low_res_size
    from ats_cli.data.images import open_pil

    with open_pil(path) as im:
        width, height = im.size
    low = torch.zeros(1, 1, *low_res_size((height, width), scale), device=device)
    with torch.no_grad():
        return tuple(model.attention_net(low).shape[-2:])


def _read_all(records, classes: list[str], size: int, seed: int, workers: int, where: str, shrunken: int,
              view: tuple[float, tuple[int, int], int] | None):
    """:func:`read_example` over ``records``: patches [n, size, size], labels [n], and with
    ``view`` the views [images, h, w] and the digit cells per image (else None, None)."""
    jobs = [(str(r.path), _boxes(dict(r.extra), f"{where}:{r.line}", classes), size, seed * 1_000_003 + i,
             shrunken, view) for i, r in enumerate(records)]
    if workers <= 1:
        parts = [read_example(*job) for job in jobs]
    else:
        # spawned, not forked: the caller has run torch (the model, the attention map's shape),
        # and a forked child of a process whose torch thread pool has started can hang. One
        # torch thread each: N workers with a thread per core each oversubscribe the cores N
        # times over (on 2 cores, 40 images: 6.4 s with 2 workers of 8 threads, 3.8 s with
        # one thread each; a 16-core GPU machine, without this, had not read 6,000 images
        # after 6 minutes, about 20 s of single-thread work per worker)
        from ats_cli.data.loader import single_thread_worker

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=single_thread_worker, initargs=(0,)) as pool:
            parts = list(pool.map(read_example, *zip(*jobs, strict=True), chunksize=16))
    parts = [p for p in parts if p is not None]
    x = np.concatenate([p[0] for p in parts]) if parts else np.zeros((0, size, size), np.uint8)
    y = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    if view is None:
        return x, y, None, None
    views = np.stack([p[2] for p in parts]) if parts else np.zeros((0, 1, 1), np.float16)
    return x, y, views, [p[3] for p in parts]


def _attention_stage(model, views: list[tuple[str, np.ndarray, list[list[np.ndarray]]]], att_shape: tuple[int, int],
                     scale: float, args, device) -> None:
    """Stage 1b on ``views`` = (name, views, digit cells) of the training split first, then
    the sets to report on: the attention net taught each digit's cells on the training
    views, then its mass on the digits printed for the others."""
    t0 = time.time()
    model.cpu()
    targets = [attention_targets(model, v, cells, att_shape) for _, v, cells in views]
    model.to(device)
    print(f"attention: {len(views[0][1])} training views ({scale} scale, {att_shape[0]}x{att_shape[1]} cells), "
          f"targets {time.time() - t0:.0f}s", flush=True)
    train_attention(model, views[0][1], targets[0], att_shape, epochs=args.attention_epochs, lr=args.lr,
                    batch_size=32, seed=args.seed, device=device)
    for (name, v, _), t in list(zip(views, targets, strict=True))[1:]:
        if len(v):
            print(f"attention on {name} (test split): {attention_report(model, v, t, att_shape, device)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("data", help="a Megapixel MNIST dataset (ats make-dataset megapixel-mnist)")
    ap.add_argument("out", help="the checkpoint to write, for ats train --init")
    ap.add_argument("--images", type=int, default=4000, help="training images to cut patches from (default 4000)")
    ap.add_argument("--test-images", type=int, default=300, help="test images for the patch accuracy printed")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="processes reading images")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU) | cpu | cuda | cuda:N")
    ap.add_argument("--shrunken", type=int, default=SMALL_PATCHES,
                    help=f"shrunken-digit 'none' patches per image (default {SMALL_PATCHES}; 0 = none)")
    ap.add_argument("--check", nargs="+", default=[], metavar="DATA",
                    help="after training, read the real patches of these datasets' first --check-images test\n"
                         "images (e.g. fresh sets of noise families kept out of training) and print how many\n"
                         "noise patches are read as none and digit patches as their digit")
    ap.add_argument("--patch-gain", choices=["on", "off"], default="off",
                    help="on: also learn ats train's patch gain, as 1 on digit patches and 0 on 'none' ones")
    ap.add_argument("--none-uniform", type=float, default=NONE_UNIFORM,
                    help=f"weight of the loss making the ten digit logits equal on 'none' patches, so that noise\n"
                         f"does not vote in ats train (default {NONE_UNIFORM}; 0 = off; see uniform_loss)")
    ap.add_argument("--check-images", type=int, default=150, help="test images per --check set (default 150)")
    ap.add_argument("--attention-epochs", type=int, default=ATTENTION_EPOCHS,
                    help=f"epochs teaching the attention net the digits' cells, each digit the same mass\n"
                         f"(default {ATTENTION_EPOCHS}; 0 = leave it at its initialisation)")
    ap.add_argument("--scale", type=float, default=0.0,
                    help="the low-res view's scale, as ats train's --scale (default: the dataset's)")
    for flag, default in (("--attention-net", "mnist-attention"), ("--attention-width", 8),
                          ("--feature-net", "small-cnn"), ("--feature-width", 32), ("--feature-scale", 10.0)):
        ap.add_argument(flag, type=type(default), default=default, help=f"as ats train's (default {default})")
    from ats_cli.config import allowed_values  # torch-free: --help stays instant

    choices = allowed_values()
    ap.add_argument("--pooling", choices=choices["pooling"], default="features",
                    help="as ats train's: what the checkpoint's model pools (votes: each patch's class\n"
                         "probabilities, which is what this stage trains the classifier on)")
    ap.add_argument("--none-class", choices=choices["none_class"], default="off",
                    help="as ats train's (with --pooling votes or counts): the checkpoint keeps this stage's\n"
                         "'none' row as its per-patch 'no class here' logit")
    args = ap.parse_args(argv)
    if args.none_class == "on" and args.pooling == "features":
        ap.error("--none-class on needs --pooling votes or counts")
    if args.none_uniform < 0:
        ap.error(f"--none-uniform must be >= 0 (got {args.none_uniform})")

    import torch
    import torch.nn.functional as F

    from ats_cli.checkpoint import save_checkpoint
    from ats_cli.config import TrainConfig
    from ats_cli.data.dataset import DatasetError, load_dataset
    from ats_cli.models import create_model, model_spec
    from ats_cli.settle import AUTO_MIN_BRIGHTNESS, DataFacts, settle, usable_hints

    try:
        data = load_dataset(args.data)
    except DatasetError as e:
        raise SystemExit(f"error: {e}") from None
    checks = []
    for path in args.check:  # opened first: a typo fails now, not after the training
        try:
            checks.append(load_dataset(path))
        except DatasetError as e:
            raise SystemExit(f"error: {e}") from None
    cfg = TrainConfig(data=args.data, attention_net=args.attention_net, attention_width=args.attention_width,
                      feature_net=args.feature_net, feature_width=args.feature_width,
                      feature_scale=args.feature_scale, seed=args.seed, patch_gain=args.patch_gain,
                      scale=args.scale, pooling=args.pooling, none_class=args.none_class,
                      # what ats train settles for Megapixel MNIST's black canvas: only bright cells are
                      # sampled, so the attention is taught (and its mass on the digits measured) over those
                      min_brightness=AUTO_MIN_BRIGHTNESS)
    cfg = settle(cfg, DataFacts(hints=usable_hints(data.hints)))[0].config  # the dataset's sizes, as ats train
    size = cfg.patch_size
    torch.manual_seed(args.seed)
    spec = model_spec(cfg, n_classes=data.num_classes, channels=1)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    model = create_model(spec).to(device)

    t0 = time.time()
    def view_of(records):
        """What read_example needs for stage 1b's views of these records (None: no stage 1b)."""
        if args.attention_epochs <= 0 or not len(records):
            return None
        return (cfg.scale, _attention_shape(model, str(records[0].path), cfg.scale, device),
                getattr(model.attention_net, "margin", 0))

    view = view_of(data["train"])  # stage 1b's views are read with the patches: each image decoded once
    x, y, train_views, train_cells = _read_all(data["train"][: args.images], data.classes, size, args.seed,
                                               args.workers, str(data.root / "train.csv"), args.shrunken, view)
    xt, yt, test_views, test_cells = _read_all(data["test"][: args.test_images], data.classes, size, args.seed + 1,
                                               args.workers, str(data.root / "test.csv"), args.shrunken, view)
    if not len(y) or not len(yt):
        raise SystemExit(f"error: {args.data}: no readable training or test image gave a patch")
    # the check sets' real patches (no shrunken ones), read now: a set that is not Megapixel
    # MNIST stops the tool before the training, not after it
    check_reads = [_read_all(c["test"][: args.check_images], c.classes, size, args.seed + 7, args.workers,
                             str(c.root / "test.csv"), 0, view_of(c["test"]))
                   for c in checks]
    check_patches = [(xc, yc) for xc, yc, _, _ in check_reads]
    print(f"{len(y)} training patches ({(y < 10).sum()} digits, {(y == 10).sum()} {NONE}) from "
          f"{min(args.images, len(data['train']))} images, {len(yt)} test patches, {time.time() - t0:.0f}s", flush=True)

    head = torch.nn.Linear(model.feature_net.out_features, data.num_classes + 1).to(device)
    params = [*model.feature_net.parameters(), *head.parameters(),
              *(model.gain.parameters() if model.patch_gain else [])]
    opt = torch.optim.Adam(params, lr=args.lr)
    steps = args.epochs * -(-len(y) // args.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(args.seed)
    X, Y = torch.from_numpy(x), torch.from_numpy(y)

    def forward(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Patch logits from the scaled unit features ats train pools (without the gain, which
        is learned apart), and the patch gains [N] (None without)."""
        feats, gain = model.patch_parts(batch.to(device)[:, None].float() / 255.0)
        return head(feats), None if gain is None else gain[:, 0]

    for epoch in range(1, args.epochs + 1):
        model.train()
        order, seen, correct = torch.randperm(len(Y), generator=gen), 0, 0
        for i in range(0, len(Y), args.batch_size):
            idx = order[i : i + args.batch_size]
            out, gain = forward(X[idx])
            target = Y[idx].to(device)
            loss = F.cross_entropy(out, target)
            none = target == 10
            if args.none_uniform and none.any():  # the ten digit rows say nothing on a none patch
                loss = loss + args.none_uniform * uniform_loss(out[none, :10])
            if gain is not None:  # gain 1 on a digit (all digits weigh alike), 0 on none (it adds nothing)
                loss = loss + F.mse_loss(gain, (~none).float())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            seen, correct = seen + len(idx), correct + (out.argmax(1).cpu() == Y[idx]).sum().item()
        model.eval()
        with torch.no_grad():
            pred = torch.cat([forward(torch.from_numpy(xt[i : i + 512]))[0].argmax(1).cpu()
                              for i in range(0, len(yt), 512)]).numpy()
        digit, none = yt < 10, yt == 10
        print(f"epoch {epoch}: train {100 * correct / seen:.1f}%, test patches {100 * (pred == yt).mean():.1f}% "
              f"(digits {100 * (pred[digit] == yt[digit]).mean():.1f}%, {NONE} {100 * (pred[none] == 10).mean():.1f}%)"
              f", {time.time() - t0:.0f}s", flush=True)

    for check, (xc, yc) in zip(checks, check_patches, strict=True):
        if not len(yc):
            print(f"check {check.root}: no readable test image gave a patch", flush=True)
            continue
        with torch.no_grad():
            outs = [forward(torch.from_numpy(xc[i : i + 512])) for i in range(0, len(yc), 512)]
        pc = torch.cat([o.argmax(1).cpu() for o, _ in outs]).numpy()
        # what a noise patch votes in ats train: the top of its ten digit logits' softmax
        vote = torch.cat([o[:, :10].softmax(1).amax(1).cpu() for o, _ in outs]).numpy()
        none = yc == 10
        noise = ",".join(check.meta.get("generator", {}).get("noise", {}).get("families", ["?"]))
        misread = np.bincount(pc[none & (pc != 10)], minlength=10)
        worst = (f"most often misread as {misread.argmax()}: {100 * misread.max() / none.sum():.1f}%"
                 if misread.any() else "none misread")
        print(f"check {check.root} (noise {noise}): {none.sum()} noise patches, {100 * (pc[none] == 10).mean():.1f}% "
              f"read as {NONE} ({worst})"
              f", {(~none).sum()} digit patches, {100 * (pc[~none] == yc[~none]).mean():.1f}% right; a noise "
              f"patch's vote (top of its ten digit logits' softmax; 0.10 = none): median {np.median(vote[none]):.2f}",
              flush=True)
        if model.patch_gain:
            gc = torch.cat([g.cpu() for _, g in outs]).numpy()
            print(f"  gain on noise patches: median {np.median(gc[none]):.2f}, 90th percentile "
                  f"{np.percentile(gc[none], 90):.2f}; on digit patches: median {np.median(gc[~none]):.2f}, "
                  f"10th percentile {np.percentile(gc[~none], 10):.2f}", flush=True)

    if view is not None:
        # a check set of another image size has views of another shape: reported only when
        # its attention map has the training one's shape (the targets' cells are indexed by it)
        sets = [(str(data.root), train_views, train_cells), (str(data.root), test_views, test_cells)]
        sets += [(str(c.root), v, cells) for c, (_, _, v, cells) in zip(checks, check_reads, strict=True)
                 if v is not None and v.shape[1:] == train_views.shape[1:]]
        _attention_stage(model, sets, view[1], cfg.scale, args, device)

    with torch.no_grad():  # the ten digit rows: the image's logits start as its patches' weighted vote
        model.classifier.weight.copy_(head.weight[: data.num_classes])
        model.classifier.bias.copy_(head.bias[: data.num_classes])
        if model.none is not None:  # --none-class on: the none row, as the model's "no class here" logit
            model.none.weight.copy_(head.weight[data.num_classes :])
            model.none.bias.copy_(head.bias[data.num_classes :])
    save_checkpoint(args.out, spec=spec, classes=data.classes, model=model.cpu(),
                    pretrain={"images": min(args.images, len(data["train"])), "patches": int(len(y)),
                              "epochs": args.epochs, "shrunken": args.shrunken,
                              "none_share": float((y == 10).mean()),  # release_model.py --none-prior
                              "test_patch_accuracy": float((pred == yt).mean()),
                              "attention_epochs": args.attention_epochs, "none_uniform": args.none_uniform})
    print(f"wrote {args.out}: ats train {args.data} --init {args.out} (same network flags)")


if __name__ == "__main__":
    main()
