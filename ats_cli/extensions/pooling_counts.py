"""``counts``: each patch's vote divided by the attention mass around its cell, so that every
object counts once, whatever attention it got.

``v_i = p_i / max(M_i, floor)``, ``p_i`` the vote of :mod:`ats_cli.extensions.pooling_votes`
(with its ``none_class``) and ``M_i`` the attention mass of the cells whose centres lie
within one patch of cell i (:func:`local_mass`). The logits are the log of the estimated
counts per class. Why: a vote weighs each object by the attention mass it got, and a
learned attention is uneven, so a majority of objects can lose to a minority that drew
more mass.

Derivation: for an object whose cells R lie within one patch of each other, with no other
mass near, ``M_i = a(R)`` for i in R, so ``sum_{i in R} a_i / M_i = 1``: the object adds
its class probabilities once. ``floor``: an object with at least that share of the
attention counts once, one with less counts ``a(R) / floor``, in proportion to its mass as
in a vote; 0 is the pure count, 1 the vote (``M <= 1``). Why a floor: counted once each,
many small objects of noise that each hold a sliver of the mass would outvote the few
objects the label is about on what little they misread; weighed by their mass they do not.
``eval_floor`` (None: ``floor``): the floor read at evaluation and prediction. In training
the floor also teaches: under it an object counts by its mass, so the likelihood pulls the
attention onto every object the label needs. At reading, an object the learned attention
gives less than its share (unseen clutter draws mass away) would count as a fraction of
one while it is read with confidence; a lower reading floor counts it once and still keeps
the slivers out (:func:`ats_cli.config._eval_count_floor`; figures:
benchmarks/accuracy.md#reading-floor). Both floors give an unbiased estimate: each is a constant.

Unbiased: ``M`` comes from the whole attention map, not from the draws, so ``v_i`` is a
deterministic, differentiable function of the parameters for every cell, and step (*) of
:func:`ats_cli.core.sampling.expectation` holds unchanged for the value and both gradients
(the attention's gradient now also flows through ``M``, exactly, since ``M`` is computed
for the drawn cells from the full map). And ``a_i / max(M_i, floor) <= 1``: no draw weighs
more than in a vote.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.extensions.pooling import Where
from ats_cli.extensions.pooling_votes import VotePooling
from ats_cli.registry import ExtensionError, register_extension

__all__ = ["CountPooling", "local_mass"]


def local_mass(probs: torch.Tensor, att_shape: tuple[int, int], sizes: torch.Tensor | Sequence[tuple[int, int]],
               patch_size: tuple[int, int], grids: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
    """[B, K]: for every cell, the attention mass of the cells whose centres lie within one
    patch of it (a window of ``ceil(patch / cell)`` cells, made odd), with ``probs`` [B, K]
    over the attention grid ``att_shape`` and ``sizes`` the full-resolution (H, W) of each
    image, which sets the cell size: host ints, or a [B, 2] tensor (read on the host).
    ``grids``: each image's own grid within ``att_shape`` when a batch of views of different
    sizes was padded (:class:`~ats_cli.extensions.pooling.Where`); its cells' size is its
    own, and the padding around it holds no mass, as the zeros beyond its border do alone."""
    h, w = att_shape
    out = probs.new_empty(probs.shape)
    pairs = sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes
    own = grids or [(h, w)] * len(pairs)
    windows = [(math.ceil(patch_size[0] * gh / float(H)) | 1, math.ceil(patch_size[1] * gw / float(W)) | 1)
               for (H, W), (gh, gw) in zip(pairs, own, strict=True)]
    for window in set(windows):
        # one window for the batch (images of one size): the whole batch, no index list to copy
        rows = slice(None) if len(set(windows)) == 1 else [b for b, k in enumerate(windows) if k == window]
        grid = probs[rows].view(-1, 1, h, w)
        summed = F.avg_pool2d(grid, window, stride=1, padding=(window[0] // 2, window[1] // 2),
                              count_include_pad=True) * (window[0] * window[1])
        out[rows] = summed.view(grid.shape[0], -1)
    return out


@register_extension("pooling", "counts")
class CountPooling(VotePooling):
    def __init__(self, features: int, n_classes: int, *, none_class: bool = False, floor: float = 0.0,
                 eval_floor: float | None = None):
        for name, value in (("floor", floor), ("eval_floor", floor if eval_floor is None else eval_floor)):
            if not 0 <= value <= 1:
                raise ExtensionError(f"pooling 'counts': {name} must be in [0, 1], got {value}")
        super().__init__(features, n_classes, none_class=none_class)
        self.floor = float(floor)
        self.eval_floor = None if eval_floor is None else float(eval_floor)

    @property
    def floor_now(self) -> float:
        """The floor in use: ``floor`` in training, ``eval_floor`` (when set) in eval mode."""
        return self.floor if self.training or self.eval_floor is None else self.eval_floor

    def values(self, feats: torch.Tensor, classifier: nn.Linear, where: Where | None = None) -> torch.Tensor:
        if where is None:
            raise ValueError("pooling 'counts' needs the attention around the draws (where)")
        mass = local_mass(where.probs, where.att_shape, where.shapes or where.sizes, where.patch_size, where.grids)
        return self.count(self.probabilities(feats, classifier), mass.gather(1, where.indices))

    def count(self, votes: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """Votes [..., classes] over their cells' mass [...], floored."""
        return votes / mass.float().clamp(min=max(self.floor_now, torch.finfo(torch.float32).tiny))[..., None]
