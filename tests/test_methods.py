"""`ats train --method`: every baseline trains, saves, reloads and predicts like ATS."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from ats_cli.baselines import DeepMIL, grid_offsets
from ats_cli.checkpoint import load_model
from ats_cli.cli import app
from ats_cli.config import ConfigError, resolve_config
from ats_cli.nets import create
from ats_cli.train import train
from tests.test_train import _cfg, _write_squares_dataset

runner = CliRunner()


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    return _write_squares_dataset(tmp_path_factory.mktemp("squares"), n_train=32, n_test=8)


@pytest.mark.parametrize("method", ["ats", "uniform", "deepmil", "cnn"])
def test_each_method_trains_reloads_and_predicts(squares, tmp_path, method):
    run = tmp_path / method
    history = train(_cfg(squares, run, method=method, epochs=1), log=lambda s: None)
    assert history[0]["samples"] == 32 and 0 <= history[0]["test_acc"] <= 1
    model, ckpt = load_model(run / "last.pt")
    assert ckpt["spec"]["method"] == method
    result = runner.invoke(app, ["predict", str(squares / "test" / "0.png"), "--model", str(run / "last.pt")])
    assert result.exit_code == 0, result.output
    assert "horizontal" in result.output or "vertical" in result.output


def test_method_flag_reaches_the_config_and_bad_names_are_refused(squares, tmp_path):
    result = runner.invoke(app, ["train", str(squares), "--out", str(tmp_path / "r"), "--method", "deepmil",
                                 "--epochs", "1", "--patch-size", "16", "--batch-size", "8", "--workers", "0",
                                 "--feature-width", "4"])
    assert result.exit_code == 0, result.output
    assert '"method": "deepmil"' in (tmp_path / "r" / "config.json").read_text()
    with pytest.raises(ConfigError, match="method must be one of"):
        resolve_config(None, data="d", out="o", method="mil")


def test_uniform_attention_is_uniform_and_has_no_parameters(squares, tmp_path):
    run = tmp_path / "u"
    train(_cfg(squares, run, method="uniform", epochs=1), log=lambda s: None)
    model, _ = load_model(run / "last.pt")
    assert not list(model.attention_net.parameters())
    out = model(torch.rand(2, 1, 8, 8), torch.randint(0, 255, (2, 1, 64, 64), dtype=torch.uint8))
    assert torch.allclose(out.attention, torch.full_like(out.attention, 1 / 64))


def test_grid_covers_the_image_with_half_patch_stride():
    grid, shape = grid_offsets((64, 70), (16, 16), (8, 8))
    assert shape == (7, 8)  # rows 0..48 step 8; cols 0..48 step 8 plus 54 so the last patch ends at 70
    assert grid[:, 0].max() == 48 and grid[:, 1].max() == 54 and grid.min() == 0


def test_deepmil_reads_every_grid_patch_and_its_attention_sums_to_one():
    torch.manual_seed(0)
    model = DeepMIL(create("mnist-features", in_channels=1, width=4), 3, patch_size=(16, 16))
    image = torch.randint(0, 255, (2, 1, 64, 64), dtype=torch.uint8)
    out = model(torch.rand(2, 1, 8, 8), image, return_patches=True)
    assert out.attention.shape == (2, 7, 7) and out.patches.shape == (2, 49, 1, 16, 16)
    assert torch.allclose(out.attention.sum((1, 2)), torch.ones(2))
    # the 2nd patch of the first row starts half a patch to the right
    assert torch.equal(out.patches[0, 1, 0], image[0, 0, :16, 8:24].float() / 255)
    model.loss(out, torch.tensor([0, 2])).backward()
    assert model.att_u.weight.grad is not None and model.feature_net.body[0].weight.grad.abs().sum() > 0


def test_visualize_draws_deepmil_attention_and_refuses_a_cnn(squares, tmp_path):
    for method in ("deepmil", "cnn"):
        train(_cfg(squares, tmp_path / method, method=method, epochs=1), log=lambda s: None)
    image = str(squares / "test" / "0.png")
    ok = runner.invoke(app, ["visualize", image, "--model", str(tmp_path / "deepmil" / "last.pt"),
                             "--out", str(tmp_path / "d.png")])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "d.png").stat().st_size > 0
    refused = runner.invoke(app, ["visualize", image, "--model", str(tmp_path / "cnn" / "last.pt"),
                                  "--out", str(tmp_path / "c.png")])
    assert refused.exit_code == 2 and "no attention map" in refused.output
