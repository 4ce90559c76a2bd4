"""Prediction with a trained model: class probabilities averaged over K samplings."""

from __future__ import annotations

import torch

from ats_cli.core.model import ATSModel, ATSOutput
from ats_cli.core.source import Sources
from ats_cli.multilabel import class_probabilities

__all__ = ["predict_probs"]


@torch.no_grad()
def predict_probs(
    model: ATSModel,
    low: torch.Tensor,
    sources: Sources,
    *,
    n_patches: int | None = None,
    samples: int = 1,
    generator: torch.Generator | None = None,
    support_mask: torch.Tensor | None = None,
    view_sizes: torch.Tensor | None = None,
    feature_keys: list[str | None] | None = None,
) -> tuple[torch.Tensor, ATSOutput]:
    """Mean softmax [B, classes] (a sigmoid per class for a multi-label model:
    :mod:`ats_cli.multilabel`) over ``samples`` independent samplings of ``n_patches``
    each (more samplings or more patches: lower variance), and the last sampling's output
    (for heatmaps). The attention map is computed once per sampling; it is cheap.
    ``view_sizes``: each view's own size in a batch of views of different sizes, padded
    (:meth:`ats_cli.core.model.ATSModel.forward`); passed on only when given, as are
    ``feature_keys`` (the images' content keys for the model's feature store)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    total = None
    for _ in range(samples):
        views = {} if view_sizes is None else {"view_sizes": view_sizes}
        if feature_keys is not None:
            views["feature_keys"] = feature_keys
        out = model(low, sources, n_patches=n_patches, generator=generator, support_mask=support_mask, **views)
        p = class_probabilities(model, out.logits)
        total = p if total is None else total + p
    return total / samples, out
