"""Pooling votes (``--pooling votes``, ats_cli.core.model.ATSModel.patch_values): the
estimate of E_a[p] stays unbiased in value and in the gradient of every parameter, a
confident patch cannot outvote several, a patch of equal logits does not vote, and
models and runs saved before it keep pooling features."""

from __future__ import annotations

import pytest
import torch

from ats_cli.config import ConfigError, resolve_config
from ats_cli.legacy import upgrade_run_config, upgrade_spec
from ats_cli.models import create_model, model_spec
from tests.test_auxiliary_losses import Z_MAX, _model, _z_of_classification_gradient


@pytest.mark.parametrize("estimator", ["sequential", "threshold"])
def test_value_and_gradient_stay_unbiased_with_votes(estimator):
    """The pooled probabilities exp(logits) = estimate of sum_i a_i p_i: its Monte Carlo
    mean and the mean of its gradient (attention net, feature net, classifier) match the
    exact expectation over every position (tests/test_auxiliary_losses.py's check, whose
    negative control shows it rejects a biased pooling)."""
    assert _z_of_classification_gradient(_model(estimator, pooling="votes"), value=True) < Z_MAX


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
    old = {k: v for k, v in _spec().items() if k != "pooling"} | {"version": 5}
    assert upgrade_spec(old)["pooling"] == "features"
    assert create_model(old).pooling == "features"
    assert upgrade_run_config({"method": "ats"})["pooling"] == "features"


def test_votes_are_refused_where_nothing_is_pooled_by_attention():
    for method in ("cnn", "deepmil"):
        with pytest.raises(ConfigError, match=f"pooling votes: method {method}"):
            resolve_config(None, method=method, pooling="votes")
