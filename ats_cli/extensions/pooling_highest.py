"""``highest``: the label is the highest class present; the classes are ranked in the order
the dataset lists them.

Where the label of an image is the most severe finding it holds (a slide's grade is its worst
region's grade, a slide is tumour if any region is) or the largest digit of Megapixel MNIST
(IPS's task max), the label is a rule over what is present, not what is most common. The
classifier on pooled features must then learn that rule as one linear map of an average,
which holds only with weights that grow as the classes rise; what it learns from a few
thousand images fits their layouts, not the rule (benchmarks/accuracy.md, IPS's tasks).

So the classifier reads, from the pooled features, whether each class is present,
``q_k = sigmoid(z_k)`` with ``z = W E_a[f] + b``, and the readout applies the rule to it: the
label is k when k is present and no class above it is,

    P(label = k) = q_k * prod_{j > k} (1 - q_j),
    logits_k = log sigmoid(z_k) + sum_{j > k} log sigmoid(-z_j).

The softmax of these logits (cross-entropy, prediction) divides by ``sum_k P(label = k) = 1 -
prod_j (1 - q_j)``: the probability given that some class is present, which every image
holds. An image labelled k trains class k's presence up and the presence of every class
above k down, and says nothing of the classes below it, which is what its label tells.

Unbiased: the pooled values are the features, as for ``features`` (:mod:`.pooling`); the
readout is a deterministic function of their estimate, the model's nonlinearity, as the
classifier and its softmax are.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.extensions.pooling import FeaturePooling
from ats_cli.registry import register_extension

__all__ = ["HighestPooling", "highest_logits"]


def highest_logits(presence: torch.Tensor) -> torch.Tensor:
    """``log P(label = k)`` [..., K] from presence logits ``presence`` [..., K] (class k
    ranked above every class before it): ``log sigmoid(z_k) + sum_{j > k} log sigmoid(-z_j)``."""
    absent = F.logsigmoid(-presence.float())
    # sum over j > k: the reversed cumulative sum, shifted by one (the last class has none above)
    above = absent.flip(-1).cumsum(-1).flip(-1) - absent
    return F.logsigmoid(presence.float()) + above


@register_extension("pooling", "highest", note="the label is the highest class present: a grade, task max")
class HighestPooling(FeaturePooling):
    """Pooled features, as the thesis's; the classifier's logits read as each class's
    presence, and the label as the highest class present (:func:`highest_logits`)."""

    def readout(self, pooled: torch.Tensor, classifier: nn.Linear) -> torch.Tensor:
        return highest_logits(classifier(pooled))
