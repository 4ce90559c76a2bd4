"""Prior: a fixed log-prior added to the attention scores before the softmax.

A prior maps the low-res view [B, C, h, w] and the pixels the support keeps to a log-prior
per pixel [B, 1, h, w]; a cell's prior is the largest of its pixels'. The attention net
learns a correction on top of it (it sees the same view, so it can undo the prior where it
misleads).

Why it stays unbiased: the prior is a fixed function of the input, part of the model
(saved in its spec, applied at prediction alike), so the attention is still a
distribution that the patches are drawn from and the estimator's weights are computed
for: the estimate and both its gradients are unbiased for the expectation under it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["Prior"]


class Prior(nn.Module):
    """The interface every prior has."""

    def forward(self, low: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """Log-prior [B, 1, h, w] of the pixels of ``low`` [B, C, h, w] (float, [0, 1]);
        ``keep`` [B, 1, h, w] the pixels that may be sampled (None = all)."""
        raise NotImplementedError

    def within_region(self, low: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """The log-prior inside one region of a two-level model, ``low`` being the region's
        view (:class:`~ats_cli.core.nested_model.NestedATSModel`'s fine level): what
        :meth:`forward` gives, unless a prior spreads its coarse mass on purpose and need
        not within a region (:class:`~ats_cli.extensions.prior_rarity.RarityPrior`'s cap)."""
        return self(low, keep)
