"""How good the predictions are, when the inputs came with labels (a dataset CSV or
directory): accuracy and a confusion matrix over the rows that were predicted; for a
multi-label model the per-class and macro scores of :mod:`ats_cli.multilabel`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ats_cli.multilabel import metrics, multi_hot, split_label
from ats_cli.predict.predictor import PredictionRow

__all__ = ["Evaluation", "evaluate", "evaluate_multilabel"]


@dataclass(frozen=True)
class Evaluation:
    """Accuracy over the predicted rows that have a label, and the confusion matrix
    ``matrix[i][j]`` = images of label ``labels[i]`` predicted as ``classes[j]``.
    ``labels`` is the model's classes followed by any label the model does not know
    (those rows can never be right, and hiding them would overstate accuracy)."""

    n: int
    correct: int
    labels: list[str]
    classes: list[str]
    matrix: list[list[int]]

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else float("nan")

    @property
    def unknown_labels(self) -> list[str]:
        return self.labels[len(self.classes):]


def evaluate(rows: Sequence[PredictionRow], classes: Sequence[str]) -> Evaluation | None:
    """Accuracy and confusion matrix of the labelled, successful rows; None if there are none.
    An empty label cell is no label here: a single-label image has one class."""
    scored = [r for r in rows if r.ok and r.label]
    if not scored:
        return None
    classes = [str(c) for c in classes]
    labels = classes + sorted({r.label for r in scored if r.label not in classes})
    li = {name: i for i, name in enumerate(labels)}
    ci = {name: i for i, name in enumerate(classes)}
    matrix = [[0] * len(classes) for _ in labels]
    for r in scored:
        matrix[li[r.label]][ci[r.prediction]] += 1
    correct = sum(r.label == r.prediction for r in scored)
    return Evaluation(n=len(scored), correct=correct, labels=labels, classes=classes, matrix=matrix)


def evaluate_multilabel(rows: Sequence[PredictionRow], classes: Sequence[str], threshold: float
                        ) -> dict[str, Any] | None:
    """:func:`ats_cli.multilabel.metrics` of the labelled, successful rows of a multi-label
    model (each label a ``;``-separated set, in any order), plus ``unknown_labels``: names
    in the labels that are not the model's classes (left out; listed so they are not
    silently lost). None without labelled rows.

    An empty label cell is a label, the empty set (no class present: a slide without any
    of the findings), as it is in a multi-label dataset that ``ats train`` evaluates
    (:func:`ats_cli.train.evaluate` counts every row); leaving those rows out reported a
    lower exact match than the model's, the empty sets it got right uncounted."""
    import torch

    scored = [r for r in rows if r.ok and r.label is not None]
    if not scored:
        return None
    classes = [str(c) for c in classes]
    index = {c: i for i, c in enumerate(classes)}
    names = [split_label(r.label) for r in scored]
    unknown = sorted({n for row in names for n in row if n not in index})
    target = torch.tensor([multi_hot([index[n] for n in row if n in index], len(classes)) for row in names])
    probs = torch.tensor([list(r.probs) for r in scored], dtype=torch.float64)
    return {**metrics(probs, target, classes, threshold), "unknown_labels": unknown}
