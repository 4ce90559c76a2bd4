"""Nested (two-level) attention sampling: the estimator is unbiased in value and in the
gradients w.r.t. the coarse attention, the fine attention and the features, proven by
Monte Carlo (|z| < 5 over groups of draws, as tests/test_estimator.py), each beside a
biased variant that the same check rejects by far; then the whole two-level model (every
parameter of both attention nets, the feature net and the classifier); then its
configuration errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from ats_cli.core import nested_model
from ats_cli.core.nested import NestedConfigError, check_regions, nested_expectation, region_offsets, region_scores
from ats_cli.core.nested_model import NestedATSModel, region_views
from ats_cli.core.patches import extract_patches
from ats_cli.core.sampling import ESTIMATORS, attention_distribution, estimator_threshold, estimator_weights, sample
from ats_cli.core.source import low_res_view, positions_to_offsets
from ats_cli.nets import create
from tests.montecarlo import Z_MAX, TinyFeatures, max_z

K, M, V, k, n = 6, 8, 3, 3, 3  # regions, cells per region, value size; regions drawn, patches per region


def _problem():
    g = torch.Generator().manual_seed(0)
    la = (torch.randn(K, generator=g) * 1.2).requires_grad_()
    lb = (torch.randn(K, M, generator=g) * 1.2).requires_grad_()
    f = torch.randn(K, M, V, generator=g).requires_grad_()
    c = torch.tensor([0.7, -1.3, 0.4])
    return la, lb, f, c


def _estimate(la, lb, f, c, draws: int, gen, *, estimator: str, replace: bool, variant: str):
    """<c, mean over ``draws`` of the nested estimate>, the estimate as ``variant`` makes it."""
    a = torch.softmax(la, 0).expand(draws, K)
    outer = sample(a, k, replace=replace, generator=gen)
    W = estimator_weights(outer.probs, replace=replace, threshold=estimator_threshold(estimator, outer, a))
    b = torch.softmax(lb, 1)[outer.indices].reshape(draws * k, M)
    inner = sample(b, n, replace=replace, generator=gen)
    w = estimator_weights(inner.probs, replace=replace, threshold=estimator_threshold(estimator, inner, b))
    rows = outer.indices.reshape(-1, 1).expand(-1, n)
    values = f[rows, inner.indices].view(draws, k, n, V)
    bp, wv = inner.probs.view(draws, k, n), w.view(draws, k, n)
    pooled, F = nested_expectation(values, outer.probs, bp, W, wv)
    if variant == "plain mean over regions":  # biased in value
        pooled = F.mean(1)
    elif variant == "outer gradient without inner weights":  # the region's unweighted mean in the a-gradient
        ratio = outer.probs / outer.probs.detach()
        pooled = pooled + torch.einsum("bk,bkv->bv", W * (ratio - 1), values.mean(2))
        pooled = pooled - torch.einsum("bk,bkv->bv", W * (ratio - 1), F)
    elif variant == "fine gradient without outer weight":  # each region's b-gradient as if W_r = 1
        ratio = bp / bp.detach()
        pooled = pooled + torch.einsum("bkn,bknv->bv", (1 - W[..., None]) * wv * (ratio - 1), values)
    elif variant == "feature gradient without outer weight":  # the f-gradient of a plain mean over regions
        pooled, _ = nested_expectation(values.detach(), outer.probs, bp, W, wv)  # a- and b-gradients intact
        drawn = torch.einsum("bkn,bknv->bv", wv, values) / k
        pooled = pooled + drawn - drawn.detach()
    return (pooled @ c).mean()


def _z(estimator="auto", replace=False, variant="nested", groups=50, per_group=4000):
    """The largest |z| of value, coarse-attention, fine-attention and feature gradients."""
    la, lb, f, c = _problem()
    a, b = torch.softmax(la, 0), torch.softmax(lb, 1)
    exact = torch.einsum("r,rj,rjv,v->", a, b, f, c)
    exact_grads = torch.autograd.grad(exact, (la, lb, f))
    gen = torch.Generator().manual_seed(1)
    values, grads = [], [[], [], []]
    for _ in range(groups):
        est = _estimate(la, lb, f, c, per_group, gen, estimator=estimator, replace=replace, variant=variant)
        values.append(est.detach())
        for store, g, x in zip(grads, torch.autograd.grad(est, (la, lb, f), allow_unused=True), (la, lb, f),
                               strict=True):
            store.append(torch.zeros_like(x).flatten() if g is None else g.flatten())
    z = {}
    for name, samples, truth in zip(("value", "coarse", "fine", "features"),
                                    [torch.stack(values)[:, None]] + [torch.stack(g) for g in grads],
                                    [exact.detach().flatten()] + [g.flatten() for g in exact_grads], strict=True):
        z[name] = max_z(samples.mean(0), samples.std(0) / groups ** 0.5, truth)
    return z


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_nested_estimate_and_its_three_gradients_are_unbiased(estimator):
    z = _z(estimator)
    assert max(z.values()) < Z_MAX, z


def test_nested_estimate_is_unbiased_with_replacement():
    z = _z(replace=True)
    assert max(z.values()) < Z_MAX, z


@pytest.mark.parametrize("variant, fails", [
    ("plain mean over regions", "value"),
    ("outer gradient without inner weights", "coarse"),
    ("fine gradient without outer weight", "fine"),
    ("feature gradient without outer weight", "features"),
])
def test_the_check_rejects_each_biased_variant_where_it_is_biased(variant, fails):
    """Each wrong variant leaves the other quantities unbiased (it changes one gradient, or
    only the value), and the check catches the one it breaks."""
    z = _z("sequential", variant=variant)
    assert z[fails] > 3 * Z_MAX, z
    assert all(v < Z_MAX for name, v in z.items() if name != fails and fails != "value"), z


# ------------------------------------------------------------------------ the whole model
SIZE, REGION, PATCH = 64, 16, 4


def tiny_nested(**kwargs) -> NestedATSModel:
    torch.manual_seed(3)
    m = NestedATSModel(create("mnist-attention", in_channels=1, width=4), create("mnist-attention", in_channels=1,
                       width=4), TinyFeatures(5), n_classes=3, regions=3, region_size=REGION, coarse_scale=0.5,
                       scale=0.5, n_patches=3, patch_size=(PATCH, PATCH), entropy_weight=0.0, feature_scale=3.0,
                       **kwargs)
    nn.init.normal_(m.coarse_net.score.weight, std=0.5)  # the last layers start at zero (uniform)
    nn.init.normal_(m.attention_net.score.weight, std=0.5)
    return m.train()


def _image() -> torch.Tensor:
    return (torch.rand(1, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)


def _mask() -> torch.Tensor:
    """A fixed 'tissue' mask on the coarse view: its left three quarters."""
    mask = torch.zeros(1, SIZE // 2, SIZE // 2, dtype=torch.bool)
    mask[..., : 3 * SIZE // 8] = True
    return mask


def _exact_logits(m: NestedATSModel, img: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The logits at the full nested expectation: every region, every cell of it."""
    low = low_res_view(img, m.scale)
    a = m.coarse_attention(low, (SIZE, SIZE), mask)[0]  # [G]
    grid = check_regions((SIZE, SIZE), REGION, m.regions)
    G = grid[0] * grid[1]
    roff = region_offsets(torch.arange(G)[None], grid, REGION)  # [1, G, 2]
    views = region_views(img, roff, REGION, m.view_size)[0]  # [G, C, vh, vw]
    scores = m.attention_net(views)
    fatt = tuple(scores.shape[-2:])
    fmask = None if mask is None else m._region_mask(low, mask, views, (SIZE, SIZE), roff)
    keep = m._supported_pixels(views, fmask)
    prior = m._prior_cells(views, keep, fatt, within_region=True)  # as the model's fine level
    b = attention_distribution(scores if prior is None else scores + prior[:, None], m._support_cells(keep, fatt))
    cells = torch.arange(b.shape[1])[None].expand(G, -1)
    within = positions_to_offsets(cells, fatt, (REGION, REGION), m.patch_size, low_size=m.view_size)
    offsets = (within + roff[0][:, None]).view(1, -1, 2)
    patches = extract_patches(img, offsets, m.patch_size).float()[0] / 255.0
    f = m.patch_features(patches).view(G, b.shape[1], -1)
    return m.classifier(torch.einsum("r,rj,rjd->d", a, b, f))


def _model_z(m: NestedATSModel, groups: int = 30, per_group: int = 300, mask: torch.Tensor | None = None) -> float:
    img = _image()
    c = torch.tensor([0.7, -1.3, 0.4])
    params = [p for p in m.parameters() if p.requires_grad]
    exact_value = (_exact_logits(m, img, mask) * c).sum()
    exact = torch.cat([g.flatten() for g in torch.autograd.grad(exact_value, params)])
    low = low_res_view(img, m.scale).expand(per_group, -1, -1, -1)
    source = img.expand(per_group, -1, -1, -1)
    gen = torch.Generator().manual_seed(1)
    vals, grads = [], []
    for _ in range(groups):
        masks = None if mask is None else mask.expand(per_group, -1, -1)
        est = (m(low, source, generator=gen, support_mask=masks).logits * c).sum(1).mean()
        vals.append(float(est.detach()))
        got = torch.autograd.grad(est, params, allow_unused=True)  # a biased variant may leave a net out
        grads.append(torch.cat([torch.zeros_like(p).flatten() if g is None else g.flatten()
                                for g, p in zip(got, params, strict=True)]))
    g = torch.stack(grads)
    se = g.std(0) / groups ** 0.5
    z = max_z(g.mean(0), se, exact)
    v = torch.tensor(vals)
    return max(z, float((v.mean() - exact_value.detach()).abs() / (v.std() / groups ** 0.5)))


def test_the_two_level_model_is_unbiased_in_value_and_every_parameter():
    """Both attention nets, the feature net and the classifier: the model's own forward
    pass (coarse view, region grid, region views, fine views, patch offsets) against the
    exact expectation over every region and every cell."""
    assert _model_z(tiny_nested()) < Z_MAX


def test_the_two_level_model_is_unbiased_with_a_tissue_mask_a_prior_and_a_gain():
    """The extensions at both levels: a mask that leaves some regions out and cuts others,
    the rarity prior on the coarse and the fine cells, the learned gain on the features."""
    m = tiny_nested(prior={"name": "rarity", "weight": 1.0}, gain={"name": "learned"})
    assert _model_z(m, mask=_mask()) < Z_MAX


def test_a_capped_prior_caps_the_coarse_level_only_and_stays_unbiased(monkeypatch):
    """The rarity prior's cap spreads the coarse attention over the unusual regions; within
    a region its ``within_region`` form is uncapped, so the fine attention starts on the
    region's most unusual cell. The model with it is unbiased (its exact expectation uses
    the same forms), and the check rejects the plain mean over regions (the control). The
    control runs on 10 x 100 draws, not 30 x 300: a component it gets wrong does not vary
    from draw to draw, so its |z| is infinite at both (measured), and a check that rejects
    it with fewer draws rejects it with more."""
    from ats_cli.extensions.prior_rarity import rarity

    m = tiny_nested(prior={"name": "rarity", "weight": 3.0, "cap": 1.5})
    views = region_views(_image(), torch.zeros(1, 1, 2, dtype=torch.long), REGION, m.view_size)[0].float()
    r = rarity(views)
    assert float(r.max()) > 2.5  # cells past the cap, which the two forms treat apart
    assert torch.allclose(m.prior.within_region(views, None), 3.0 * r)
    assert torch.allclose(m.prior(views, None), 3.0 * r.clamp(max=1.5))
    assert _model_z(m, mask=_mask()) < Z_MAX
    monkeypatch.setattr(nested_model, "nested_expectation", _plain_mean_over_regions)
    assert _model_z(m, groups=10, per_group=100, mask=_mask()) > 3 * Z_MAX


def test_more_regions_at_evaluation_are_as_unbiased_and_capped_at_the_grid():
    """The estimate is unbiased for any k (here 6 of the 16 regions, the evaluation's twice 3),
    and evaluation draws ``eval_regions``, at most the grid's cells; training ``regions``."""
    m = tiny_nested(eval_regions=40)
    m.regions = 6
    assert _model_z(m, groups=12, per_group=150) < Z_MAX
    m.regions = 3
    assert m.regions_for((4, 4)) == 3
    out = m.eval()(low_res_view(_image(), m.scale), _image(), generator=torch.Generator().manual_seed(0))
    assert out.region_indices.shape == (1, 16) and len(set(out.region_indices[0].tolist())) == 16


def _plain_mean_over_regions(values, region_probs, patch_probs, region_weights, patch_weights):
    """A biased nested estimate (the negative control): the drawn regions' inner estimates
    averaged, ignoring the outer weights."""
    pooled, inner = nested_expectation(values, region_probs, patch_probs, region_weights, patch_weights)
    return inner.mean(1), inner


def test_the_model_check_rejects_a_plain_mean_over_the_regions(monkeypatch):
    monkeypatch.setattr(nested_model, "nested_expectation", _plain_mean_over_regions)
    assert _model_z(tiny_nested()) > 3 * Z_MAX


def test_a_region_score_is_the_log_mean_exp_of_its_kept_cells_and_follows_one_high_cell():
    """The coarse attention gives a region the mean of its cells' exp(score): checked
    against a direct logsumexp per region, with a kept-cell mask and a region with no kept
    cell (never drawn), and its gradient (a softmax over the region's cells). Then what it
    is for: one cell 8 above the other 255 of its region makes that region the likeliest
    of four, which a mean of the scores (the control) does not."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 12, generator=g).requires_grad_()
    cells = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3])
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[0, 5:9] = False  # region 2 of image 0: no kept cell
    got = region_scores(scores, cells, 5, keep)  # region 4: no cell at all
    for b in range(2):
        for r in range(5):
            m = (cells == r) & keep[b]
            want = torch.logsumexp(scores.detach()[b][m], 0) - torch.log(m.sum().float()) if m.any() else float("-inf")
            assert float(got.detach()[b, r]) == pytest.approx(float(want), abs=1e-5), (b, r)
    got[torch.isfinite(got)].sum().backward()
    for b in range(2):
        for r in range(4):
            m = (cells == r) & keep[b]
            if m.any():
                want = torch.softmax(scores.detach()[b][m], 0)
                assert torch.allclose(scores.grad[b][m], want, atol=1e-6)

    flat = torch.zeros(1, 4 * 256)
    flat[0, 3 * 256 + 17] = 8.0  # one high cell in region 3
    grid = torch.arange(4).repeat_interleave(256)
    a = torch.softmax(region_scores(flat, grid, 4), 1)[0]
    assert int(a.argmax()) == 3 and float(a[3]) > 0.6
    mean = torch.zeros(4).index_add_(0, grid, flat[0]) / 256  # the control: a mean of the scores
    assert float(torch.softmax(mean, 0)[3]) < 0.3


def test_the_output_says_what_the_model_did():
    """Each patch lies in its region, the patch weights are the products of the two levels'
    weights, and the patch fields are those of a one-level output (the figure and GeoJSON
    read them alike)."""
    m = tiny_nested().eval()
    out = m(low_res_view(_image(), m.scale), _image(), generator=torch.Generator().manual_seed(0))
    kk, nn_ = m.regions, m.patches_now
    assert out.attention.shape == (1, 4, 4) and out.offsets.shape == (1, kk * nn_, 2)
    region = out.region_offsets[0].repeat_interleave(nn_, 0)
    centre = out.offsets[0] + PATCH // 2
    assert ((centre >= region) & (centre < region + REGION)).all()
    assert len(set(out.region_indices[0].tolist())) == kk
    torch.testing.assert_close(out.weights[0], (out.region_weights[0][:, None]
                                                * estimator_weights_of(out, m)).flatten())
    torch.testing.assert_close(out.region_contributions.sum(), out.contributions.sum(), rtol=1e-9, atol=0)


def estimator_weights_of(out, m):
    """The inner weights, read back as weights / region weight."""
    return (out.weights[0].view(m.regions, -1) / out.region_weights[0][:, None])


@pytest.mark.parametrize("size, region, k, message", [
    ((64, 64), 128, 1, "larger than"),
    ((64, 64), 16, 17, "holds only 16 regions"),
    ((64, 64), 18, 1, "not a multiple of the patch side"),
])
def test_bad_configurations_fail_in_one_line(size, region, k, message):
    with pytest.raises(NestedConfigError, match=message) as err:
        check_regions(size, region, k, (PATCH, PATCH))
    assert "\n" not in str(err.value) and str(err.value).startswith(("region_size ", "regions "))  # the key to change


def test_counts_pooling_is_refused_in_one_line():
    with pytest.raises(NestedConfigError, match="pooling counts \\(and highest-counts, topmost-counts\\) needs one"):
        tiny_nested(pooling={"name": "counts"})


def test_a_region_temperature_moves_the_score_to_the_largest_cell_and_stays_unbiased(monkeypatch):
    """``t * LME(s / t)``: checked against a direct logsumexp, at t = 1 the log-mean-exp,
    towards the largest kept cell as t falls. What it is for: one cell 3 above the other
    255 of its region, which the log-mean-exp (t = 1, the control) ranks below a region of
    uniformly higher cells, makes its region the likeliest at t = 0.1. The two-level model
    with it is unbiased in value and every parameter, and the check still catches a plain
    mean over the regions (the negative control) at this temperature."""
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 12, generator=g)
    cells = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3])
    for t in (1.0, 0.3, 0.05):
        got = region_scores(scores, cells, 4, temperature=t)
        for b in range(2):
            for r in range(4):
                s = scores[b][cells == r]
                want = t * (torch.logsumexp(s / t, 0) - math.log(len(s)))
                assert float(got[b, r]) == pytest.approx(float(want), abs=1e-5), (t, b, r)
    top = torch.stack([scores[:, cells == r].amax(1) for r in range(4)], 1)
    assert torch.allclose(region_scores(scores, cells, 4, temperature=1e-3), top, atol=0.01)
    with pytest.raises(ValueError, match="temperature"):
        region_scores(scores, cells, 4, temperature=0.0)

    flat = torch.zeros(1, 4 * 256)
    flat[0, 256:512] = 0.5  # region 1: every cell a little higher
    flat[0, 3 * 256 + 17] = 3.0  # region 3: one cell well above the rest
    grid = torch.arange(4).repeat_interleave(256)
    assert int(torch.softmax(region_scores(flat, grid, 4), 1)[0].argmax()) == 1  # the control: t = 1
    a = torch.softmax(region_scores(flat, grid, 4, temperature=0.1), 1)[0]
    assert int(a.argmax()) == 3 and float(a[3]) > 0.7

    assert _model_z(tiny_nested(region_temperature=0.1)) < Z_MAX
    monkeypatch.setattr(nested_model, "nested_expectation", _plain_mean_over_regions)
    assert _model_z(tiny_nested(region_temperature=0.1)) > 3 * Z_MAX
