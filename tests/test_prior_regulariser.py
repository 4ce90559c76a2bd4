"""The attention regulariser with a prior (ats_cli.core.sampling.prior_divergence): without a
prior it is the thesis's entropy bonus; with one it is -KL(a || pi), pi the prior's own
attention, which leaves an attention that is where the prior started it alone (zero
gradient) where the entropy bonus, the negative control, pushes it to uniform: the
mechanism that erased the prior of a two-level model before any signal arrived
(benchmarks/slides.md#runs-at-chance). At both levels of a two-level model too. It never
enters the estimate, whose unbiasedness is tested with the prior in tests/test_extensions.py
and tests/test_nested.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ats_cli.core.model import ATSModel
from ats_cli.core.nested_model import NestedATSModel
from ats_cli.core.sampling import attention_distribution, entropy, prior_divergence
from ats_cli.core.source import low_res_view
from ats_cli.nets import create

PRIOR = {"name": "rarity", "weight": 3.0, "cap": 4.5}


def test_prior_divergence_is_the_kl_to_the_priors_attention_zero_at_it_and_finite_off_the_support():
    g = torch.Generator().manual_seed(0)
    log_prior = torch.randn(3, 4, 5, generator=g)
    support = torch.rand(3, 4, 5, generator=g) > 0.3
    scores = (torch.randn(3, 4, 5, generator=g) + log_prior).requires_grad_()
    a = attention_distribution(scores, support)
    pi = attention_distribution(log_prior, support)
    on = a > 0
    want = (a[on] * (a[on].log() - pi[on].log())).view(-1)
    got = prior_divergence(a, log_prior, support)
    rows = torch.arange(3)[:, None].expand(3, 20)[on]
    assert torch.allclose(got, torch.zeros(3).index_add(0, rows, want.detach()), atol=1e-6)
    assert bool((got > 0).all())
    assert torch.allclose(prior_divergence(pi, log_prior, support), torch.zeros(3), atol=1e-6)
    got.sum().backward()  # cells off the support (a = pi = 0) must not make the gradient NaN
    assert bool(torch.isfinite(scores.grad).all()) and float(scores.grad[~support].abs().max()) == 0.0


def _one_level(prior):
    torch.manual_seed(0)
    return ATSModel(create("mnist-attention", in_channels=3, width=4), create("small-cnn", in_channels=3, width=4), 2,
                    n_patches=4, patch_size=(8, 8), scale=0.25, prior=prior, entropy_weight=0.01).train()


def _two_levels(prior):
    torch.manual_seed(0)
    return NestedATSModel(create("mnist-attention", in_channels=3, width=4),
                          create("mnist-attention", in_channels=3, width=4),
                          create("small-cnn", in_channels=3, width=4), 2,
                          regions=2, region_size=32, coarse_scale=0.25, scale=0.5, n_patches=3, patch_size=(8, 8),
                          prior=prior, entropy_weight=0.01, region_temperature=0.1).train()


def _forward(model):
    g = torch.Generator().manual_seed(1)
    image = (torch.rand(1, 3, 128, 128, generator=g) * 255).to(torch.uint8)
    image[..., 40:48, 80:88] = 20  # one dark spot: the prior's favourite
    return model(low_res_view(image, model.scale), image, generator=torch.Generator().manual_seed(2))


def _attention_params(model):
    return [p for name, p in model.named_parameters() if name.startswith(("attention_net", "coarse_net"))]


@pytest.mark.parametrize("build", [_one_level, _two_levels], ids=["one level", "two levels"])
def test_without_a_prior_the_regulariser_is_the_entropy(build):
    out = _forward(build(None))
    assert torch.equal(out.explore, out.entropy)


@pytest.mark.parametrize("build", [_one_level, _two_levels], ids=["one level", "two levels"])
def test_with_a_prior_an_attention_at_the_prior_is_left_alone_where_the_entropy_would_flatten_it(build):
    """The attention nets' last layers start at zero, so the attention is the prior's own:
    the regulariser's gradient on every attention parameter is zero, the entropy bonus's
    (what the loss used before, the control) is not."""
    model = build(PRIOR)
    out = _forward(model)
    params = _attention_params(model)
    assert float(out.explore.detach().abs().max()) < 1e-6  # KL(pi || pi) = 0
    kl_grads = torch.autograd.grad(out.explore.sum(), params, retain_graph=True, allow_unused=True)
    ent_grads = torch.autograd.grad(out.entropy.sum(), params, allow_unused=True)
    assert max(float(g.abs().max()) for g in kl_grads if g is not None) < 1e-6
    assert max(float(g.abs().max()) for g in ent_grads if g is not None) > 1e-3


def test_adam_on_the_regulariser_alone_keeps_the_priors_mass_where_the_entropy_bonus_erases_it():
    """What happens while the classifier has nothing to say: Adam's normalised steps follow
    whatever gradient the attention gets. 40 steps on the entropy bonus alone (the control)
    take the mass off the four cells the prior favours (0.98 of it at the start); on the
    prior-relative regulariser the mass stays."""
    kept = {}
    for name in ("explore", "entropy"):
        model = _one_level(PRIOR)
        start = _forward(model).attention.flatten(1)[0].detach()
        top = start.topk(4).indices
        opt = torch.optim.Adam(_attention_params(model), lr=0.03)
        for _ in range(40):
            out = _forward(model)
            opt.zero_grad()
            (-getattr(out, name).mean()).backward()
            opt.step()
        kept[name] = float(_forward(model).attention.detach().flatten(1)[0, top].sum()) / float(start[top].sum())
    assert kept["explore"] > 0.99 and kept["entropy"] < 0.1, kept


def test_the_loss_subtracts_the_regulariser():
    model = _one_level(PRIOR)
    with torch.no_grad():
        out = _forward(model)
    out.explore = torch.tensor([-0.7])  # any value: the loss reads this term, not the entropy
    target = torch.tensor([1])
    want = F.cross_entropy(out.logits, target) - 0.01 * -0.7
    assert float(model.loss(out, target)) == pytest.approx(float(want), rel=1e-6)
    assert float(entropy(out.attention.flatten(1))[0]) == pytest.approx(float(out.entropy[0]), rel=1e-6)
