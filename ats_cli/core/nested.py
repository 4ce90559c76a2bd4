"""Nested (coarse-to-fine) attention sampling: the two-level estimator and the region grid.

A one-level model sees the whole image through one low-res view, which grows with the
image at a fixed scale. The nested model (the thesis's future work, §3.5) looks twice:

    coarse view of the whole image --coarse attention a over K regions--> k regions drawn
    each drawn region r: its own view --fine attention b^r over its cells--> n patches drawn
    pooled = estimate of  sum_r a_r  sum_j b^r_j  v_{r,j}          (v: the pooled values)

so a step reads one coarse view, k region views and k*n patches, whatever the image's size.

Why the estimate, its value and its gradients w.r.t. a, b and v are unbiased (the
thesis's appendix B applied twice; :func:`ats_cli.core.sampling.expectation` holds the
one-level argument, called (*) below: for weights ``w`` of a draw from ``p`` that do not
depend on the vectors, ``E[sum_k w_k x_{i_k}] = sum_i p_i x_i`` for EVERY choice of
vectors ``x``):

1. Inner value. Given region r, the inner estimate ``F_r = sum_j w^r_j v_{r,j}`` (weights
   of n draws from b^r) has ``E[F_r | r] = mu_r := sum_j b^r_j v_{r,j}`` by (*).
2. Outer value. The pooled estimate is ``P = sum_r W_r F_r`` with ``W`` the weights of the
   k regions drawn from a. The inner draws are made after, and independently of, the
   outer ones, and ``W`` is a constant once the regions are drawn, so by the tower
   property ``E[P] = E[ sum_r W_r E[F_r | r] ] = E[ sum_r W_r mu_r ] = sum_r a_r mu_r``,
   the last step (*) applied to the vectors ``mu_r``.
3. Gradients. We back-propagate through the surrogate
   ``S = sum_r W_r (a_r / sg(a_r)) sum_j w^r_j (b^r_j / sg(b^r_j)) v_{r,j}``
   (sg = stop-gradient; its value is P): two nested calls of ``expectation``. For any
   parameter theta, ``dS = sum_r W_r / a_r * d(a_r F~_r)`` where ``F~_r`` is the inner
   surrogate, whose derivative ``dF~_r = sum_j w^r_j / b^r_j d(b^r_j v_{r,j})`` has
   ``E[dF~_r | r] = sum_j d(b^r_j v_{r,j}) = d mu_r`` by (*) on the vectors
   ``d(b_j v_j) / b_j`` (the inner level of appendix B.2/B.3). Since ``d(a_r F~_r) =
   (da_r) F~_r + a_r dF~_r`` is linear in ``F~_r`` and ``dF~_r``, its conditional
   expectation given the regions is ``d(a_r mu_r)``; then (*) on the vectors
   ``d(a_r mu_r) / a_r`` gives ``E[dS] = sum_r d(a_r mu_r) = d sum_r a_r mu_r``. So:
   w.r.t. the coarse attention, ``W_r <g, F_r> / a_r`` (the gradient trick of the outer
   level, with the inner ESTIMATE in place of the region's feature); w.r.t. the fine
   attention ``W_r w^r_j <g, v_{r,j}> / b^r_j``; w.r.t. a value ``W_r w^r_j g``. Each is
   unbiased. tests/test_nested.py checks all four by Monte Carlo, beside biased variants
   (a plain mean over the drawn regions; the outer gradient taken with the unweighted mean
   of a region's draws instead of ``F_r``; the fine gradient without the outer weight).

Each level may use any of the one-level estimators (``threshold``, ``sequential``, with or
without replacement): the argument needs only (*) at each level.

The region grid: regions of ``region`` full-resolution pixels tile the image from its
top-left corner, ``ceil(H / R) x ceil(W / R)`` of them (the last row and column may run
past the image, whose outside reads as zeros, as every patch does).
"""

from __future__ import annotations

import math

import torch

from ats_cli.core.sampling import expectation

__all__ = ["NestedConfigError", "check_regions", "region_grid", "nested_expectation", "cell_regions",
           "region_scores", "region_offsets"]


class NestedConfigError(ValueError):
    """A two-level configuration that cannot work on an image (the message says which flag)."""


def region_grid(image_size: tuple[int, int], region: int) -> tuple[int, int]:
    """(rows, cols) of the grid of ``region``-pixel regions covering an (H, W) image."""
    H, W = image_size
    return math.ceil(H / region), math.ceil(W / region)


def check_regions(image_size: tuple[int, int], region: int, k: int, patch: tuple[int, int] | None = None,
                  name: str = "the image") -> tuple[int, int]:
    """The region grid of an (H, W) image, or :class:`NestedConfigError` in one line for a
    configuration that cannot work: a region larger than the image, more regions to draw
    than the grid holds, a region that is not a multiple of the patch side."""
    H, W = int(image_size[0]), int(image_size[1])
    if region < 1:
        raise NestedConfigError(f"region_size {region}: must be >= 1 pixel")
    if patch is not None and (region % patch[0] or region % patch[1]):
        raise NestedConfigError(f"region_size {region} is not a multiple of the patch side {patch[0]}: the "
                                f"patches of a region would not tile it")
    if region > H or region > W:
        raise NestedConfigError(f"region_size {region} is larger than {name} ({W}x{H} pixels); give a smaller "
                                "region_size, or levels 1")
    grid = region_grid((H, W), region)
    if k > grid[0] * grid[1]:
        raise NestedConfigError(f"regions {k}: {name} ({W}x{H}) holds only {grid[0] * grid[1]} regions of "
                                f"{region} pixels ({grid[1]}x{grid[0]}); draw fewer or give smaller regions")
    return grid


def nested_expectation(
    values: torch.Tensor,
    region_probs: torch.Tensor,
    patch_probs: torch.Tensor,
    region_weights: torch.Tensor,
    patch_weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The nested estimate [B, V] of ``sum_r a_r sum_j b^r_j v_{r,j}`` and the inner
    estimates ``F_r`` [B, k, V], from the drawn values [B, k, n, V], the coarse attention at
    the drawn regions [B, k] (differentiable), the fine attention at the drawn patches
    [B, k, n] (differentiable) and the two levels' estimator weights (detached; from
    :func:`ats_cli.core.sampling.estimator_weights`). The module docstring derives why the
    value and every gradient are unbiased."""
    B, k, n, V = values.shape
    inner = expectation(values.reshape(B * k, n, V), patch_probs.reshape(B * k, n),
                        weights=patch_weights.reshape(B * k, n)).view(B, k, V)
    return expectation(inner, region_probs, weights=region_weights), inner


def cell_regions(att_shape: tuple[int, int], low_size: tuple[int, int], margin: int, image_size: tuple[int, int],
                 region: int, device: torch.device | None = None) -> torch.Tensor:
    """[att_h * att_w] the region (flat index on :func:`region_grid`) each attention cell of
    the coarse view falls in, by the full-resolution position of its centre (the mapping
    :func:`ats_cli.core.source.positions_to_offsets` uses for patches)."""
    att_h, att_w = att_shape
    low_h, low_w = low_size
    H, W = image_size
    rows, cols = region_grid(image_size, region)
    cr = (margin + (torch.arange(att_h, device=device, dtype=torch.float64) + 0.5) * (low_h - 2 * margin) / att_h)
    cc = (margin + (torch.arange(att_w, device=device, dtype=torch.float64) + 0.5) * (low_w - 2 * margin) / att_w)
    rr = torch.floor(cr * (H / low_h) / region).long().clamp_(0, rows - 1)
    rc = torch.floor(cc * (W / low_w) / region).long().clamp_(0, cols - 1)
    return (rr[:, None] * cols + rc[None, :]).flatten()


def region_scores(cell_scores: torch.Tensor, cells: torch.Tensor, n_regions: int,
                  keep: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """[B, n_regions] each region's score, the log of the mean of ``exp`` of its cells'
    scores (``cell_scores`` [B, K] of the coarse attention map, ``cells`` [K] from
    :func:`cell_regions`); -inf for a region with no cell, or none kept by ``keep`` [B, K]
    (e.g. tissue): such a region is never drawn.

    So the coarse attention ``a = softmax(region scores)`` gives each region the mean of
    its cells' unnormalised attention ``exp(s_i)``: what a one-level attention over the
    coarse cells would give the region, divided by its number of cells. Why the log-mean-exp
    and not the mean of the scores: the deciding object of a slide is often one cell of a
    region's hundreds (a 4096-pixel region at 64 coarse pixels a side holds 4,096); a mean
    moves by 1/4096 of that cell's score, so no trainable score and no prior could point
    at the region, while the log-mean-exp follows its highest cells (a cell ``L`` above the
    rest lifts its region by about ``L - log(cells)`` once ``exp(L)`` outweighs them). Why
    a mean and not a sum: a region's score does not grow with how many cells of the coarse
    view it happens to hold (the last row and column of the grid, the tissue's edge).
    A function of the coarse view alone, like the mean: the estimator stays unbiased.

    ``temperature`` t: the score is ``t * LME(s / t)``, which runs from the log-mean-exp
    (t = 1) to the largest kept cell (t -> 0). Why: a cell ``L`` above the rest lifts its
    region by about ``L - t log(cells)``, so where one cell of thousands decides (a nest
    of one coarse pixel in a 4096-pixel region at 1/64: ``log(4096)`` = 8.3 nats) a small
    t lets the prior and the net point at the region without first beating that dilution
    (the training key ``region_temperature``). Any t keeps the score a function of the coarse
    view: unbiased, as above."""
    B = cell_scores.shape[0]
    t = float(temperature)
    if not t > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    s = cell_scores.float() / t
    kept = torch.ones_like(s, dtype=torch.bool) if keep is None else keep > 0
    idx = cells.to(s.device).expand(B, -1)
    count = s.new_zeros(B, n_regions).scatter_add(1, idx, kept.to(s.dtype))
    masked = torch.where(kept, s, float("-inf"))
    # the largest kept score of each region, held constant (the log-sum-exp's value and its
    # derivative, the softmax over the region's cells, do not depend on it); finite for a
    # region with no kept cell, which the last line sets to -inf
    top = s.new_full((B, n_regions), float("-inf")).scatter_reduce(1, idx, masked, reduce="amax").detach()
    top = top.clamp(min=torch.finfo(s.dtype).min)
    shifted = torch.where(kept, torch.exp(masked - top.gather(1, idx)), 0.0)
    total = s.new_zeros(B, n_regions).scatter_add(1, idx, shifted)
    score = top + torch.log(total.clamp(min=torch.finfo(s.dtype).tiny)) - torch.log(count.clamp(min=1))
    return torch.where(count > 0, t * score, float("-inf"))


def region_offsets(indices: torch.Tensor, grid: tuple[int, int], region: int) -> torch.Tensor:
    """Top-left corners [B, k, 2] (row, col) in full-resolution pixels of the regions at flat
    grid positions ``indices`` [B, k]."""
    cols = grid[1]
    return torch.stack([torch.div(indices, cols, rounding_mode="floor"), indices % cols], dim=-1) * region
