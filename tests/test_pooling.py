"""Pooling votes and counts (``--pooling``, ats_cli.core.model.ATSModel.patch_values):
the estimates of E_a[p] and E_a[p / M] stay unbiased in value and in the gradient of
every parameter, a confident patch cannot outvote several, a patch of equal logits does
not vote, counts weigh every object once whatever its attention mass, and models and
runs saved before them keep pooling features."""

from __future__ import annotations

import pytest
import torch

from ats_cli.config import ConfigError, resolve_config
from ats_cli.legacy import upgrade_run_config, upgrade_spec
from ats_cli.models import create_model, model_spec
from tests.test_auxiliary_losses import Z_MAX, _model, _z_of_classification_gradient


@pytest.mark.parametrize("pooling", ["votes", "counts"])
@pytest.mark.parametrize("estimator", ["sequential", "threshold"])
def test_value_and_gradient_stay_unbiased_with_votes_and_counts(estimator, pooling):
    """exp(logits) = the estimate of sum_i a_i p_i (votes) or sum_i a_i p_i / M_i (counts,
    M the attention mass around cell i, itself a function of the attention net): its
    Monte Carlo mean and the mean of its gradient (attention net, feature net,
    classifier) match the exact expectation over every position
    (tests/test_auxiliary_losses.py's check, whose negative control shows it rejects a
    biased pooling). Patches of 16 px on cells of 8: M sums 3x3 cells, so it moves with
    the attention (with a 1-cell window a_i p_i / M_i = p_i and the attention's exact
    gradient is 0: nothing to test)."""
    m = _model(estimator, pooling=pooling, patch=16)
    assert _z_of_classification_gradient(m, value=True) < Z_MAX


def test_value_and_gradient_stay_unbiased_with_a_count_floor():
    """counts with --count-floor 0.3: M_i floored where the 3x3 window holds less (most
    cells here, not all), still a deterministic function of the attention per cell."""
    m = _model("sequential", pooling="counts", patch=16, count_floor=0.3)
    assert _z_of_classification_gradient(m, value=True) < Z_MAX


@pytest.mark.parametrize("pooling", ["votes", "counts"])
def test_value_and_gradient_stay_unbiased_with_a_none_logit(pooling):
    """--none-class on: each vote is the classes' share of a softmax with one more logit
    (its own linear head, a gradient path of its own): still a function of the patch
    alone, so the same check passes, the none head's parameters included."""
    m = _model("sequential", pooling=pooling, patch=16, none_class=True)
    torch.nn.init.normal_(m.none.weight, std=0.5)  # a patch-dependent none logit, not a constant
    assert _z_of_classification_gradient(m, value=True) < Z_MAX


def test_counts_weigh_every_object_once_where_votes_follow_the_attention_mass():
    """Two objects on a 20x20 attention grid (cells of 5 px, patches of 16 px: windows of
    5 cells): class 0 under 0.8 of the mass, spread over 4 cells; class 1 under 0.2, on
    one cell. The exact vote follows the mass; the exact count is one of each."""
    m = create_model({**_spec(pooling="counts"), "patch_size": [16, 16]})
    a = torch.zeros(1, 20, 20)
    a[0, 3:5, 3:5] = 0.2
    a[0, 14, 12] = 0.2
    a = a.view(1, -1)
    p = torch.zeros(400, 3)
    p[:, 2] = 1.0  # cells without mass: their value never counts
    p[a[0] > 0.1] = torch.tensor([0.0, 0.0, 1.0])
    p[torch.tensor([3 * 20 + 3, 3 * 20 + 4, 4 * 20 + 3, 4 * 20 + 4])] = torch.tensor([1.0, 0.0, 0.0])
    p[14 * 20 + 12] = torch.tensor([0.0, 1.0, 0.0])
    mass = m.local_mass(a, (20, 20), torch.tensor([[100, 100]]))[0]
    assert torch.allclose(mass[a[0] > 0], torch.tensor([0.8, 0.8, 0.8, 0.8, 0.2]))
    votes, counts = a[0] @ p, a[0] @ (p / mass.clamp_min(1e-30)[:, None])
    assert torch.allclose(votes, torch.tensor([0.8, 0.2, 0.0]))
    assert torch.allclose(counts, torch.tensor([1.0, 1.0, 0.0]))
    # --count-floor 0.5: the heavy object still counts once, the light one 0.2 / 0.5 of a count;
    # a floor of 1 is the vote
    for floor, expected in ((0.5, [1.0, 0.4, 0.0]), (1.0, [0.8, 0.2, 0.0])):
        assert torch.allclose(a[0] @ (p / mass.clamp_min(floor)[:, None]), torch.tensor(expected))
    # ... which is what the model divides by
    feats, some = torch.randn(6, 8), torch.tensor([0.05, 0.2, 0.5, 0.7, 0.9, 1.0])
    m.count_floor = 0.5
    probs = m.classifier(feats).softmax(-1)
    assert torch.allclose(m.patch_values(feats, some), probs / some.clamp_min(0.5)[:, None])
    feats = torch.randn(5, 8)
    with pytest.raises(ValueError, match="needs the attention mass"):
        m.patch_values(feats)
    counted = m.patch_values(feats, torch.full((5,), 0.5))
    m.pooling = "votes"
    assert torch.allclose(counted, 2 * m.patch_values(feats))  # each patch's vote over its mass


def _spec(**kw):
    from ats_cli.config import TrainConfig
    return model_spec(TrainConfig(patch_size=16, scale=0.25, n_patches=4, feature_width=8, min_brightness=0.0,
                                  rarity_prior=0.0, **kw), n_classes=3, channels=1)


def test_votes_give_each_patch_at_most_its_share_where_features_let_a_confident_one_win():
    """Three patches read class 0 a little, one reads class 1 strongly, equal attention:
    the average of logits (what pooled features amount to) follows the confident patch,
    the vote the three."""
    m = create_model(_spec(pooling="votes")).eval()
    logits = torch.tensor([[1.0, 0.0, 0.0]] * 3 + [[0.0, 8.0, 0.0]])
    votes = logits.softmax(-1).mean(0, keepdim=True)
    assert logits.mean(0).argmax() == 1 and m.readout(votes).argmax() == 0
    # a patch of equal logits adds the same to every class: the vote's order is unchanged
    flat = torch.cat([logits.softmax(-1), torch.full((5, 3), 1 / 3)]).mean(0, keepdim=True)
    assert m.readout(flat).argsort().tolist() == m.readout(votes).argsort().tolist()


def test_the_pooling_is_in_the_spec_and_a_class_without_votes_stays_finite():
    m = create_model(_spec(pooling="votes"))
    assert m.pooling == "votes" and create_model(_spec()).pooling == "features"
    out = m.readout(torch.tensor([[0.5, 0.5, 0.0]]))
    assert torch.isfinite(out).all() and out[0, 2] < -80
    with pytest.raises(ValueError, match="unknown pooling 'mean'"):
        create_model({**_spec(), "pooling": "mean"})


def test_models_and_runs_from_before_the_votes_pool_features():
    old = {k: v for k, v in _spec().items() if k not in ("pooling", "none_class")} | {"version": 5}
    assert upgrade_spec(old)["pooling"] == "features" and upgrade_spec(old)["none_class"] is False
    assert create_model(old).pooling == "features" and create_model(old).none is None
    assert upgrade_run_config({"method": "ats"})["pooling"] == "features"
    assert upgrade_run_config({"method": "ats"})["none_class"] == "off"


def test_a_count_floor_outside_0_1_is_refused():
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="count_floor must be in"):
            resolve_config(None, pooling="counts", count_floor=bad)


def test_a_none_logit_is_refused_where_patches_do_not_vote():
    with pytest.raises(ConfigError, match="none_class on needs pooling votes or counts"):
        resolve_config(None, none_class="on")
    with pytest.raises(ValueError, match="none_class needs pooling votes or counts"):
        create_model({**_spec(), "none_class": True})
    m = create_model(_spec(pooling="votes", none_class="on"))
    feats = torch.randn(4, 8)
    with torch.no_grad():
        m.none.weight.zero_()
        m.none.bias.fill_(30.0)  # every patch sure it shows no class: it votes (almost) nothing
        assert float(m.patch_values(feats).sum(1).max()) < 1e-6


def test_votes_are_refused_where_nothing_is_pooled_by_attention():
    for method in ("cnn", "deepmil"):
        with pytest.raises(ConfigError, match=f"pooling votes: method {method}"):
            resolve_config(None, method=method, pooling="votes")
