"""`ats train --method`: every method is created by name, learns, saves, reloads and
predicts like ATS, and the baselines keep the properties that define them."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from ats_cli.baselines import CNNClassifier, DeepMIL, UniformAttention, grid_offsets
from ats_cli.baselines_ips import IPSModel
from ats_cli.baselines_tilemil import TileMIL
from ats_cli.checkpoint import CheckpointError, load_model, save_checkpoint
from ats_cli.cli import app
from ats_cli.config import ConfigError, TrainConfig
from ats_cli.core.model import ATSModel
from ats_cli.core.source import low_res_view
from ats_cli.models import (
    SPEC_VERSION,
    SpecVersionError,
    UnknownMethodError,
    available_methods,
    create_model,
    migrate_spec,
    model_spec,
)
from ats_cli.nets import create
from ats_cli.recipes import resolve_config
from ats_cli.train import train
from tests.test_train import _cfg, _write_squares_dataset

runner = CliRunner()
METHODS = ["ats", "uniform", "deepmil", "cnn", "ips", "tile-mil"]
# ips keeps 2 of the 4 grid patches of a 32x32 image, scored 3 at a time: selection happens
IPS_SMALL = {"ips_memory": 2, "ips_iter": 3}
SCALE = 0.25  # 32x32 images -> an 8x8 low-res view: 64 attention cells, 16x16 patches


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    return _write_squares_dataset(tmp_path_factory.mktemp("squares"), n_train=32, n_test=8)


def _spec(method: str, channels: int = 2, **kw) -> dict:
    kw = {**(IPS_SMALL if method == "ips" else {}), **kw}
    cfg = TrainConfig(method=method, n_patches=4, patch_size=16, scale=SCALE, feature_width=8, min_brightness=0.0,
                      **kw)
    return model_spec(cfg, n_classes=2, channels=channels)


def _coloured(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-channel 32x32 uint8 images whose class is the channel holding a random texture
    (the other is black): separable in every patch and in the low-res view alike, so every
    method can learn it, whatever it reads."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    images = torch.zeros(n, 2, 32, 32, dtype=torch.uint8)
    images[torch.arange(n), labels] = torch.randint(64, 256, (n, 32, 32), generator=g, dtype=torch.uint8)
    return images, labels


def _calibrate_frozen_encoder(net: torch.nn.Module) -> None:
    """tile-mil's encoder is frozen: at random initialisation its batch norms' statistics
    (mean 0, variance 1) leave features of ~0.005 that differ by less, nothing like what a
    pretrained encoder hands its head. Its batch norms' statistics taken on images of the
    task (as pretraining would have set them) stand in for pretraining; the weights stay random."""
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None  # the plain mean over the batch
    net.train()
    with torch.no_grad():
        net(_coloured(64, 999)[0][:, :, :16, :16].float() / 255)
    net.eval()


@pytest.mark.parametrize("method", METHODS)
def test_each_method_learns_a_separable_task_well_above_chance(method):
    torch.manual_seed(0)
    model = create_model(_spec(method))
    if method == "tile-mil":
        _calibrate_frozen_encoder(model.feature_net)
    steps = 60
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # a decaying rate, as ats train's default cosine schedule: the CNN's BatchNorm running
    # statistics (what eval mode uses) lag the weights while they still move fast
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        images, labels = _coloured(16, step)
        loss = model.loss(model(low_res_view(images, SCALE), images, generator=gen), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0], losses
    images, labels = _coloured(64, 10_000)  # images it never saw
    with torch.no_grad():
        predicted = model.eval()(low_res_view(images, SCALE), images, generator=gen).logits.argmax(1)
    assert (predicted == labels).float().mean() >= 0.9


@pytest.mark.parametrize("method", METHODS)
def test_create_model_round_trips_through_a_checkpoint_with_identical_outputs(tmp_path, method):
    spec = _spec(method)
    torch.manual_seed(0)
    model = create_model(spec).eval()
    save_checkpoint(tmp_path / "m.pt", spec=spec, classes=["a", "b"], model=model)
    loaded, ckpt = load_model(tmp_path / "m.pt")
    assert ckpt["spec"] == spec and type(loaded) is type(model) and not loaded.training  # the current layout
    images, _ = _coloured(3, 0)
    low = low_res_view(images, SCALE)
    with torch.no_grad():
        before = model(low, images, generator=torch.Generator().manual_seed(7))
        after = loaded(low, images, generator=torch.Generator().manual_seed(7))
    for field in ("logits", "attention", "offsets"):
        assert torch.equal(getattr(before, field), getattr(after, field)), field


def test_a_checkpoint_of_a_pre_release_or_later_spec_is_refused_in_one_line_naming_the_file(tmp_path):
    """Specs of the layout before the first release (versions 0 to 6, one of them also 1;
    all hold ``smoothing``) are refused, not guessed at; a later version asks for a newer ats."""
    good = _spec("ats")
    model = create_model(good)
    later = SPEC_VERSION + 1
    for name, spec, message in (("v6.pt", {**good, "version": 6, "smoothing": 0.0}, "version 6 was written by a "
                                                                                      "pre-release ats"),
                                ("v1.pt", {**good, "version": 1, "smoothing": 0.0},
                                 "version 1 was written by a pre-release ats"),
                                ("v0.pt", {k: v for k, v in good.items() if k != "version"} | {"smoothing": 0.0},
                                 "version 0 was written by a pre-release ats"),
                                ("later.pt", {**good, "version": later},
                                 f"version {later} is newer than this ats \\({SPEC_VERSION}\\); upgrade ats")):
        save_checkpoint(tmp_path / name, spec=spec, classes=["a", "b"], model=model)
        with pytest.raises(CheckpointError, match=f"{name}: model spec {message}") as e:
            load_model(tmp_path / name)
        assert "\n" not in str(e.value)
    save_checkpoint(tmp_path / "ok.pt", spec=good, classes=["a", "b"], model=model)
    assert load_model(tmp_path / "ok.pt")[1]["spec"]["version"] == SPEC_VERSION


# A spec as ats 0.1.0 wrote it (version 1): a setting that is off is absent.
V1_ONE_LEVEL = {"version": 1, "method": "ats", "attention_net": "mnist-attention",
                "attention_kwargs": {"in_channels": 2, "width": 8}, "feature_net": "small-cnn",
                "feature_kwargs": {"in_channels": 2, "width": 8}, "n_classes": 2, "channels": 2, "n_patches": 4,
                "eval_n_patches": 0, "patch_size": [16, 16], "scale": SCALE, "replace": False, "estimator": "auto",
                "entropy_weight": 0.01, "feature_scale": 10.0, "pooling": {"name": "features"}, "support": None,
                "prior": None, "gain": None,
                "input": {"reader": None, "level": None, "mpp": None, "tissue": None, "resample": True}}


def test_a_version_1_spec_migrates_to_the_current_one_with_what_version_1_assumed():
    """Version 1 carried "off" by leaving a key out; the migration writes the value its
    reader assumed, so that the spec says it and the model built is the one it always was."""
    assert SPEC_VERSION == 2
    assert migrate_spec(V1_ONE_LEVEL) == {**V1_ONE_LEVEL, "version": 2, "patch_loss": 0.0, "position": None,
                                          "multilabel": False, "levels": 1}
    assert V1_ONE_LEVEL["version"] == 1 and "levels" not in V1_ONE_LEVEL  # the caller's dict is untouched
    two = {**V1_ONE_LEVEL, "levels": 2, "regions": 4, "region_size": 32, "coarse_scale": 0.125,
           "input": {"reader": None, "level": None, "mpp": 0.5, "tissue": None}}  # before eval_* and temperature
    migrated = migrate_spec(two)
    assert {k: migrated[k] for k in ("eval_regions", "eval_coarse_scale", "region_temperature")} == {
        "eval_regions": 0, "eval_coarse_scale": 0.0, "region_temperature": 1.0}
    assert migrated["input"] == {"reader": None, "level": None, "mpp": 0.5, "tissue": None, "resample": None}
    current = migrate_spec(V1_ONE_LEVEL)
    assert migrate_spec(current) == current  # the current version passes through as it is
    # and what ats train writes now is of the current layout: every key the migration fills is there
    assert set(current) == set(_spec("ats"))
    with pytest.raises(SpecVersionError, match="version 3 is newer than this ats"):
        migrate_spec({**current, "version": 3})


def test_a_version_1_checkpoint_loads_and_predicts_as_the_model_it_always_built(tmp_path):
    """A checkpoint holding a version-1 spec (written as 0.1.0 wrote it) loads through the
    migration: the same weights, the same outputs as a model built from the spec in the
    current layout, and the loaded spec says version 2."""
    torch.manual_seed(0)
    model = create_model(V1_ONE_LEVEL).eval()
    save_checkpoint(tmp_path / "v1.pt", spec=V1_ONE_LEVEL, classes=["a", "b"], model=model)
    assert torch.load(tmp_path / "v1.pt", weights_only=True)["spec"]["version"] == 1  # as written
    loaded, ckpt = load_model(tmp_path / "v1.pt")
    assert ckpt["spec"] == migrate_spec(V1_ONE_LEVEL)
    images, _ = _coloured(3, 0)
    low = low_res_view(images, SCALE)
    with torch.no_grad():
        before = model(low, images, generator=torch.Generator().manual_seed(7))
        after = loaded(low, images, generator=torch.Generator().manual_seed(7))
    assert torch.equal(before.logits, after.logits) and torch.equal(before.attention, after.attention)


def test_an_unknown_method_is_refused_naming_the_available_ones(tmp_path):
    assert available_methods() == METHODS
    for method in available_methods():  # every registered method is a valid --method
        assert resolve_config(None, data="d", out="o", method=method).method == method
    with pytest.raises(UnknownMethodError,
                       match="unknown method 'mil'; available: ats, uniform, deepmil, cnn, ips, tile-mil"):
        create_model({**_spec("ats"), "method": "mil"})
    good = _spec("ats")
    save_checkpoint(tmp_path / "m.pt", spec={**good, "method": "mil"}, classes=["a", "b"], model=create_model(good))
    with pytest.raises(CheckpointError, match="m.pt: .*unknown method 'mil'; available: ats, uniform, deepmil, cnn, "
                                              "ips, tile-mil"):
        load_model(tmp_path / "m.pt")


def test_uniform_attention_is_exactly_uniform_and_has_no_parameters():
    model = create_model(_spec("uniform"))
    assert isinstance(model.attention_net, UniformAttention) and not list(model.attention_net.parameters())
    images, _ = _coloured(2, 0)
    out = model(low_res_view(images, SCALE), images)
    assert out.attention.shape == (2, 8, 8)
    assert torch.equal(out.attention, torch.full_like(out.attention, 1 / 64))


@pytest.mark.parametrize("method", METHODS)
def test_each_method_trains_reloads_and_predicts(squares, tmp_path, method):
    run = tmp_path / method
    history = train(_cfg(squares, run, method=method, epochs=1, **(IPS_SMALL if method == "ips" else {})),
                    log=lambda s: None)
    assert history[0]["samples"] == 32
    model, ckpt = load_model(run / "last.pt")
    assert ckpt["spec"]["method"] == method
    assert isinstance(model, {"ats": ATSModel, "uniform": ATSModel, "deepmil": DeepMIL, "cnn": CNNClassifier,
                              "ips": IPSModel, "tile-mil": TileMIL}[method])
    result = runner.invoke(app, ["predict", str(squares / "test" / "0.png"), "--model", str(run / "last.pt")])
    assert result.exit_code == 0, result.output
    assert "horizontal" in result.output or "vertical" in result.output


def test_method_flag_reaches_the_config_and_bad_names_are_refused(squares, tmp_path):
    result = runner.invoke(app, ["train", str(squares), "--out", str(tmp_path / "r"), "--method", "deepmil",
                                 "--epochs", "1", "--patch-size", "16", "--batch-size", "8", "--workers", "0",
                                 "--set", "feature_width=4"])
    assert result.exit_code == 0, result.output
    assert '"method": "deepmil"' in (tmp_path / "r" / "config.json").read_text()
    with pytest.raises(ConfigError, match="method must be one of"):
        resolve_config(None, data="d", out="o", method="mil")


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
    for method in ("deepmil", "cnn"):  # drawing needs a model, not a trained one
        spec = _spec(method, channels=1)
        save_checkpoint(tmp_path / f"{method}.pt", spec=spec, classes=["horizontal", "vertical"],
                        model=create_model(spec))
    image = str(squares / "test" / "0.png")
    ok = runner.invoke(app, ["visualize", image, "--model", str(tmp_path / "deepmil.pt"),
                             "--out", str(tmp_path / "d.png")])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "d.png").stat().st_size > 0
    refused = runner.invoke(app, ["visualize", image, "--model", str(tmp_path / "cnn.pt"),
                                  "--out", str(tmp_path / "c.png")])
    assert refused.exit_code == 2 and "no attention map" in refused.output
