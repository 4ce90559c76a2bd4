"""Support: which pixels of the low-res view may be sampled at all.

A support maps the low-res view [B, C, h, w] to a bool map [B, 1, h, w] of the pixels it
keeps. The model keeps an attention cell when any of its pixels is kept by the support and
by the input's own mask (a slide's tissue, passed to the forward pass), gives the other
cells probability exactly 0, and uses the whole map for an image with no cell kept (a
blank image). A row with fewer kept cells than patches keeps its support: sampling without
replacement then takes every kept cell first, and the extra draws have probability 0,
hence weight 0 (wasted work, not a wrong answer).

Why it stays unbiased: the support is a fixed function of the input, part of the
attention distribution; patches are drawn from that distribution and the estimator's
weights are computed for it, so the estimate is unbiased for the expectation under it
(a cell outside the support is simply one of probability 0).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["Support"]


class Support(nn.Module):
    """The interface every support has."""

    def forward(self, low: torch.Tensor) -> torch.Tensor:
        """Bool [B, 1, h, w]: the pixels of the low-res view ``low`` [B, C, h, w] (float,
        [0, 1]) that may be sampled."""
        raise NotImplementedError
