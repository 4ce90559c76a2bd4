"""Pooling: what the estimator averages over the drawn patches, and how the logits are read
from the estimate. The base of every pooling, and ``features``, the thesis's.

The model's prediction is ``g(E_a[v])``: ``v_i`` the value pooled for cell i, ``E_a[v] =
sum_i a_i v_i`` estimated from the draws (:func:`ats_cli.core.sampling.expectation`), ``g``
the readout. The estimate is unbiased in value and in the gradient of every parameter for
ANY values that are, per cell, a deterministic differentiable function of the parameters
and the input, computed the same whichever cells are drawn: step (*) of that derivation
holds for every choice of vectors. So a pooling is free to choose ``v`` under that one
condition; ``g`` may be nonlinear (the classifier's softmax already is), what is unbiased is
the estimate of ``E_a[v]``, as in the thesis.

``features`` (the thesis, the default): ``v = f``, the patch's feature, ``g`` = the
classifier. Unbiased: ``f`` is a function of the patch alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.registry import register_extension

__all__ = ["Pooling", "FeaturePooling", "Where"]


@dataclass
class Where:
    """Where the pooled patches were drawn, for a pooling whose value of a cell depends on
    the attention around it (:mod:`ats_cli.extensions.pooling_counts`)."""

    probs: torch.Tensor  # [B, K] the attention over the grid
    att_shape: tuple[int, int]  # (att_h, att_w), K = att_h * att_w
    indices: torch.Tensor  # [B, n] the cells the values are for
    sizes: torch.Tensor  # [B, 2] the full-resolution (H, W) of each image: the cell size
    patch_size: tuple[int, int]  # full-resolution (ph, pw)
    # the same sizes as host ints, for choices made on the host (a window's size): reading
    # ``sizes`` there would wait for the device if they lived on it; () = read ``sizes``
    shapes: tuple[tuple[int, int], ...] | list[tuple[int, int]] = ()
    # each image's own attention grid (att_h, att_w) in the top-left corner of ``att_shape``
    # when the batch's views differ in size and were padded (ats_cli.core.model.ATSModel.forward:
    # its cells' size is that grid's); () = every image's grid is ``att_shape``
    grids: tuple[tuple[int, int], ...] | list[tuple[int, int]] = ()


class Pooling(nn.Module):
    """The interface every pooling has. ``none``: a pooling's own per-patch "no class here"
    head (``nn.Linear(D, 1)``), None where it has none."""

    def __init__(self):
        super().__init__()
        self.none: nn.Linear | None = None

    def values(self, feats: torch.Tensor, classifier: nn.Linear, where: Where | None = None) -> torch.Tensor:
        """The values ``v`` [B, n, V] the estimator averages, for the draws' features ``feats``
        [B, n, D] (unit-norm, scaled, times their gain where the model has one)."""
        raise NotImplementedError

    def readout(self, pooled: torch.Tensor, classifier: nn.Linear) -> torch.Tensor:
        """Logits [B, classes] from the estimate of ``E_a[v]`` [B, V]."""
        raise NotImplementedError

    def nll(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The training loss's likelihood term, averaged over the batch: the negative log of
        the probability the readout's ``logits`` [B, classes] give the label ``target`` [B].
        The cross-entropy, i.e. the logits read through a softmax; a pooling whose logits are
        already log-probabilities says so here (:mod:`.pooling_highest`)."""
        return F.cross_entropy(logits, target)

    def sizes(self, values: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
        """How much each draw's value [B, n, V] weighs in the estimate, in one number [B, n]
        (``gain`` [B, n] the draws' gains or None): times the draw's estimator weight, its
        contribution, by which figures rank and draw the patches."""
        raise NotImplementedError


@register_extension("pooling", "features")
class FeaturePooling(Pooling):
    """The thesis's pooling: the features, then the classifier."""

    def __init__(self, features: int, n_classes: int):
        super().__init__()

    def values(self, feats: torch.Tensor, classifier: nn.Linear, where: Where | None = None) -> torch.Tensor:
        return feats

    def readout(self, pooled: torch.Tensor, classifier: nn.Linear) -> torch.Tensor:
        return classifier(pooled)

    def sizes(self, values: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
        """The gain: every unit feature has the same norm, so a draw's feature weighs its gain
        times any other's of gain 1 (1 without a gain)."""
        return torch.ones(values.shape[:-1], dtype=values.dtype, device=values.device) if gain is None else gain
