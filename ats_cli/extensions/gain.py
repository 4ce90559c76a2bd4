"""Gain: a non-negative factor on each patch's unit-norm feature, a function of the patch.

The model pools ``g(x) u(x)``, ``u`` the scaled unit-norm feature and ``g(x) >= 0`` the
gain, computed from the same raw feature. Unit norms make sampling from the attention
optimal (thesis 3.3.4) and weigh every patch by its attention alone; a gain gives that up
on purpose, to let a patch that shows the class weigh more than its share of the mass.

Why it stays unbiased: ``g(x) u(x)`` is still a deterministic, differentiable function of
the patch alone, so the estimate of ``E_a[g u]`` and its gradients (the gain's included)
are unbiased by the same argument as for features (:mod:`ats_cli.extensions.pooling`).
What is lost is only the optimality of sampling from ``a``: the variance grows where a
patch of large gain has a small attention.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["Gain"]


class Gain(nn.Module):
    """The interface every gain has."""

    def forward(self, raw: torch.Tensor) -> torch.Tensor:
        """Gains [N, 1] >= 0 of patches whose raw (not normalised) features are ``raw`` [N, D]."""
        raise NotImplementedError
