"""Stage 1: the feature network and a patch head of ``n_classes + 1`` rows (the classes
and "none") trained on labelled patches (:mod:`ats_cli.pretrain.patches`).

A patch read as "none" still votes when its features are pooled: the pooled feature is
the attention-weighted mean of unit-norm features, and its class logits still differ. So
the class logits are also trained to be equal on "none" patches (``none_uniform``, weight
0.5 by default: :func:`uniform_loss`): then a noise patch adds the same to every logit and
does not vote, whatever its attention mass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ats_cli.pretrain.internals import feature_parameters, feature_width, patch_features
from ats_cli.pretrain.patches import NONE

if TYPE_CHECKING:
    import torch

NONE_UNIFORM = 0.5  # weight of uniform_loss (outlier exposure's weight in its paper)


def uniform_loss(digit_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the class logits' softmax to the uniform distribution, mean over
    the rows; log(n_classes) at its minimum, where the logits are equal.

    Why: the classifier starts as the head's class rows and the pooled feature is the
    attention-weighted mean of the patches' features, so an image's logits start as the
    weighted sum of its patches' class logits. The none row makes a noise patch
    *classified* as none, but its class logits still differ -- for a ring pair they lean
    to 8 -- and it votes with its whole attention mass. With them equal, it adds the same
    amount to every logit, which the softmax ignores: noise stops voting whatever its mass.
    This is outlier exposure (Hendrycks, Mazeika & Dietterich, ICLR 2019) applied to the
    patches the regions say hold no object."""
    import torch.nn.functional as F

    return -F.log_softmax(digit_logits, dim=1).mean(1).mean()


def train_features(model, x: np.ndarray, y: np.ndarray, xt: np.ndarray, yt: np.ndarray, *, n_classes: int,
                   epochs: int, batch_size: int, lr: float, seed: int, none_uniform: float, device,
                   log: Callable[[str], None] = print, t0: float | None = None) -> tuple[torch.nn.Linear, float]:
    """Train the model's feature network and a new head on patches ``x`` [n, h, w] or
    [n, C, h, w] (uint8)
    with labels ``y`` (``n_classes`` = none), one line per epoch with the accuracy on the
    test patches ``xt``, ``yt``; returns the head and the last epoch's test patch accuracy.
    The head is created here, from torch's global RNG: the caller seeds it."""
    import torch
    import torch.nn.functional as F

    t0 = time.time() if t0 is None else t0
    head = torch.nn.Linear(feature_width(model), n_classes + 1).to(device)
    opt = torch.optim.Adam([*feature_parameters(model), *head.parameters()], lr=lr)
    steps = epochs * -(-len(y) // batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    X, Y = torch.from_numpy(x), torch.from_numpy(y)

    def forward(batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(device)
        return head(patch_features(model, (batch[:, None] if batch.ndim == 3 else batch).float() / 255.0))

    pred = np.zeros(0, np.int64)
    for epoch in range(1, epochs + 1):
        model.train()
        order, seen, correct = torch.randperm(len(Y), generator=gen), 0, 0
        for i in range(0, len(Y), batch_size):
            idx = order[i : i + batch_size]
            out = forward(X[idx])
            target = Y[idx].to(device)
            loss = F.cross_entropy(out, target)
            none = target == n_classes
            if none_uniform and none.any():  # the class rows say nothing on a none patch
                loss = loss + none_uniform * uniform_loss(out[none, :n_classes])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            seen, correct = seen + len(idx), correct + (out.argmax(1).cpu() == Y[idx]).sum().item()
        model.eval()
        with torch.no_grad():
            pred = torch.cat([forward(torch.from_numpy(xt[i : i + 512])).argmax(1).cpu()
                              for i in range(0, len(yt), 512)]).numpy()
        obj, none = yt < n_classes, yt == n_classes
        log(f"epoch {epoch}: train {100 * correct / seen:.1f}%, test patches {100 * (pred == yt).mean():.1f}% "
            f"(objects {100 * (pred[obj] == yt[obj]).mean():.1f}%, "
            f"{NONE} {100 * (pred[none] == n_classes).mean():.1f}%)"
            f", {time.time() - t0:.0f}s")
    return head, float((pred == yt).mean()) if len(pred) else 0.0
