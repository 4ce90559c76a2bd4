"""``votes``: each patch's class probabilities are pooled, and the logits are their log.

``v(x) = p(x) = softmax(W f(x))`` and the logits are ``log E_a[p]``: a soft vote. Why: where
the label is a count (the majority of Megapixel MNIST's digits), an average of features
lets one confident patch outweigh several less confident ones; a vote gives each at most
its attention's share. A patch that shows nothing of any class and gives equal logits adds
the same to every class, so it cannot tip the vote.

``none_class``: one more logit per patch, from the pooling's own head ``none`` (a linear
map of the feature), for "no class here"; a patch's vote is the classes' share of the
softmax over all of them. A patch read as none (noise, background) then votes little,
where without it it must spread a whole vote over the classes.

Unbiased: ``p`` (with or without the none logit) is a function of the patch alone,
deterministic and differentiable, so the estimate of ``E_a[p]`` and both its gradients are
unbiased exactly as for features (:mod:`ats_cli.extensions.pooling`); the log is the
readout, the model's nonlinearity, as the classifier and its softmax are for features.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ats_cli.extensions.pooling import Pooling, Where
from ats_cli.registry import register_extension

__all__ = ["VotePooling"]


@register_extension("pooling", "votes")
class VotePooling(Pooling):
    def __init__(self, features: int, n_classes: int, *, none_class: bool = False):
        super().__init__()
        self.none = nn.Linear(features, 1) if none_class else None

    def probabilities(self, feats: torch.Tensor, classifier: nn.Linear) -> torch.Tensor:
        """Each patch's vote [..., classes] (float32 even under autocast: the estimator's
        weights multiply it)."""
        logits = classifier(feats).float()
        if self.none is None:
            return logits.softmax(-1)
        return torch.cat([logits, self.none(feats).float()], -1).softmax(-1)[..., :-1]

    def values(self, feats: torch.Tensor, classifier: nn.Linear, where: Where | None = None) -> torch.Tensor:
        return self.probabilities(feats, classifier)

    def readout(self, pooled: torch.Tensor, classifier: nn.Linear) -> torch.Tensor:
        """The log of the pooled votes, floored at the smallest normal number: a class no
        patch voted for stays finite."""
        return pooled.clamp(min=torch.finfo(pooled.dtype).tiny).log()

    def sizes(self, values: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
        """The vote's total: 1, less what the none logit took."""
        return values.sum(-1)
