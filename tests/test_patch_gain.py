"""The learned per-patch gain (ats_cli.extensions.gain_learned, ``--patch-gain``): it starts
as the unit-norm model, lets one patch outweigh many, is on for slides only, and a model
without it holds no gain. Its unbiasedness: tests/test_extensions.py."""

from __future__ import annotations

import pytest
import torch

from ats_cli.config import settle
from ats_cli.data.facts import DataFacts
from ats_cli.models import create_model, model_spec
from ats_cli.recipes import resolve_config


def _spec(**kw):
    from ats_cli.config import TrainConfig
    return model_spec(TrainConfig(patch_size=16, scale=0.25, n_patches=4, feature_width=8, min_brightness=0.0,
                                  rarity_prior=0.0, **kw), n_classes=2, channels=3)


def test_a_new_gain_is_one_for_every_patch_so_training_starts_from_the_unit_norm_model():
    torch.manual_seed(0)
    on = create_model(_spec(patch_gain="on")).eval()
    torch.manual_seed(0)
    off = create_model(_spec(patch_gain="off")).eval()
    off.load_state_dict({k: v for k, v in on.state_dict().items() if not k.startswith("gain.")})
    patches = torch.rand(5, 3, 16, 16)
    assert on.gain is not None and off.gain is None
    assert torch.allclose(on.patch_features(patches), off.patch_features(patches), atol=1e-6)
    assert torch.allclose(off.patch_features(patches).norm(dim=-1), torch.full((5,), off.feature_scale))


def test_one_patch_with_a_large_gain_outweighs_many_with_more_attention():
    """What the gain is for: a patch holding 5% of the attention (a lone nest) swings the
    pooled feature past seven look-alikes holding the rest, which unit norms cannot do."""
    torch.manual_seed(0)
    m = create_model(_spec(patch_gain="on")).eval()
    patches = torch.cat([torch.rand(1, 3, 16, 16), torch.rand(1, 3, 16, 16).expand(7, -1, -1, -1)])  # 1 unlike 7
    a = torch.tensor([0.05] + [0.95 / 7] * 7)
    cos = torch.nn.functional.cosine_similarity
    with torch.no_grad():
        unit = m.patch_features(patches)  # gain 1 everywhere: the unit-norm model
        assert cos(a @ unit, unit[1], dim=0) > cos(a @ unit, unit[0], dim=0)  # the seven win
        raw = m.feature_net(patches)
        d = raw[0] - raw[1]  # a gain that is large on the first patch's raw feature, small on the others'
        m.gain.linear.weight.copy_(60 * d[None] / d.norm() ** 2)
        m.gain.linear.bias.fill_(-60 * float(raw[1] @ d / d.norm() ** 2) - 5.0)
        f = m.patch_features(patches)
        assert cos(a @ f, f[0], dim=0) > 0.99  # the one wins


@pytest.mark.parametrize("channels, masked, method, want", [
    (3, 4, "ats", "on"),  # slides: one nest among look-alikes decides
    (1, 4, "ats", "on"),  # grey slides too: the reason is the label, not the stain
    (3, 0, "ats", "off"),  # photographs, digits: a count weighs each object alike
    (3, 4, "uniform", "off"),  # the baselines pool as the thesis did
])
def test_auto_turns_the_gain_on_for_slides_only(channels, masked, method, want):
    facts = DataFacts(channels=channels, probed=4, masked=masked)  # of the first training images, with a tissue mask
    assert settle(resolve_config(None, method=method), facts)[0].config.patch_gain == want
    explicit = resolve_config(None, method=method, patch_gain="off" if want == "on" else "on")
    assert settle(explicit, facts)[0].config.patch_gain != want


def test_a_model_without_the_gain_holds_no_gain_weights():
    spec = _spec(patch_gain="off")
    assert spec["gain"] is None and _spec(patch_gain="on")["gain"] == {"name": "learned"}
    torch.manual_seed(0)
    model = create_model(spec)
    assert model.gain is None and not any(k.startswith("gain.") for k in model.state_dict())
    shape = create_model(_spec(patch_gain="on")).state_dict()["gain.linear.weight"].shape
    assert shape == (1, model.classifier.in_features)
