"""Sampling from the attention distribution and the unbiased attention-sampling estimator.

The model is ``Psi(x) = g(sum_i a_i f_i)`` with ``a`` a distribution over K positions.
Attention sampling replaces the sum by a Monte Carlo estimate over n positions drawn
from ``a``, so only n features are ever computed. Two things must then be unbiased:
the value of the estimate, and its gradient with respect to the features AND to the
attention (through which the attention network learns). See :func:`expectation`.

Two unbiased estimators share that machinery; they differ only in the weights given to
the sampled features, so they have the same expectation and a model trained with one
can predict with the other (``ESTIMATORS``):

* ``sequential``: the thesis's estimator (appendix B.3), the average of the n
  "exact prefix + importance-weighted next draw" estimates. Its weights always sum to 1,
  which keeps the pooled feature's size steady when n is small next to the cells the
  attention spreads over; but they depend on the draw ORDER, so its direction stays
  noisy even when the n draws hold nearly all the mass (it is not exact even when every
  position is drawn).
* ``threshold``: Horvitz-Thompson weights ``a_i / q_i``, ``q_i`` the inclusion
  probability of Gumbel-top-k sampling given the (n+1)-th key. A position the attention
  clearly favours gets weight ~``a_i`` (its term is almost exact), so with n at least
  the attention's effective number of cells the estimate is nearly exact (exact when
  every positive position is drawn); with fewer, its weights' sum wanders around 1.
* ``auto`` (the default) chooses between them. In training (here, in
  :func:`estimator_threshold`) it takes, per image, ``threshold`` when n >= the
  attention's perplexity ``exp(H(a))`` and ``sequential`` otherwise: the one with the
  smaller squared error of the pooled feature, which is what the gradient carries. The
  choice depends on ``a`` and n only, never on the draw, so the estimate stays unbiased.
  For prediction :class:`~ats_cli.core.model.ATSModel` in eval mode uses ``threshold``,
  which evaluation draws many patches for: a position the attention clearly favours then
  enters almost exactly, so the estimate's direction, which sets the arg-max, is nearly
  that of the exact expectation; its error is mostly in the pooled feature's size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ESTIMATORS", "Draw", "sample", "expectation", "estimator_weights", "estimator_threshold",
           "attention_distribution", "entropy", "prior_divergence"]

ESTIMATORS = ("auto", "threshold", "sequential")


class Draw(NamedTuple):
    """What :func:`sample` drew for a batch of attention distributions."""

    indices: torch.Tensor  # [B, n] positions, in draw order
    probs: torch.Tensor  # [B, n] the attention at them (differentiable)
    threshold: torch.Tensor | None  # [B] float64 (n+1)-th Gumbel key (-inf: none); None with replacement


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
    exists: torch.Tensor | None = None,
) -> Draw:
    """Draw ``n`` positions per row of ``probs`` [B, K].

    Returns a :class:`Draw`: ``indices`` LongTensor [B, n] in draw order, ``probs`` [B, n]
    = ``probs`` gathered at them (differentiable w.r.t. ``probs``) and, without
    replacement, ``threshold`` [B]: the (n+1)-th largest key, which the ``threshold``
    estimator needs (-inf when fewer than n+1 positions have probability > 0, or n = K).

    Without replacement we use the Gumbel-top-k trick: ordering positions by
    ``log a_i + G_i`` (G i.i.d. Gumbel) gives exactly the sequential process "draw one
    position from a, remove it, renormalise, repeat" (thesis eq. 3.13), and the sorted
    order of the top-k is the draw order, which the estimator needs. It is one
    vectorised ``topk`` instead of n dependent multinomial draws.
    Positions with probability 0 are only drawn once every positive one is taken;
    the estimator gives them weight 0.

    ``exists`` (bool [B, K], None = all): the positions that are cells of the image, the
    others being the padding of a batch of views of different sizes. Those are never
    drawn, as long as every image has at least ``n`` (without replacement; the caller
    checks, on the host, what would be refused for that image alone): the positions of
    probability 0 an image must fill up with are its own, ranked above every padded one.
    The keys of the existing positions are those the same uniforms give without padding,
    and so is the threshold.
    """
    _check_probs(probs, n, replace)
    p = probs.detach()
    if replace:
        indices = torch.multinomial(p.float(), n, replacement=True, generator=generator)
    else:
        # Uniforms on p's device (the generator must live there too); clamp keeps -log(-log(u)) finite.
        u = torch.rand(p.shape, generator=generator, device=p.device, dtype=torch.float64)
        u = u.clamp_(min=1e-300, max=1.0 - 1e-16)
        gumbel = -torch.log(-torch.log(u))
        keys = torch.log(p.double()) + gumbel  # log(0) = -inf: drawn last, as it should be
        if exists is not None:  # an existing cell of probability 0 above the padding: the lowest finite key
            lowest = torch.finfo(torch.float64).min
            keys = torch.where(exists.to(keys.device), keys.clamp(min=lowest), -torch.inf)
        top = torch.topk(keys, min(n + 1, p.shape[1]), dim=1, largest=True, sorted=True)
        indices = top.indices[:, :n]
        threshold = top.values[:, n] if top.values.shape[1] > n else keys.new_full((p.shape[0],), -torch.inf)
        if exists is not None:  # the threshold as without padding: -inf when no positive key is left
            threshold = torch.where(threshold > torch.finfo(torch.float64).min, threshold, -torch.inf)
        return Draw(indices, probs.gather(1, indices), threshold)
    return Draw(indices, probs.gather(1, indices), None)


def estimator_threshold(estimator: str, draw: Draw, probs: torch.Tensor) -> torch.Tensor | None:
    """The ``threshold`` argument of :func:`expectation` that makes it the named estimator:
    None for ``sequential``; the draw's for ``threshold``; for ``auto`` (its training rule)
    the draw's, with NaN (= sequential weights) on the rows of ``probs`` [B, K] whose
    perplexity exceeds n."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; choose from {', '.join(ESTIMATORS)}")
    if estimator == "sequential" or draw.threshold is None:
        return None
    if estimator == "threshold":
        return draw.threshold
    n = draw.indices.shape[1]
    spread = torch.exp(entropy(probs.detach())).to(draw.threshold.device)
    return torch.where(n >= spread, draw.threshold, torch.nan)


def estimator_weights(
    sampled_probs: torch.Tensor, *, replace: bool = False, threshold: torch.Tensor | None = None
) -> torch.Tensor:
    """The weights ``w_k`` [B, n] such that the estimate is ``sum_k w_k f_k``.

    With replacement ``w_k = 1/n``. Without replacement (a NaN in ``threshold`` gives
    that row the sequential weights, see :func:`estimator_threshold`):

    * ``threshold`` given (the ``threshold`` estimator): ``w_i = a_i / q_i`` with
      ``q_i = 1 - exp(-a_i exp(-kappa))``, kappa the (n+1)-th Gumbel key. Why it is
      unbiased: fix position i and condition on every other key; let kappa_-i be the n-th
      largest of them. i is drawn iff ``log a_i + G_i > kappa_-i``, which has probability
      ``q_i(kappa_-i)`` (the Gumbel CDF), and when i is drawn the (n+1)-th key overall IS
      kappa_-i, so the weight uses exactly that probability: ``E[1{i drawn} w_i] = a_i``.
      This is the Horvitz-Thompson estimator conditioned on the threshold (Kool, van Hoof
      & Welling, ICML 2019, "Stochastic Beams", sec. 4; priority sampling is the same idea
      with uniform keys). A position far above the threshold has ``q_i ~ 1`` and weight
      ``~a_i``; one near or below it gets ``~exp(kappa)``. With kappa = -inf (every
      positive position drawn) the weights are ``a_i``: the exact sum.
    * no threshold (the ``sequential`` estimator): with draw order k = 0..n-1 and the
      probability mass left before draw k, ``pm_k = 1 - sum_{j<k} a_j``, each
      ``F_k = sum_{j<k} a_j f_j + pm_k f_k`` is unbiased for ``sum_i a_i f_i`` (thesis
      B.3: the first terms are exact, the last is an importance-weighted draw from the
      renormalised rest). Averaging the n of them, ``f_k`` appears once with ``pm_k`` and
      in the (n-1-k) later ``F_m`` with ``a_k``, hence ``w_k = (pm_k + (n-1-k) a_k) / n``.

    Computed in float64 (``pm_k`` keeps its precision when the first draw takes almost
    all the mass; ``q_i`` is an ``expm1``). A position of probability 0 gets weight 0.
    """
    a = sampled_probs.detach()
    n = a.shape[-1]
    if replace:
        return torch.full_like(a, 1.0 / n)
    a64 = a.double()
    exclusive_cumsum = torch.cumsum(a64, dim=-1) - a64
    pm = (1.0 - exclusive_cumsum).clamp_(min=0.0)
    later = torch.arange(n - 1, -1, -1, device=a.device, dtype=torch.float64)  # n-1-k
    w = (pm + later * a64) / n
    if threshold is not None:
        kappa = threshold.double().to(a.device)[:, None]
        # a drawn position has log a_i + G_i > kappa with G_i <= 37 (the clamp in sample),
        # so a_i exp(-kappa) > 1e-16 and q_i never underflows; exp(-(-inf)) = inf gives q = 1
        q = -torch.expm1(-a64 * torch.exp(-kappa))
        w_ht = torch.where(a64 > 0, a64 / q.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
        w = torch.where(torch.isnan(kappa), w, w_ht)
    return w.to(a.dtype)


def expectation(
    features: torch.Tensor,
    sampled_probs: torch.Tensor,
    *,
    replace: bool = False,
    threshold: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unbiased estimate [B, D] of ``sum_i a_i f_i`` from n sampled features [B, n, D].

    ``threshold`` (from :func:`estimator_threshold`) selects the estimator, None the
    ``sequential`` one (see :func:`estimator_weights`); the derivation below holds for all.
    ``weights``: those weights when the caller already has them (the model returns them
    with its output, so that nobody has to replay the sampler to know them); they must be
    :func:`estimator_weights` of the same draw, detached.

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
    w = estimator_weights(sampled_probs, replace=replace, threshold=threshold) if weights is None else weights.detach()
    a = sampled_probs
    tiny = torch.finfo(a.dtype).tiny
    ratio = a / a.detach().clamp(min=tiny)  # == 1, carries d/da = 1/a
    # Under autocast the features may be float16/bfloat16; the weights w can span many
    # orders of magnitude (1/a for tiny a), so the weighted sum runs in >= float32.
    dtype = torch.promote_types(features.dtype, torch.float32)
    with torch.autocast(features.device.type, enabled=False):
        return torch.einsum("bn,bnd->bd", (w * ratio).to(dtype), features.to(dtype))


def attention_distribution(
    scores: torch.Tensor, support: torch.Tensor | None = None, *, log: bool = False, check: bool = True
) -> torch.Tensor:
    """Softmax over ALL positions of an attention map [B, ...] -> probabilities [B, K].

    ``support`` (bool, same shape as ``scores``) restricts the distribution to some
    positions (e.g. not the empty background); the others get probability exactly 0 and
    are never sampled. The softmax runs in float32 even under autocast, since the
    estimator divides by it. ``log``: the log-probabilities instead (log-softmax, -inf off
    the support), for a cross-entropy that stays finite where a probability underflows.
    ``check=False`` skips the test that no image's support is empty, for a caller that
    guarantees it: the test reads a value back from the device, which makes the host wait.
    """
    flat = scores.flatten(1).float()
    if support is not None:
        keep = support.flatten(1).to(flat.device)
        if check and not keep.any(1).all():
            raise ValueError("support mask is empty for some image")
        flat = flat.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(flat, dim=1) if log else torch.softmax(flat, dim=1)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy [B] of each row of ``probs`` [B, K] in nats, for the ``-lambda * H(a)``
    regulariser (thesis eq. 3.21) that keeps the attention exploring early in training.
    ``0 log 0`` is taken as 0; the softmax backward multiplies by ``a`` so a position of
    probability 0 receives no gradient."""
    logp = torch.log(probs.clamp(min=torch.finfo(probs.dtype).tiny))
    return -(probs * logp).sum(dim=1)


def prior_divergence(probs: torch.Tensor, log_prior: torch.Tensor, support: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """KL(a || pi) [B] in nats: how far the attention ``probs`` [B, K] has moved from the
    prior's own distribution pi = softmax(``log_prior``) [B, ...] over the ``support`` (bool,
    shaped as ``log_prior``; None = all); ``-lambda * KL`` is the regulariser of a model with
    a prior, in place of the thesis's ``-lambda * H(a)``.

    Why: the entropy bonus is ``-KL(a || uniform)`` up to a constant, i.e. it pulls the
    attention towards uniform. With a prior the attention starts at pi, not at uniform, and
    while the classifier has nothing to say yet (the class is in a few regions the feature
    net cannot yet tell apart) the entropy bonus is the attention net's only steady
    gradient: Adam's normalised steps follow it, and within an epoch or two it flattens the
    attention the prior had put on the unusual regions, before any signal arrives
    (benchmarks/slides.md#runs-at-chance). Pulled towards pi instead, the attention stays
    where the prior put it until the loss moves it, and still never collapses onto a few
    cells the prior does not favour. Without a prior pi is uniform and the gradient is the
    entropy bonus's. A function of the attention alone, computed exactly: the estimator
    and its gradients are untouched."""
    log_pi = attention_distribution(log_prior, support, log=True, check=False).to(probs.dtype)
    # off the support a = pi = 0: their terms are 0 and, with log pi made finite there, so is
    # the gradient (0 * -inf in the backward pass would be NaN even through torch.where)
    log_pi = torch.where(torch.isfinite(log_pi), log_pi, 0.0)
    logp = torch.log(probs.clamp(min=torch.finfo(probs.dtype).tiny))
    return torch.where(probs > 0, probs * (logp - log_pi), 0.0).sum(dim=1)
