"""Sampling from the attention distribution and the unbiased attention-sampling estimator.

The model is ``Psi(x) = g(sum_i a_i f_i)`` with ``a`` a distribution over K positions.
Attention sampling replaces the sum by a Monte Carlo estimate over n positions drawn
from ``a``, so only n features are ever computed. Two things must then be unbiased:
the value of the estimate, and its gradient with respect to the features AND to the
attention (through which the attention network learns). See :func:`expectation`.
"""

from __future__ import annotations

import torch

__all__ = ["sample", "expectation", "estimator_weights", "attention_distribution", "entropy"]


def _check_probs(probs: torch.Tensor, n: int, replace: bool) -> None:
    if probs.dim() != 2:
        raise ValueError(f"probs must be [B, K], got shape {tuple(probs.shape)}")
    if n < 1:
        raise ValueError(f"the number of samples must be >= 1, got {n}")
    if not replace and n > probs.shape[1]:
        raise ValueError(
            f"cannot draw {n} positions without replacement from only {probs.shape[1]} positions; "
            "use fewer patches, a larger low-resolution view, or sampling with replacement"
        )


def sample(
    probs: torch.Tensor,
    n: int,
    *,
    replace: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``n`` positions per row of ``probs`` [B, K].

    Returns ``(indices, sampled_probs)``: ``indices`` LongTensor [B, n] in draw order and
    ``sampled_probs`` [B, n] = ``probs`` gathered at them (differentiable w.r.t. ``probs``).

    Without replacement we use the Gumbel-top-k trick: ordering positions by
    ``log a_i + G_i`` (G i.i.d. Gumbel) gives exactly the sequential process "draw one
    position from a, remove it, renormalise, repeat" (thesis eq. 3.13), and the sorted
    order of the top-k is the draw order, which the estimator needs. It is one
    vectorised ``topk`` instead of n dependent multinomial draws.
    Positions with probability 0 are only drawn once every positive one is taken;
    the estimator gives them weight 0.
    """
    _check_probs(probs, n, replace)
    p = probs.detach()
    if replace:
        indices = torch.multinomial(p.float(), n, replacement=True, generator=generator)
    else:
        # Uniforms on the generator's device; clamp keeps -log(-log(u)) finite.
        u = torch.rand(p.shape, generator=generator, device=p.device, dtype=torch.float64)
        u = u.clamp_(min=1e-300, max=1.0 - 1e-16)
        gumbel = -torch.log(-torch.log(u))
        keys = torch.log(p.double()) + gumbel  # log(0) = -inf: drawn last, as it should be
        indices = torch.topk(keys, n, dim=1, largest=True, sorted=True).indices
    return indices, probs.gather(1, indices)


def estimator_weights(sampled_probs: torch.Tensor, *, replace: bool = False) -> torch.Tensor:
    """The weights ``w_k`` [B, n] such that the estimate is ``sum_k w_k f_k``.

    With replacement ``w_k = 1/n``. Without replacement, with draw order k = 0..n-1 and
    the probability mass left before draw k, ``pm_k = 1 - sum_{j<k} a_j``, each
    ``F_k = sum_{j<k} a_j f_j + pm_k f_k`` is unbiased for ``sum_i a_i f_i`` (thesis B.3:
    the first terms are exact, the last is an importance-weighted draw from the
    renormalised rest). Averaging the n of them, ``f_k`` appears once with ``pm_k`` and in
    the (n-1-k) later ``F_m`` with ``a_k``, hence ``w_k = (pm_k + (n-1-k) a_k) / n``.
    Computed in float64 so that ``pm_k`` keeps its precision when the first draw takes
    almost all the mass (peaked attention); clamped at 0 against round-off.
    """
    a = sampled_probs.detach()
    n = a.shape[-1]
    if replace:
        return torch.full_like(a, 1.0 / n)
    a64 = a.double()
    exclusive_cumsum = torch.cumsum(a64, dim=-1) - a64
    pm = (1.0 - exclusive_cumsum).clamp_(min=0.0)
    later = torch.arange(n - 1, -1, -1, device=a.device, dtype=torch.float64)  # n-1-k
    return ((pm + later * a64) / n).to(a.dtype)


def expectation(
    features: torch.Tensor,
    sampled_probs: torch.Tensor,
    *,
    replace: bool = False,
) -> torch.Tensor:
    """Unbiased estimate [B, D] of ``sum_i a_i f_i`` from n sampled features [B, n, D].

    Derivation (why the value AND both gradients are unbiased):

    1. Value. The estimate is ``F = sum_k w_k f_{i_k}`` with weights from
       :func:`estimator_weights`. They depend on the draw and on ``a``, never on ``f``,
       and ``E[F] = sum_i a_i f_i`` for EVERY choice of vectors ``f``. Call this (*).
    2. Gradient. ``d/dtheta sum_i a_i f_i = sum_i h_i`` with ``h_i = d(a_i f_i)/dtheta``.
       Apply (*) to the vectors ``h_i / a_i``: ``E[sum_k w_k h_{i_k} / a_{i_k}] = sum_i h_i``.
       So an unbiased gradient is obtained by back-propagating through
       ``sum_k w_k f_{i_k} * a_{i_k} / stop_grad(a_{i_k})``: its value is F, its gradient
       w.r.t. ``f_k`` is ``w_k`` and w.r.t. ``a_k`` is ``w_k <g, f_k> / a_k``. With
       replacement (w = 1/n) this is thesis eq. 3.12.

    The weights are held constant in the backward pass on purpose: differentiating
    ``pm_k`` as the 2019 reference did, or using an inclusive cumulative sum as its 2020
    PyTorch port did, gives a biased attention gradient (tests/test_estimator.py shows
    both failing the Monte Carlo test this implementation passes).

    Stability: the ratio ``a / stop_grad(a)`` is exactly 1 in the forward pass; its
    gradient ``1 / a`` is bounded by clamping the denominator at the smallest normal
    number, and a position of probability 0 has weight 0, so it contributes nothing.
    """
    if features.dim() != 3 or sampled_probs.dim() != 2 or features.shape[:2] != sampled_probs.shape:
        raise ValueError(
            f"features must be [B, n, D] and sampled_probs [B, n]; got {tuple(features.shape)} "
            f"and {tuple(sampled_probs.shape)}"
        )
    w = estimator_weights(sampled_probs, replace=replace)
    a = sampled_probs
    tiny = torch.finfo(a.dtype).tiny
    ratio = a / a.detach().clamp(min=tiny)  # == 1, carries d/da = 1/a
    # Under autocast the features may be float16/bfloat16; the weights w can span many
    # orders of magnitude (1/a for tiny a), so the weighted sum runs in >= float32.
    dtype = torch.promote_types(features.dtype, torch.float32)
    with torch.autocast(features.device.type, enabled=False):
        return torch.einsum("bn,bnd->bd", (w * ratio).to(dtype), features.to(dtype))


def attention_distribution(
    scores: torch.Tensor, smoothing: float = 0.0, support: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax over ALL positions of an attention map [B, ...] -> probabilities [B, K].

    ``support`` (bool, same shape as ``scores``) restricts the distribution to some
    positions (e.g. not the empty background); the others get probability exactly 0 and
    are never sampled. ``smoothing`` s mixes in the uniform distribution over the
    support, ``a (1 - s) + s / |support|``, so that no supported position has
    probability 0 (every position stays reachable and the importance weights 1/a stay
    bounded); the reference used s=1e-5 on Megapixel MNIST. The softmax runs in float32
    even under autocast, since the estimator divides by it.
    """
    flat = scores.flatten(1).float()
    if support is not None:
        keep = support.flatten(1).to(flat.device)
        if not keep.any(1).all():
            raise ValueError("support mask is empty for some image")
        flat = flat.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(flat, dim=1)
    if smoothing:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        uniform = torch.full_like(probs, 1.0 / flat.shape[1]) if support is None else keep / keep.sum(1, True)
        probs = probs * (1.0 - smoothing) + smoothing * uniform
    return probs


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy [B] of each row of ``probs`` [B, K] in nats, for the ``-lambda * H(a)``
    regulariser (thesis eq. 3.21) that keeps the attention exploring early in training.
    ``0 log 0`` is taken as 0; the softmax backward multiplies by ``a`` so a position of
    probability 0 receives no gradient."""
    logp = torch.log(probs.clamp(min=torch.finfo(probs.dtype).tiny))
    return -(probs * logp).sum(dim=1)
