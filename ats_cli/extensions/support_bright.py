"""``bright``: a cell is never sampled unless one of its pixels is brighter than ``threshold``.

A pixel is kept when its brightest channel exceeds the threshold. Why: on a black canvas
(Megapixel MNIST) almost every cell is empty, and a uniform attention at initialisation
spends nearly every draw on them, so neither network gets a signal for many steps; keeping
only the cells that hold something shrinks the search from every cell to the few hundred
that can matter. Images with a light background (slides) use their tissue mask instead.

Unbiased: a fixed function of the input, part of the distribution the draws come from
and the weights are computed for (:mod:`ats_cli.extensions.support`).
"""

from __future__ import annotations

import torch

from ats_cli.extensions.support import Support
from ats_cli.registry import ExtensionError, register_extension

__all__ = ["BrightSupport"]


@register_extension("support", "bright")
class BrightSupport(Support):
    def __init__(self, *, threshold: float):
        super().__init__()
        if not 0 < threshold < 1:
            raise ExtensionError(f"support 'bright': threshold must be in (0, 1), got {threshold}")
        self.threshold = float(threshold)

    def forward(self, low: torch.Tensor) -> torch.Tensor:
        return low.amax(1, keepdim=True) > self.threshold
