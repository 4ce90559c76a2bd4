"""`ats train` with its defaults learns from scratch: no curriculum, no tuned flags.

The task is Megapixel MNIST in miniature: one striped square (its stripe direction is
the class, invisible at low resolution) among four noise squares of random dots of the
same density, on a black canvas. The attention must find the square and the feature net
read it. Only the sizes are given (patch, scale, number of patches, batch, epochs); every
training choice is the default. The thesis's choices (the paper's feature net, unscaled
features, a constant learning rate of 1e-3, no brightness support) stay at chance on the
same budget: the control shows the task is not trivial.
"""

from __future__ import annotations

import pytest
from test_train import _write_squares_dataset

from ats_cli.recipes import resolve_config
from ats_cli.train import train

SIZES = dict(n_patches=2, patch_size=16, scale=0.125, batch_size=16, epochs=3, workers=0, feature_width=16)
THESIS = dict(feature_net="mnist-features", feature_scale=1.0, schedule="constant", min_brightness=0.0, lr=1e-3)


@pytest.fixture(scope="module")
def hidden_squares(tmp_path_factory):
    return _write_squares_dataset(tmp_path_factory.mktemp("hidden"), n_train=256, n_test=128, size=96, box=12,
                                  period=3, floor=0, n_noise=4)


def _test_acc(data, out, **kw) -> float:
    cfg = resolve_config(None, data=str(data), out=str(out), seed=0, **SIZES, **kw)
    return max(h["test_acc"] for h in train(cfg, log=lambda s: None))


def test_default_training_from_scratch_beats_chance_where_the_thesis_loss_does_not(hidden_squares, tmp_path):
    assert _test_acc(hidden_squares, tmp_path / "defaults") >= 0.65  # 128 test images: chance is 0.5 +- 0.09
    assert _test_acc(hidden_squares, tmp_path / "thesis", **THESIS) <= 0.6


def test_auto_min_brightness_is_settled_from_the_data_and_recorded(hidden_squares, tmp_path):
    import json

    cfg = resolve_config(None, data=str(hidden_squares), out=str(tmp_path / "r"), **{**SIZES, "epochs": 1})
    assert cfg.min_brightness == -1
    train(cfg, log=lambda s: None)
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved["min_brightness"] == 0.15  # a black background
    reasons = json.loads((tmp_path / "r" / "settled.json").read_text())["reasons"]
    assert any(line.startswith("min_brightness 0.15: a black background") for line in reasons)
