"""``learned``: ``g(x) = softplus(w . phi(x) + b)``, ``phi`` the patch's raw feature; 1 for
every patch at the start (w = 0, b = log(e - 1)), so training starts from the unit-norm model.

Why: the pooled feature is the attention-weighted mean, so where a label is decided by one
small region among look-alikes the attention cannot tell apart at low resolution (one
tumour nest among decoy clusters), that region gets no more mass than any look-alike and
the look-alikes outvote it; a learned gain lets the patches that show the class carry more
than their share. Where a label counts objects, every object should weigh alike, which the
unit norms give: leave it off there.

Unbiased: a function of the patch alone (:mod:`ats_cli.extensions.gain`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.extensions.gain import Gain
from ats_cli.registry import register_extension

__all__ = ["LearnedGain"]


@register_extension("gain", "learned")
class LearnedGain(Gain):
    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.constant_(self.linear.bias, math.log(math.e - 1.0))

    def forward(self, raw: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.linear(raw))
