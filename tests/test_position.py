"""Position-aware features (ats_cli.extensions.position): the estimate and its gradients stay
unbiased with the position in the feature, a variant that encodes the position relative to
the other draws fails the same check (tests/montecarlo.py), and the option reaches the model
from the command line's config and back from its checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ats_cli.config import ConfigError, TrainConfig
from ats_cli.extensions.position import PositionalAttention, PositionFeatures, patch_centres
from ats_cli.models import create_model, model_spec
from ats_cli.nets import create as create_net
from tests.montecarlo import Z_MAX, TinyFeatures, cell_positions, image, tiny_model, z_of_estimate

D = TinyFeatures.out_features
REJECTED = 3 * Z_MAX
QUICK = {"groups": 20, "per_group": 200}


class _RelativeToTheDraws(PositionFeatures):
    """The position minus the mean position of the patches drawn with it: depends on the draw."""

    def forward(self, feats, pos):
        return super().forward(feats, pos - pos.mean(-2, keepdim=True))


def _active(position: PositionFeatures) -> PositionFeatures:
    torch.manual_seed(11)
    nn.init.normal_(position.out.weight, std=1.0)  # zero at the start: here the position does change f
    return position


def test_patch_centres_are_the_centres_over_the_image_size():
    offsets = torch.tensor([[[0, 0], [90, 40], [-4, 196]]])
    pos = patch_centres(offsets, torch.tensor([[100, 200]]), (10, 8))
    assert torch.allclose(pos, torch.tensor([[[0.05, 0.02], [0.95, 0.22], [0.01, 1.0]]]))


def test_position_features_are_unbiased():
    m = tiny_model("threshold", position=_active(PositionFeatures(D, frequencies=2)))
    f = torch.ones(1, 36, D)
    moved = m.position(f, cell_positions(m, image()))
    assert float((moved[0, 0] - moved[0, -1]).abs().max().detach()) > 0.1  # the position matters
    assert z_of_estimate(m) < Z_MAX


def test_the_check_rejects_positions_relative_to_the_draws():
    m = tiny_model("sequential", position=_active(_RelativeToTheDraws(D, frequencies=2)))
    assert z_of_estimate(m, **QUICK) > REJECTED


def test_the_option_is_in_the_spec_and_rebuilds_the_same_model():
    """--position-features on: the spec says so (a model without it says null), and
    a model rebuilt from the spec has the module, so predict uses the positions too."""
    cfg = TrainConfig(position_features="on", n_patches=2, patch_size=28, scale=0.25, feature_width=8,
                      attention_width=4, eval_n_patches=0, min_brightness=0, rarity_prior=0, patch_gain="off")
    spec = model_spec(cfg, n_classes=3, channels=1)
    assert spec["position"] == {"frequencies": 4, "attention": True}
    assert model_spec(TrainConfig(**{**cfg.to_dict(), "position_features": "off"}), n_classes=3,
                      channels=1)["position"] is None
    m = create_model(spec)
    assert isinstance(m.position, PositionFeatures) and isinstance(m.attention_net, PositionalAttention)
    again = create_model(spec)
    again.load_state_dict(m.state_dict())
    assert any(k.startswith("position.") for k in m.state_dict())


def test_a_method_without_sampled_patches_refuses_the_option():
    with pytest.raises(ConfigError, match="position_features on: method deepmil does not pool sampled patches"):
        TrainConfig(position_features="on", method="deepmil").validate()


class _JitteredCoordinates(PositionalAttention):
    """Coordinates shifted by fresh noise at every call: not a fixed function of the cell."""

    def forward(self, x):
        b, _, h, w = x.shape
        noise = torch.rand(b, 2, h, w, device=x.device, dtype=x.dtype)
        return self.net(torch.cat([x, noise], dim=1))


def _positional(cls=PositionalAttention) -> PositionalAttention:
    torch.manual_seed(5)
    wrapped = cls(create_net("mnist-attention", in_channels=3, width=4))
    nn.init.normal_(wrapped.net.score.weight, std=0.5)  # zero-initialised last layer
    return wrapped


def test_positional_attention_is_unbiased_and_sees_where():
    """The attention fed each cell's place: the map of a flat image is no longer flat (a
    plain conv attention's interior is, the negative control), and the estimate and every
    gradient stay unbiased."""
    flat = torch.full((1, 1, 16, 16), 0.5)
    plain = create_net("mnist-attention", in_channels=1, width=4)
    nn.init.normal_(plain.score.weight, std=0.5)
    inner = (slice(None), slice(None), slice(3, -3), slice(3, -3))  # away from the zero padding
    assert float(plain(flat)[inner].detach().std()) < 1e-6
    assert float(_positional()(flat)[inner].detach().std()) > 1e-3
    m = tiny_model("threshold")
    m.attention_net = _positional()
    assert z_of_estimate(m) < Z_MAX


def test_the_check_rejects_coordinates_that_change_between_calls():
    m = tiny_model("sequential")
    m.attention_net = _positional(_JitteredCoordinates)
    assert z_of_estimate(m, **QUICK) > REJECTED
