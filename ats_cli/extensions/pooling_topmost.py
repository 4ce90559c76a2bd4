"""``topmost-counts``: the label is the class of the top-most object; the counts of
:mod:`.pooling_counts`, kept apart by the attention row each was drawn in.

Where the label of an image is the class of the object highest up in it (IPS's task top,
the top-most digit of Megapixel MNIST; a core's label read from its first region along the
axis), the label is a rule over where things are. Features that carry their position
(``position_features``) let the classifier learn that rule from an average, as one linear
map; what it learns from a few thousand images fits their layouts, not the rule
(benchmarks/accuracy.md#what-each-default-brought). This pooling applies the rule itself, as
:mod:`.pooling_highest` does for the highest class, with the rows of the attention grid in
place of the ranks of the classes.

``c_{r,k}``: the estimated number of class-k objects in attention row r (top first), each
object counted once as in ``counts`` (an object over several rows is split among them by
its attention), ``C_r = sum_k c_{r,k}`` and presence that of a Poisson count of mean
``c_{r,k}``. The label is k when some row holds a k and no row above it holds anything:

    P(label = k) = sum_r (1 - exp(-c_{r,k})) * exp(-sum_{s < r} C_s),
    logits_k = logsumexp_r [log(1 - exp(-c_{r,k})) - sum_{s < r} C_s].

Training takes ``-log P(label = y)`` as it stands, as the highest poolings do
(:class:`.pooling_highest.RuleLikelihood`: why). Prediction's softmax divides by their sum,
which also counts an image whose top row holds two classes twice: a tie, which the rule
(IPS's: the higher box edge, then the left-most) settles finer than one row. Why rows of
the grid: they are the finest position the attention has; a coarser band would tie objects a
row apart. Noise read as none (the ``none_class`` option) counts for no class and so stands
above nothing; ``floor`` as counts'.

Unbiased: a cell's values are its counts placed in its own row's slot, ``v_i = c_i ⊗
e_{row(i)}``, and its row is a fact of the cell alone, so ``v_i`` is a per-cell deterministic
function computed the same whichever cells are drawn, and the estimate of ``E_a[v]`` (the
counts per row) is unbiased in value and both gradients as counts' is; the readout is the
model's nonlinearity (tests/test_extensions.py checks the counts per row, and that the
readout's own logits fail that check). One attention grid, as counts.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ats_cli.extensions.pooling import Where
from ats_cli.extensions.pooling_counts import CountPooling
from ats_cli.extensions.pooling_highest import RuleLikelihood, poisson_presence
from ats_cli.registry import register_extension

__all__ = ["TopmostCountPooling", "topmost_count_logits"]


def topmost_count_logits(counts: torch.Tensor) -> torch.Tensor:
    """``log P(label = k)`` [..., K] from expected counts ``counts`` [..., R, K] >= 0 per row
    (top first), each a Poisson mean (:func:`.pooling_highest.poisson_presence`):
    ``logsumexp_r [log(1 - exp(-c_{r,k})) - sum_{s < r} C_s]``."""
    c, present = poisson_presence(counts)
    rows = c.sum(-1)  # [..., R]
    above = rows.cumsum(-1) - rows  # what lies in the rows above each
    return (present - above[..., None]).logsumexp(-2)


@register_extension("pooling", "topmost-counts")
class TopmostCountPooling(RuleLikelihood, CountPooling):
    """Counts, as :class:`~ats_cli.extensions.pooling_counts.CountPooling`, per attention row;
    the label read as the class of the top-most object (:func:`topmost_count_logits`)."""

    def values(self, feats: torch.Tensor, classifier: nn.Linear, where: Where | None = None) -> torch.Tensor:
        counts = super().values(feats, classifier, where)  # [B, n, K]; where checked there
        h, w = where.att_shape
        rows = torch.div(where.indices, w, rounding_mode="floor")  # [B, n]
        placed = counts.new_zeros(*counts.shape[:2], h, counts.shape[-1])
        placed.scatter_(2, rows[..., None, None].expand(-1, -1, 1, counts.shape[-1]), counts[:, :, None, :])
        return placed.flatten(2)  # [B, n, h * K]

    def readout(self, pooled: torch.Tensor, classifier: nn.Linear) -> torch.Tensor:
        return topmost_count_logits(pooled.view(pooled.shape[0], -1, classifier.out_features))
