"""Multi-label tasks: several classes per image (``label`` = ``3;7``), one sigmoid per class.

A dataset is multi-label when its ``dataset.json`` says ``"task": "multilabel"`` or any
``label`` cell holds ``;`` (:func:`ats_cli.data.dataset.load_dataset`); each of its
records carries the multi-hot vector of its classes, an empty cell meaning none. The
model is the same network with the same estimator: what changes is what is read from the
logits.

Why one sigmoid per class (binary cross-entropy on the logits) rather than a softmax:
the classes of a multi-label image are not exclusive, so their probabilities need not
sum to 1; a softmax would make every present class compete with the others for one unit
of mass, and the probability of each would fall as more are present. With a sigmoid per
class each class is its own binary question on the same pooled feature, and the
estimator stays what it was: the attention-sampled estimate of ``E_a[f]`` is unbiased
whatever the readout (thesis §3.3.2), and the readout is now ``sigmoid(W E_a[f] + b)``
per class instead of ``softmax(W E_a[f] + b)``.

The decision: a class is predicted when its probability reaches the threshold (0.5 by
default; ``ats predict --threshold``). Metrics (:func:`metrics`): per class precision,
recall and F1 at the threshold and the average precision (threshold-free: the area
under the precision-recall curve as a step function, the mean of the precision at each
positive's rank), their macro means, and the exact match ratio (the share of images whose
whole predicted set is right), which is what ``acc`` means for a multi-label run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where a tensor is used: the dataset reader imports this module
    import torch

__all__ = [
    "nll",
    "DEFAULT_THRESHOLD",
    "NO_CLASS",
    "SEPARATOR",
    "average_precision",
    "class_probabilities",
    "confusion_counts",
    "decide",
    "exact_matches",
    "is_multilabel",
    "loss",
    "macro_f1",
    "metrics",
    "multi_hot",
    "split_label",
]

SEPARATOR = ";"
DEFAULT_THRESHOLD = 0.5
NO_CLASS = "(none)"  # shown (figures, GeoJSON) for a multi-label prediction of no class; the CSV cell is empty


def split_label(cell: str) -> list[str]:
    """``"3;7"`` -> ``["3", "7"]``: the class names of a multi-label cell, stripped, empty
    parts dropped (so ``""`` is the empty set)."""
    return [part.strip() for part in cell.split(SEPARATOR) if part.strip()]


def multi_hot(indices: Sequence[int], n_classes: int) -> tuple[float, ...]:
    """The 0/1 vector of ``indices`` over ``n_classes`` (what a record carries and a batch stacks)."""
    chosen = set(indices)
    return tuple(1.0 if i in chosen else 0.0 for i in range(n_classes))


def is_multilabel(model: Any) -> bool:
    """Whether ``model`` was trained with one sigmoid per class (set from its spec by
    :func:`ats_cli.models.create_model`)."""
    return bool(getattr(model, "multilabel", False))


def class_probabilities(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """Probabilities [..., classes] from ``logits``: a sigmoid per class for a multi-label
    model, else the softmax over the classes."""
    import torch

    logits = logits.float()
    return torch.sigmoid(logits) if is_multilabel(model) else torch.softmax(logits, dim=-1)


def decide(probs: Sequence[float], classes: Sequence[str], threshold: float = DEFAULT_THRESHOLD) -> str:
    """The predicted label set, ``;``-joined in class order ("" when no class reaches ``threshold``)."""
    return SEPARATOR.join(c for c, p in zip(classes, probs, strict=True) if p >= threshold)


def nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The label sets' negative log-likelihood: binary cross-entropy with ``logits`` [N,
    classes], summed over the classes (:func:`loss` says why) and averaged over the N."""
    import torch.nn.functional as F

    return F.binary_cross_entropy_with_logits(logits.float(), target.float(), reduction="none").sum(-1).mean()


def loss(model: Any, out: Any, target: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy with logits, summed over the classes and averaged over the
    images, minus the model's exploration bonus where it has one (thesis eq. 3.21, as
    :meth:`ATSModel.loss` for a single label). ``target`` [B, classes] the multi-hot labels.

    Summed, not averaged, over the classes: the sum is the negative log-likelihood of the
    image's label set under one Bernoulli per class, as the cross-entropy is that of its one
    label, so the entropy weight lambda and the gradient clipping mean what they mean for a
    single label. A mean over 10 classes would shrink the likelihood's gradient tenfold
    against the entropy bonus and keep the attention near uniform."""
    from ats_cli.core.model import exploration

    bce = nll(out.logits, target)
    patch_weight = float(getattr(model, "patch_weight", 0.0))
    if patch_weight and getattr(out, "patch_logits", None) is not None:  # ATSModel.patch_nll, per class
        n = out.patch_logits.shape[1]
        bce = bce + patch_weight * nll(out.patch_logits.flatten(0, 1), target.repeat_interleave(n, 0))
    weight = float(getattr(model, "entropy_weight", 0.0))
    return bce - weight * exploration(out).mean() if weight else bce


def exact_matches(probs: torch.Tensor, target: torch.Tensor, threshold: float = DEFAULT_THRESHOLD) -> int:
    """Images whose predicted set (probability >= ``threshold``) equals their label set."""
    return int(((probs >= threshold) == (target > 0.5)).all(dim=-1).sum())


def confusion_counts(probs: torch.Tensor, target: torch.Tensor, threshold: float = DEFAULT_THRESHOLD
                     ) -> torch.Tensor:
    """[3, classes] float: true positives, false positives, false negatives per class
    (sums: they add over batches and over processes)."""
    import torch

    pred, true = probs >= threshold, target > 0.5
    return torch.stack([(pred & true).sum(0), (pred & ~true).sum(0), (~pred & true).sum(0)]).double()


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _f1(tp: float, fp: float, fn: float) -> float:
    return _ratio(2 * tp, 2 * tp + fp + fn)


def macro_f1(counts: torch.Tensor) -> float:
    """The mean over classes of F1 = 2TP / (2TP + FP + FN) from :func:`confusion_counts`
    (a class that is never present nor predicted scores 0, as scikit-learn's default)."""
    tp, fp, fn = counts.tolist()
    return sum(_f1(*t) for t in zip(tp, fp, fn, strict=True)) / len(tp)


def average_precision(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the precision-recall curve as a step function: the mean, over the
    positives, of the precision among the images scored at least as high (tied scores
    form one threshold, so their order does not matter). NaN without a positive."""
    import torch

    n_pos = int(positive.sum())
    if n_pos == 0:
        return float("nan")
    order = torch.argsort(scores, descending=True, stable=True)
    s, y = scores[order].double(), positive[order].double()
    tp = torch.cumsum(y, 0)
    seen = torch.arange(1, len(s) + 1, dtype=torch.float64)
    last = torch.ones(len(s), dtype=torch.bool)  # the last image of each run of equal scores
    last[:-1] = s[1:] != s[:-1]
    precision, tp_at = (tp / seen)[last], tp[last]
    gained = torch.diff(tp_at, prepend=tp_at.new_zeros(1))  # positives each threshold adds
    return float((gained * precision).sum() / n_pos)


def metrics(probs: torch.Tensor, target: torch.Tensor, classes: Sequence[str],
            threshold: float = DEFAULT_THRESHOLD) -> dict[str, Any]:
    """What a multi-label evaluation reports: ``per_class`` {class: precision, recall, f1,
    ap, support}, ``macro_precision``/``macro_recall``/``macro_f1``, ``mean_ap`` (over the
    classes with a positive), ``exact_match`` and ``n``. ``probs``, ``target``: [N, classes]."""
    probs, target = probs.double(), target.double()
    tp, fp, fn = confusion_counts(probs, target, threshold).tolist()
    per_class = {}
    for j, name in enumerate(classes):
        per_class[str(name)] = {
            "precision": _ratio(tp[j], tp[j] + fp[j]), "recall": _ratio(tp[j], tp[j] + fn[j]),
            "f1": _f1(tp[j], fp[j], fn[j]), "ap": average_precision(probs[:, j], target[:, j] > 0.5),
            "support": int(tp[j] + fn[j])}
    aps = [c["ap"] for c in per_class.values() if c["ap"] == c["ap"]]
    n_cls = max(len(per_class), 1)
    return {
        "per_class": per_class,
        "macro_precision": sum(c["precision"] for c in per_class.values()) / n_cls,
        "macro_recall": sum(c["recall"] for c in per_class.values()) / n_cls,
        "macro_f1": sum(c["f1"] for c in per_class.values()) / n_cls,
        "mean_ap": sum(aps) / len(aps) if aps else float("nan"),
        "exact_match": _ratio(exact_matches(probs, target, threshold), len(probs)),
        "n": len(probs),
        "threshold": threshold,
    }
