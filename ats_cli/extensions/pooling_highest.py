"""``highest`` and ``highest-counts``: the label is the highest class present; the classes are
ranked in the order the dataset lists them.

Where the label of an image is the most severe finding it holds (a slide's grade is its worst
region's grade, a slide is tumour if any region is) or the largest digit of Megapixel MNIST
(IPS's task max), the label is a rule over what is present, not what is most common. The
classifier on pooled features must then learn that rule as one linear map of an average,
which holds only with weights that grow as the classes rise; what it learns from a few
thousand images fits their layouts, not the rule. Both poolings read, from the estimate,
whether each class is present, ``q_k``, and apply the rule: the label is k when k is
present and no class above it is,

    P(label = k) = q_k * prod_{j > k} (1 - q_j).

Training takes ``-log P(label = y)`` as it stands (:class:`RuleLikelihood`), not its
cross-entropy; prediction's softmax divides by ``sum_k P(label = k) = 1 - prod_j (1 - q_j)``,
which changes no argmax. An image labelled k trains class k's presence up and the presence
of every class above k down, and says nothing of the classes below it, which is what its
label tells.

``highest``: the thesis's pooled features; the classifier's logits read as presence,
``q_k = sigmoid(z_k)``, ``z = W E_a[f] + b``, so ``logits_k = log sigmoid(z_k) + sum_{j > k}
log sigmoid(-z_j)``. A class is present by how much of the attention it holds, so a class
shown once, under a fifth of the mass, must pass the same threshold as one shown thrice.

``highest-counts``: the counts of :mod:`.pooling_counts` (each object once, whatever its
attention mass), ``c_k`` the estimated number of class-k objects, and presence as for a
Poisson count of mean ``c_k``: ``q_k = 1 - exp(-c_k)``, ``1 - q_j = exp(-c_j)``, so
``logits_k = log(1 - exp(-c_k)) - sum_{j > k} c_j``. An object shown once counts as much as
each of three; its options are counts' (``none_class``: noise read as none counts for no
class; ``floor``). One attention grid, as counts.

Unbiased: the pooled values are the features (``highest``) or the counts
(``highest-counts``), each estimated without bias in value and gradient as its own module
shows; the readout is a deterministic function of that estimate, the model's nonlinearity,
as the classifier and its softmax are (tests/test_extensions.py checks what each readout
reads, and that the readout's own logits fail that check).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.extensions.pooling import FeaturePooling
from ats_cli.extensions.pooling_counts import CountPooling
from ats_cli.registry import register_extension

__all__ = ["HighestPooling", "HighestCountPooling", "RuleLikelihood", "highest_logits", "highest_count_logits",
           "poisson_presence"]


def _above(x: torch.Tensor) -> torch.Tensor:
    """``sum_{j > k} x_j`` for every k [..., K]: the reversed cumulative sum less the term itself."""
    return x.flip(-1).cumsum(-1).flip(-1) - x


def highest_logits(presence: torch.Tensor) -> torch.Tensor:
    """``log P(label = k)`` [..., K] from presence logits ``presence`` [..., K] (class k
    ranked above every class before it): ``log sigmoid(z_k) + sum_{j > k} log sigmoid(-z_j)``."""
    z = presence.float()
    return F.logsigmoid(z) + _above(F.logsigmoid(-z))


def poisson_presence(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c, log q)``: expected counts floored at 1e-6 (a class no patch voted for keeps a
    finite logit, about log 1e-6), and the log of their presence as Poisson means, ``log q =
    log(1 - exp(-c))``; ``log(1 - q) = -c``. The counts readouts' shared reading."""
    c = counts.float().clamp(min=1e-6)
    return c, torch.log(-torch.expm1(-c))


def highest_count_logits(counts: torch.Tensor) -> torch.Tensor:
    """``log P(label = k)`` [..., K] from expected counts ``counts`` [..., K] >= 0, each a
    Poisson mean (:func:`poisson_presence`): ``log(1 - exp(-c_k)) - sum_{j > k} c_j``."""
    c, present = poisson_presence(counts)
    return present - _above(c)


class RuleLikelihood:
    """For a pooling whose logits are ``log P(label = k)`` under a presence model (the rule
    poolings: this module's and :mod:`.pooling_topmost`): the loss is ``-log P(label = y)``,
    not the cross-entropy of the logits.

    Why: those probabilities leave out the outcome "nothing present", ``prod_j (1 - q_j)``
    (``exp(-sum c)`` for counts), so they sum to less than 1. The cross-entropy divides by
    their sum, i.e. it conditions on something being present, and then scale goes unseen:
    with every count small, ``P(label = k) ~ c_k``, and dividing every count by ten leaves the
    conditioned probabilities ``c_k / sum_j c_j`` as they were. Training can then settle where
    no object is counted near once, and the rule turns into a vote by mass: the class with the
    largest of the small counts wins, which is wrong exactly where the label's class is shown
    once and a lower one three times. It did, on IPS's task max
    (benchmarks/accuracy.md#what-each-default-brought). Unconditioned, the label's class is
    only likely once it is counted as present
    (an object's worth: ``c_y`` of 1 or more, ``q_y`` of 0.63 or more) and every class above it
    as absent; every image holds some object, so the left-out outcome only ever costs.

    ``P(label = y) <= 1`` for every rule here (for topmost: ``c_{r,y} <= C_r``, so ``P <= 1 -
    exp(-sum_r C_r)``), so the loss is >= 0. Unbiasedness is not touched: the estimate of
    ``E_a[v]`` is the same, only the function of the logits the loss takes differs.
    """

    def nll(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return -logits.float().gather(-1, target[:, None]).mean()


@register_extension("pooling", "highest")
class HighestPooling(RuleLikelihood, FeaturePooling):
    """Pooled features, as the thesis's; the classifier's logits read as each class's
    presence, and the label as the highest class present (:func:`highest_logits`)."""

    def readout(self, pooled: torch.Tensor, classifier: nn.Linear) -> torch.Tensor:
        return highest_logits(classifier(pooled))


@register_extension("pooling", "highest-counts")
class HighestCountPooling(RuleLikelihood, CountPooling):
    """Counts, as :class:`~ats_cli.extensions.pooling_counts.CountPooling`; the label read
    as the highest class present (:func:`highest_count_logits`)."""

    def readout(self, pooled: torch.Tensor, classifier: nn.Linear) -> torch.Tensor:
        return highest_count_logits(pooled)
