"""A run that learns nothing says so.

Attention sampling has two ways to train to nothing while the loss still goes down, and
both look like ordinary training in a log of losses:

* **The attention stays where it started.** The attention net learns only through the
  patches it draws (the estimator's gradient, thesis eq. 3.19): when the few objects that
  decide the label are rarely among them, its gradient is noise and the attention stays
  where its zero-initialised last layer started it: uniform, or the prior's. The feature
  net then learns from background alone (measured: benchmarks/README.md#first-tries-on-real-pixels).
* **Validation stays at chance while training accuracy climbs.** The model learns the
  training images by heart (a small dataset, a feature net started from random weights)
  or training and evaluation see the images differently.

:func:`attention_moved` measures how far the attention is from where it started (KL to
its start), :func:`uniform_entropy` the entropy of a uniform attention over the cells an
image may sample; the training step adds both up, and
:func:`warnings` reads one epoch's record: a line for each of the two, with the likely
causes and what to try. The thresholds are loose on purpose: a warning on a run that is
learning costs a user's trust, one missed on a run at chance costs only what today's
silence costs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MOVED_MIN", "CHANCE_MARGIN", "attention_learns", "attention_moved", "uniform_entropy",
           "chance_accuracy", "warnings"]

# an attention less than this far (nats, KL) from where it started has not moved: a drift of
# noise in the scores stays well under it, an attention that found something goes far past it
MOVED_MIN = 0.05
# held-out accuracy within this of chance is chance, while training accuracy is at least
# CLIMB above its own chance
CHANCE_MARGIN, CLIMB = 0.05, 0.25
LEARNS = 0.1  # held-out accuracy this far above chance: the run learns, whatever its attention
DOCS = "docs/training.md#a-run-that-learns-nothing"


@torch.no_grad()
def uniform_entropy(out: Any) -> torch.Tensor:
    """[B] the entropy (nats) a uniform attention over the cells each image may sample would
    have: log of the count of cells with any probability (the support and a tissue mask set
    the others to exactly 0), plus, for a two-level model, that of each drawn region's fine
    attention averaged over the regions, as its ``entropy`` adds them."""
    att = out.attention.flatten(1)
    total = torch.log((att > 0).sum(1).clamp(min=1).double())
    fine = getattr(out, "fine_attention", None)
    if fine is not None:
        B, k = fine.shape[:2]
        total = total + torch.log((fine.reshape(B, k, -1) > 0).sum(-1).clamp(min=1).double()).mean(1)
    return total


def attention_learns(model: Any) -> bool:
    """Whether ``model`` has an attention net that trains (not ``uniform``, not the CNN)."""
    try:
        net = getattr(model, "attention_net", None)
    except ValueError:  # the CNN baseline's attention_net says it has none
        return False
    return net is not None and any(p.requires_grad for p in net.parameters())


@torch.no_grad()
def attention_moved(model: Any, out: Any, uniform: torch.Tensor | None = None) -> torch.Tensor | None:
    """[B] how far (nats) each image's attention has moved from where it started: KL(a ||
    the start), the start the prior's own attention where the model has a prior (the
    regulariser's ``-explore``), else uniform over the cells it may draw (``log K - H(a)``).
    None for a model whose attention cannot learn (``uniform``, the CNN baseline).
    ``uniform``: :func:`uniform_entropy` of ``out`` when the caller has it already."""
    if not attention_learns(model):
        return None
    if getattr(model, "prior", None) is not None and getattr(out, "explore", None) is not None:
        return -out.explore.detach().double()
    return (uniform_entropy(out) if uniform is None else uniform) - out.entropy.detach().double()


def chance_accuracy(labels: Sequence[int]) -> float:
    """The accuracy of always answering the most frequent class of ``labels``."""
    if not labels:
        return 0.0
    counts: dict[int, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    return max(counts.values()) / len(labels)


def warnings(record: dict[str, Any], chance: dict[str, float], *, steps: int,
             previous: dict[str, Any] | None = None) -> dict[str, str]:
    """The warnings one epoch's ``record`` (``ats train``'s metrics line) calls for, by kind
    (``uniform``, ``chance``); ``chance``: each split's :func:`chance_accuracy` (splits
    missing from it are not judged: multi-label data); ``steps``: training steps an epoch.
    With ``previous`` (the epoch before's record), a kind is named only when it held there
    too: a small held-out split swings by chance from one epoch to the next, and one
    epoch of it said nothing of a run that learned the epoch after."""
    if previous is not None:
        before = warnings(previous, chance, steps=steps)
        return {k: v for k, v in warnings(record, chance, steps=steps).items() if k in before}
    out = {}
    epoch = record["epoch"]
    held = "val" if "val" in chance and "val_acc" in record else "test"
    # a label any patch shows (whole photos of two kinds) is learned with a uniform attention:
    # uniform is named only where the held-out split is not clearly above chance
    learns = held in chance and f"{held}_acc" in record and record[f"{held}_acc"] >= chance[held] + LEARNS
    moved = record.get("attention_moved")
    if moved is not None and moved < MOVED_MIN and not learns:
        out["uniform"] = (
            f"warning: epoch {epoch}: the attention has not moved from where it started ({moved:.3f} nats from it; "
            f"entropy {record.get('entropy', math.nan):.2f}, uniform {record.get('entropy_uniform', math.nan):.2f}):"
            " it has not found what decides the label. Likely: the objects are small against the patches or the "
            f"low-res view, few drawn patches land on them, or too few steps ({steps} an epoch). Try: more --epochs "
            f"or a smaller --batch-size, more --n-patches, a finer --scale, a pretrained --feature-net ({DOCS})")
    if held in chance and "train" in chance and f"{held}_acc" in record:
        acc, train = record[f"{held}_acc"], record["train_acc"]
        if acc <= chance[held] + CHANCE_MARGIN and train >= chance["train"] + CLIMB:
            out["chance"] = (
                f"warning: epoch {epoch}: {held} accuracy {acc:.3f} is chance ({chance[held]:.3f}, the largest "
                f"class) while train accuracy is {train:.3f}: the model learns the training images, not the label. "
                "Likely: too few training images for a feature net from random weights, or the attention is not on "
                f"what decides the label. Try: more images, a pretrained --feature-net, more --n-patches ({DOCS})")
    return out
