"""Position-aware models: each patch's position in the image goes into its feature, and
each low-res cell's into the attention network's input (:class:`PositionalAttention`).

The feature network sees a patch alone, so ``E_a[f(x)]`` knows what was found but not
where; a label that depends on where (IPS's ``top`` task: the class of the top-most digit)
cannot be read from it. The thesis notes (§3.3.3) that the position can be passed to the
feature network. Here it is, after the patch network: with ``p`` the patch centre's
(row, column) divided by the image's (height, width), in [0, 1],

    f(x, p) = f(x) + W2 relu(W1 [f(x), e(p)] + b1),
    e(p) = [p, sin(2^k pi p), cos(2^k pi p) for k < frequencies]

a residual MLP on the feature and a Fourier encoding of the position (the sines let a small
MLP make sharp functions of the position, e.g. "weigh a digit by how high it is"). ``W2``
starts at zero, so training starts from the model without positions.

Unbiased: the pooled quantity stays ``sum_i a_i f(x_i, p_i)``, and ``p_i`` is a
deterministic function of the cell ``i`` drawn (its patch's place in the image), as ``x_i``
is; so ``f(x_i, p_i)`` is a per-cell value computed the same whichever other cells are
drawn, which is all step (*) of :func:`ats_cli.core.sampling.expectation` asks.
tests/test_position.py checks value and gradients by Monte Carlo, beside a variant that
encodes the position relative to the other draws (not a function of the cell alone), which
the same check rejects; and the same for the attention's coordinates, beside a variant
whose coordinates change from one call to the next.

The feature side alone tells the head where each patch was, but the sampler still draws
where a translation-equivariant attention puts its mass, the same for every object that
looks alike; on the top task the two sides together learned what the features alone did
not (benchmarks/accuracy.md#what-each-default-brought). ``position_features on`` gives both; a model
whose spec says ``{"frequencies": ...}`` without ``"attention"`` has the feature side only.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

__all__ = ["PositionFeatures", "PositionalAttention", "patch_centres"]


def patch_centres(offsets: torch.Tensor, sizes: torch.Tensor, patch_size: tuple[int, int]) -> torch.Tensor:
    """[B, n, 2]: each patch's centre (row, column) over its image's (height, width), in
    [0, 1]. ``offsets`` [B, n, 2] the patches' top-left corners at full resolution,
    ``sizes`` [B, 2] the images' (H, W). Clamped: a patch may reach past the border."""
    half = offsets.new_tensor(patch_size, dtype=torch.float32) / 2
    centre = offsets.float() + half
    return (centre / sizes.to(offsets.device).float()[:, None, :]).clamp(0.0, 1.0)


class PositionFeatures(nn.Module):
    """``f(x, p) = f(x) + W2 relu(W1 [f(x), e(p)] + b1)`` (module docstring), the width ``features``
    kept, so the pooling and the classifier take it unchanged."""

    def __init__(self, features: int, *, frequencies: int = 4, hidden: int = 0):
        super().__init__()
        if frequencies < 0:
            raise ValueError(f"frequencies must be >= 0, got {frequencies}")
        self.frequencies = int(frequencies)
        hidden = int(hidden) or features
        self.mix = nn.Linear(features + 2 + 4 * self.frequencies, hidden)
        self.out = nn.Linear(hidden, features, bias=False)
        nn.init.zeros_(self.out.weight)  # start: f(x, p) = f(x), the model without positions

    def encode(self, pos: torch.Tensor) -> torch.Tensor:
        """``e(p)`` [..., 2 + 4 * frequencies]: the position, then its sines and cosines."""
        if not self.frequencies:
            return pos
        scales = math.pi * 2.0 ** torch.arange(self.frequencies, device=pos.device, dtype=pos.dtype)
        angles = (pos[..., None] * scales).flatten(-2)  # [..., 2 * frequencies]
        return torch.cat([pos, angles.sin(), angles.cos()], dim=-1)

    def forward(self, feats: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``feats`` [..., D] and ``pos`` [..., 2] in [0, 1] -> [..., D]."""
        enc = self.encode(pos.to(feats.dtype))
        return feats + self.out(torch.relu(self.mix(torch.cat([feats, enc], dim=-1))))


class PositionalAttention(nn.Module):
    """The attention network fed the low-res view with two more channels, each cell's
    (row, column) over the view's (height, width), in [0, 1] (CoordConv, Liu et al. 2018).

    Why: a convolutional attention net sees a neighbourhood, not where it is, so its map is
    the same wherever an object lies; a label that depends on where (the top-most digit)
    needs the attention to prefer a place, e.g. a logit falling with the row, which the
    softmax turns into a strong preference for the highest object. The feature-side
    positions (:class:`PositionFeatures`) tell the head where a patch was; these tell the
    sampler where to look.

    Unbiased: the attention stays a deterministic function of the view (the coordinates
    are a fixed function of the cell), so the estimator and its gradients are those of any
    attention network (:mod:`ats_cli.core.sampling`); ``net`` is built for ``channels + 2``
    input channels. ``margin`` is the wrapped net's."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.margin = getattr(net, "margin", 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        rows = torch.linspace(0.0, 1.0, h, device=x.device, dtype=x.dtype).view(1, 1, h, 1).expand(b, 1, h, w)
        cols = torch.linspace(0.0, 1.0, w, device=x.device, dtype=x.dtype).view(1, 1, 1, w).expand(b, 1, h, w)
        return self.net(torch.cat([x, rows, cols], dim=1))
