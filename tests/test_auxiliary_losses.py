"""The auxiliary training signals (ats_cli.core.model.auxiliary_losses) leave the
classification term unbiased, reach only the networks they are meant for, and do what
they are for.

The statistical test runs the whole model (attention net -> sampling -> patches ->
feature net -> estimator -> classifier) with the auxiliary terms switched on, and
compares the Monte Carlo mean of the classification gradient with the exact gradient of
the full expectation over every position: |z| < 5 for every parameter of both networks
and of the classifier, with the standard error measured from 40 groups of draws. A
negative control (the plain mean of the sampled features, a biased pooling) shows that
the same test rejects a wrong estimator, so a pass means something.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.core import model as model_module
from ats_cli.core.geometry import low_res_view, positions_to_offsets
from ats_cli.core.model import ATSModel, auxiliary_losses
from ats_cli.core.patches import extract_patches
from ats_cli.nets import create

Z_MAX = 5.0
SIZE, PATCH, SCALE, N = 48, 8, 0.125, 6  # 6x6 = 36 positions, 6 draws without replacement


class _TinyFeatures(nn.Module):
    """No batch norm: a patch's feature must not depend on which other patches were drawn,
    or no pooling could be unbiased (the test would measure the net, not the estimator)."""

    out_features = 6

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3, padding=1)

    def forward(self, x):
        return torch.amax(torch.tanh(self.conv(x)), dim=(2, 3))


def _model(estimator="auto", rarity_prior=0.0, patch_gain=False, pooling="features", patch=PATCH,
           none_class=False, count_floor=0.0) -> ATSModel:
    torch.manual_seed(3)
    m = ATSModel(create("mnist-attention", in_channels=1, width=4), _TinyFeatures(), n_classes=3, n_patches=N,
                 patch_size=(patch, patch), scale=SCALE, entropy_weight=0.0, feature_scale=3.0,
                 estimator=estimator, rarity_prior=rarity_prior, patch_gain=patch_gain, pooling=pooling,
                 none_class=none_class, count_floor=count_floor)
    # a non-uniform attention to start from (the last layer is zero-initialised)
    nn.init.normal_(m.attention_net.score.weight, std=0.5)
    return m.train()


def _image() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.rand(1, 1, SIZE, SIZE, generator=g) * 255).to(torch.uint8)


def _linear(m: ATSModel, logits: torch.Tensor) -> torch.Tensor:
    """A function of the logits that is linear in the pooled estimate, so that its mean
    over draws must equal its value at the exact expectation: the logits themselves for
    pooled features (the classifier is linear), their exp for pooled votes (log E_a[p])
    and counts (log E_a[p / M])."""
    return logits if m.pooling == "features" else logits.exp()


def _exact_loss(m: ATSModel, image: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """<c, logits> (:func:`_linear`) of the full expectation sum_i a_i f_i over every
    position (the attention with the model's rarity prior, when it has one)."""
    low = low_res_view(image, SCALE)
    scores = m.attention_net(low)
    att = scores.shape[-2:]
    prior = m.prior(low, tuple(att))
    if prior is not None:
        scores = scores + prior[:, None]
    a = torch.softmax(scores.flatten(1), dim=1)  # [1, K]
    idx = torch.arange(a.shape[1])[None]
    offsets = positions_to_offsets(idx, tuple(att), (SIZE, SIZE), m.patch_size, low_size=tuple(low.shape[-2:]))
    patches = extract_patches(image, offsets, m.patch_size).float() / 255.0
    f = m.patch_features(patches.flatten(0, 1))  # [K, D]: scaled unit features (times the gain, if any)
    mass = m.local_mass(a, tuple(att), torch.tensor([[SIZE, SIZE]]))[0]  # used by pooling="counts" only
    return (_linear(m, m.readout((a[0] @ m.patch_values(f, mass))[None])) * c).sum()


def _grads(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])


def _z_of_classification_gradient(m: ATSModel, groups=40, per_group=400, *, value: bool = False) -> float:
    image = _image()
    c = torch.tensor([0.7, -1.3, 0.4])
    params = [p for p in m.parameters() if p.requires_grad]
    exact = _grads(_exact_loss(m, image, c), params)
    low = low_res_view(image, SCALE).expand(per_group, -1, -1, -1)
    source = image.expand(per_group, -1, -1, -1)
    labels = torch.zeros(per_group, dtype=torch.long)
    gen = torch.Generator().manual_seed(1)
    means, values = [], []
    for _ in range(groups):
        out = m(low, source, generator=gen)
        classification = (_linear(m, out.logits) * c).sum(1).mean()
        values.append(float(classification.detach()))
        # the auxiliary terms are computed in the same forward pass, as in training
        patch, attention = auxiliary_losses(out, labels)
        assert torch.isfinite(patch) and torch.isfinite(attention)
        means.append(_grads(classification, params))
    g = torch.stack(means)
    se = g.std(0) / groups ** 0.5
    z = (g.mean(0) - exact).abs() / se.clamp_min(1e-12)
    z = float(z[se > 1e-9].max())
    if value:  # the value too: |mean - exact| in standard errors of the group means
        v = torch.tensor(values)
        z = max(z, float((v.mean() - _exact_loss(m, image, c).detach()).abs() / (v.std() / groups ** 0.5)))
    return z


@pytest.mark.parametrize("estimator", ["sequential", "threshold"])
def test_classification_gradient_stays_unbiased_with_the_auxiliary_terms_on(estimator):
    assert _z_of_classification_gradient(_model(estimator)) < Z_MAX


def test_value_and_gradient_stay_unbiased_with_the_rarity_prior_on():
    """The rarity prior (ATSModel.prior) changes the distribution the patches are drawn
    from, not the estimator: with it on (strongly, so that it matters) the value and the
    gradient of every parameter still match the exact expectation under that distribution."""
    m = _model("auto", rarity_prior=1.5)
    low = low_res_view(_image(), SCALE)
    a = torch.softmax((m.attention_net(low) + m.prior(low, (6, 6))[:, None]).flatten(1), 1)
    assert float((a.max() / a.min()).detach()) > 5  # the prior does change the distribution
    assert _z_of_classification_gradient(m, value=True) < Z_MAX


@pytest.mark.parametrize("estimator", ["sequential", "threshold"])
def test_value_and_gradient_stay_unbiased_with_the_patch_gain_on(estimator):
    """The patch gain (ATSModel.patch_features) makes the averaged feature g(x) u(x), still
    a function of the patch alone: with gains that differ a lot between patches, the value
    and the gradient of every parameter (the gain's included) match the exact expectation."""
    m = _model(estimator, patch_gain=True)
    nn.init.normal_(m.gain.weight, std=8.0)  # start: every gain 1; here: far from it
    image = _image()
    low = low_res_view(image, SCALE)
    idx = torch.arange(36)[None]
    offsets = positions_to_offsets(idx, (6, 6), (SIZE, SIZE), (PATCH, PATCH), low_size=tuple(low.shape[-2:]))
    patches = extract_patches(image, offsets, (PATCH, PATCH)).float().flatten(0, 1) / 255.0
    gains = m.patch_gains(patches).detach()
    assert float(gains.max() / gains.min()) > 3  # the gain does weigh patches unequally
    assert _z_of_classification_gradient(m, value=True) < Z_MAX


def test_the_check_rejects_a_biased_pooling(monkeypatch):
    """Negative control: the sampled features weighted by their attention, renormalised
    over the draws, is a biased pooling (it over-weights the favoured positions twice)."""
    monkeypatch.setattr(model_module, "expectation",
                        lambda feats, probs, **_: (probs[..., None] * feats).sum(1) / probs.sum(1, keepdim=True))
    assert _z_of_classification_gradient(_model("sequential"), groups=20) > 3 * Z_MAX


def test_loss_adds_exactly_the_weighted_terms_and_nothing_else():
    m = _model()
    image = _image().expand(4, -1, -1, -1)
    out = m(low_res_view(image, SCALE), image, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 0])
    patch, attention = auxiliary_losses(out, y)
    base = m.loss(out, y)
    assert torch.allclose(base, F.cross_entropy(out.logits, y))
    assert torch.allclose(m.loss(out, y, patch_loss=0.3, attention_loss=2.0), base + 0.3 * patch + 2.0 * attention)


def test_each_term_reaches_only_the_networks_it_is_for():
    """Patch term: feature net and classifier, never the attention. Critic: the attention
    net only (its teacher is detached)."""
    m = _model()
    image = _image().expand(4, -1, -1, -1)
    out = m(low_res_view(image, SCALE), image, generator=torch.Generator().manual_seed(0))
    patch, attention = auxiliary_losses(out, torch.tensor([0, 1, 2, 0]))
    groups = {"attention": list(m.attention_net.parameters()),
              "rest": list(m.feature_net.parameters()) + list(m.classifier.parameters())}
    for term, reaches, spared in ((patch, "rest", "attention"), (attention, "attention", "rest")):
        grads = torch.autograd.grad(term, groups[reaches] + groups[spared], retain_graph=True, allow_unused=True)
        got = [g for g in grads[:len(groups[reaches])] if g is not None]
        assert got and max(float(g.abs().max()) for g in got) > 0
        assert all(g is None or float(g.abs().max()) == 0 for g in grads[len(groups[reaches]):])


def test_the_critic_moves_attention_to_the_informative_draws():
    """One sampled position whose patch prediction is certain, the others uniform: a step
    on the critic raises that position's share of the sampled attention."""
    from ats_cli.core.model import ATSOutput

    scores = torch.zeros(1, 5, requires_grad=True)
    probs = torch.softmax(scores, 1)
    logits = torch.zeros(1, 5, 4)
    logits[0, 2] = torch.tensor([20.0, 0.0, 0.0, 0.0])  # informative
    out = ATSOutput(logits=torch.zeros(1, 4), attention=probs.view(1, 1, 5), indices=torch.arange(5)[None],
                    offsets=torch.zeros(1, 5, 2), sampled_probs=probs, entropy=torch.zeros(1), patch_logits=logits)
    _, critic = auxiliary_losses(out, torch.tensor([1]))
    (grad,) = torch.autograd.grad(critic, scores)
    assert grad[0, 2] < 0 and (grad[0, [0, 1, 3, 4]] > 0).all()  # descent raises position 2, lowers the rest


def test_draws_of_probability_zero_are_left_out():
    """Past the end of a small support the extra draws have probability 0: they carry no
    patch loss and no critic target (a NaN here would stop training)."""
    from ats_cli.core.model import ATSOutput

    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]], requires_grad=True)
    logits = torch.randn(1, 4, 3)
    out = ATSOutput(logits=torch.zeros(1, 3), attention=probs.view(1, 1, 4), indices=torch.arange(4)[None],
                    offsets=torch.zeros(1, 4, 2), sampled_probs=probs, entropy=torch.zeros(1), patch_logits=logits)
    y = torch.tensor([2])
    patch, critic = auxiliary_losses(out, y)
    assert torch.allclose(patch, F.cross_entropy(logits[0, :2], y.repeat(2)))
    assert torch.isfinite(critic)
    (grad,) = torch.autograd.grad(critic, probs)
    assert torch.isfinite(grad).all() and (grad[0, 2:] == 0).all()
