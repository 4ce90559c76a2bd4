"""Monte Carlo checks that the sampler and the estimator are right.

Used by the test suite and by ``ats selfcheck``, so a user can re-run on their own
machine the same statistical proof the tests make.

The check: on a small problem with K positions, attention ``a = softmax(z)``,
features ``f`` [K, D] and loss ``L = <c, F>``, draw many independent samples, compute
the estimate and its gradients for each, and compare their mean with the exact value
``<c, sum_i a_i f_i>`` and its exact gradients w.r.t. ``f`` and ``z``. The tolerance is
not a fixed threshold: the draws are split into groups, the standard error of the mean
is measured from the spread of the group means, and each component gets a z-score
``(mean - exact) / standard error``. An unbiased estimator gives |z| of order 1; a
biased one gives |z| that grows with the square root of the number of draws.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ats_cli.core.sampling import estimator_threshold, expectation, sample

__all__ = ["BiasCheck", "check_estimator", "check_draws", "Estimator"]

Estimator = Callable[..., torch.Tensor]  # (features [B,n,D], sampled_probs [B,n], *, replace) -> [B,D]
# (a callable is checked as a sequential-type estimator: it is not given the draw's threshold)


@dataclass
class BiasCheck:
    """z-scores of the Monte Carlo mean against the exact value, per quantity."""

    name: str
    draws: int
    z_value: float  # |z| of the forward value
    z_grad_features: float  # max |z| over the K*D feature-gradient components
    z_grad_logits: float  # max |z| over the K attention-logit-gradient components
    rel_err_grad_logits: float  # ||mean - exact|| / ||exact|| for the logit gradient
    std_value: float  # standard deviation of one draw's value: the estimator's noise

    @property
    def max_z(self) -> float:
        return max(self.z_value, self.z_grad_features, self.z_grad_logits)


def _zscores(samples: torch.Tensor, exact: torch.Tensor, groups: int) -> tuple[float, torch.Tensor]:
    """Max |z| of the mean of ``samples`` [M, ...] against ``exact``, with the standard
    error measured from ``groups`` group means; also returns the mean.

    Rare events: a component can be nearly constant over all M draws and still be
    unbiased thanks to an event too rare to show up -- e.g. with the threshold estimator a
    position of high attention is drawn in all 60,000 draws with weight a bit above a_i,
    and the draws that miss it (weight 0) have probability ~1e-5. The measured standard
    error then misses that event's share. So a shift of up to ``3 max|x| / M`` (the rule
    of three: an event unseen in M draws has probability below ~3/M at 95%, and it moves
    the mean by at most its size times that) is not counted against the estimator. The
    known-wrong estimators are off by far more than that (tests/test_estimator.py).
    """
    m = samples.shape[0] - samples.shape[0] % groups
    group_means = samples[:m].reshape(groups, m // groups, *samples.shape[1:]).mean(1)
    mean = group_means.mean(0)
    se = group_means.std(0, unbiased=True) / groups**0.5
    slack = 3.0 * samples[:m].abs().amax(0) / m
    diff = ((mean - exact).abs() - slack).clamp(min=0.0)
    # A component the estimator reproduces exactly every time has se == 0 and diff ~ 0.
    z = torch.where(se > 0, diff / se.clamp(min=1e-300), torch.where(diff > 1e-12, torch.inf, 0.0))
    return float(z.max()), mean


def check_estimator(
    *,
    K: int = 7,
    n: int = 3,
    D: int = 4,
    replace: bool = False,
    peaked: bool = False,
    draws: int = 60_000,
    groups: int = 100,
    seed: int = 0,
    estimator: str | Estimator = "auto",
    name: str | None = None,
) -> BiasCheck:
    """Monte Carlo bias check of ``estimator`` in value and both gradients: one of ours
    by name (``ESTIMATORS``), or a callable (the tests' known-wrong controls).

    ``peaked`` puts most of the mass (about 0.95) on one position, the regime late in
    training where the without-replacement weights matter most. Runs in float64.
    """
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(K, generator=g, dtype=torch.float64)
    if peaked:
        z[0] += 3.0 + torch.log(torch.tensor(float(K)))
    f = torch.randn(K, D, generator=g, dtype=torch.float64)
    c = torch.randn(D, generator=g, dtype=torch.float64)

    # Exact: L = <c, sum_i a_i f_i> and its gradients.
    z0 = z.clone().requires_grad_()
    f0 = f.clone().requires_grad_()
    exact_value = torch.softmax(z0, 0) @ f0 @ c
    exact_value.backward()

    # Monte Carlo: one independent copy of the problem per draw, so each row of the
    # gradients is one draw's gradient.
    zs = z.expand(draws, K).clone().requires_grad_()
    fs = f.expand(draws, K, D).clone().requires_grad_()
    probs = torch.softmax(zs, 1)
    draw = sample(probs, n, replace=replace, generator=g)
    feats = fs.gather(1, draw.indices[..., None].expand(-1, -1, D))
    if isinstance(estimator, str):
        threshold = estimator_threshold(estimator, draw, probs)
        values = expectation(feats, draw.probs, replace=replace, threshold=threshold) @ c
    else:
        values = estimator(feats, draw.probs, replace=replace) @ c
    values.sum().backward()

    zv, _ = _zscores(values.detach()[:, None], exact_value.detach()[None], groups)
    zf, _ = _zscores(fs.grad, f0.grad, groups)
    zz, mean_gz = _zscores(zs.grad, z0.grad, groups)
    rel = float((mean_gz - z0.grad).norm() / z0.grad.norm())
    if name is None:
        how = "with repl." if replace else f"w/o repl., {estimator if isinstance(estimator, str) else 'custom'}"
        name = f"K={K} n={n}{' peaked' if peaked else ''} {how}"
    return BiasCheck(name, draws, zv, zf, zz, rel, float(values.detach().std()))


def check_draws(*, K: int = 7, n: int = 3, draws: int = 200_000, seed: int = 0) -> tuple[float, bool]:
    """Check sampling without replacement against the exact sequential process.

    Returns (max |z| of the observed frequencies of the first and second draws against
    their exact probabilities ``a_i`` and ``sum_j a_j a_i / (1 - a_j)``, whether every
    row was free of repeats).
    """
    g = torch.Generator().manual_seed(seed)
    a = torch.softmax(torch.randn(K, generator=g, dtype=torch.float64) * 1.5, 0)
    idx = sample(a.expand(draws, K), n, replace=False, generator=g).indices
    no_repeats = bool((idx.sort(1).values.diff(dim=1) != 0).all())
    second = (a[:, None] * a[None, :] / (1 - a[:, None])).fill_diagonal_(0).sum(0)
    worst = 0.0
    for k, p in ((0, a), (1, second)):
        freq = torch.bincount(idx[:, k], minlength=K).double()
        z = (freq - draws * p).abs() / (draws * p * (1 - p)).sqrt()
        worst = max(worst, float(z.max()))
    return worst, no_repeats
