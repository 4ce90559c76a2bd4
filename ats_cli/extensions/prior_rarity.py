"""``rarity``: the attention starts where the image looks unusual.

The log-prior of a pixel is ``weight * r``, ``r`` = :func:`rarity`, how unusual its colour
is within its own image (1 for a typical pixel): a cell's probability is multiplied by
``exp(weight * r)``, so one twice as unusual as the typical one gets ``e^weight`` times its
mass. Why: at initialisation the attention is uniform over the support, and where the
label hides in a few small regions (a few tumour nests among thousands of tissue cells)
the draws almost never show one, so neither network gets a signal. Regions that decide a
label usually look unlike the rest of the image (dense nuclei on stroma, a digit on a
blank canvas), so the attention starts there, and the attention net, whose last layer
starts at zero, learns its correction on top.

Unbiased: ``r`` is a fixed function of the input, computed without gradient
(:mod:`ats_cli.extensions.prior`).
"""

from __future__ import annotations

import torch

from ats_cli.extensions.prior import Prior
from ats_cli.registry import ExtensionError, register_extension

__all__ = ["RarityPrior", "rarity"]


def rarity(low: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """How unusual each low-res pixel is within its own image, [B, 1, h, w] >= 0.

    ``r = |x - m| / s``: the Euclidean distance of the pixel's colour (all channels) from
    ``m``, the per-channel median over the image's supported pixels (``keep`` [B, 1, h, w],
    None = all), in units of ``s``, the median of those distances: a typical pixel has
    r ~ 1, whatever the stain, brightness or contrast of the image. Medians, not means and
    standard deviations, so that the few unusual pixels being looked for do not set the
    scale they are measured in.
    """
    with torch.no_grad():
        x = low.float()
        out = torch.zeros_like(x[:, :1])
        for b in range(x.shape[0]):
            pixels = x[b].flatten(1)  # [C, h*w]
            chosen = pixels[:, keep[b].flatten()] if keep is not None else pixels
            if chosen.shape[1] == 0:
                chosen = pixels
            centre = chosen.median(dim=1).values[:, None]
            dist = (pixels - centre).norm(dim=0)
            ref = (chosen - centre).norm(dim=0).median().clamp_min(1e-3)
            out[b, 0] = (dist / ref).view(x.shape[-2:])
        return out


@register_extension("prior", "rarity")
class RarityPrior(Prior):
    def __init__(self, *, weight: float):
        super().__init__()
        if not weight > 0:
            raise ExtensionError(f"prior 'rarity': weight must be > 0, got {weight}")
        self.weight = float(weight)

    def forward(self, low: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        return self.weight * rarity(low, keep)
