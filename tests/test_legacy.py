"""Files written by an older ats load as their runs meant them (ats_cli.legacy)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ats_cli.checkpoint import CheckpointError, load_checkpoint, load_model, save_checkpoint
from ats_cli.config import TrainConfig
from ats_cli.legacy import SPEC_VERSION, upgrade_run_config, upgrade_spec
from ats_cli.models import create_model, model_spec

ROOT = Path(__file__).resolve().parents[1]


def _spec(**kw):
    return model_spec(TrainConfig(patch_size=16, scale=0.25, n_patches=4, feature_width=8, min_brightness=0.0, **kw),
                      n_classes=3, channels=1)


def test_a_new_spec_carries_the_version_and_upgrades_to_itself():
    spec = _spec(estimator="sequential")
    assert spec["version"] == SPEC_VERSION
    assert upgrade_spec(spec) == spec and upgrade_spec(spec) is not spec


def test_a_spec_from_before_versions_gets_what_its_run_used():
    old = _spec()
    for key in ("version", "method", "feature_scale", "input", "estimator"):
        del old[key]
    new = upgrade_spec(old)
    assert new["version"] == SPEC_VERSION and new["method"] == "ats" and new["feature_scale"] == 1.0
    assert new["input"] == {"reader": None, "level": None, "mpp": None, "tissue": None, "resample": False}
    assert new["estimator"] == "auto"  # prediction-time choice; see SPEC_LEGACY
    assert "version" not in old, "the caller's spec is not changed"
    # a key a version-0 file did hold keeps its value
    old["estimator"] = "sequential"
    assert upgrade_spec(old)["estimator"] == "sequential"


def test_a_resumed_run_without_the_key_keeps_the_estimator_it_trained_with():
    assert upgrade_run_config({"n_patches": 7})["estimator"] == "sequential"
    assert upgrade_run_config({"estimator": "auto"})["estimator"] == "auto"


def test_a_newer_or_broken_spec_is_refused_by_name(tmp_path):
    spec = _spec()
    path = tmp_path / "new.pt"
    save_checkpoint(path, spec={**spec, "version": SPEC_VERSION + 1}, classes=["a", "b", "c"],
                    model=create_model(spec))
    with pytest.raises(CheckpointError, match=rf"new.pt: model spec version {SPEC_VERSION + 1} is newer"):
        load_checkpoint(path)
    current = {k: v for k, v in spec.items() if k != "min_brightness"}  # in every spec ats wrote
    save_checkpoint(tmp_path / "hand.pt", spec=current, classes=["a", "b", "c"], model=create_model(spec))
    with pytest.raises(CheckpointError, match="hand.pt: checkpoint does not match its model spec .*min_brightness"):
        load_model(tmp_path / "hand.pt")


@pytest.mark.parametrize("path", ["tests/data/megapixel-mnist-ats-2026-11-24.pt"])
def test_released_models_are_version_0_specs_read_as_auto(path):
    """The Megapixel MNIST model released until 2026-11-25, kept as a fixture: a version-0
    spec (written before specs had a version) still loads, with the estimator as auto."""
    path = ROOT / path
    assert "version" not in torch.load(path, weights_only=True)["spec"]  # written before specs had one
    model, ckpt = load_model(path)
    assert ckpt["spec"]["version"] == SPEC_VERSION and model.estimator == "auto"


def test_a_version_2_model_trained_with_mpp_reads_the_closest_level_as_it_is(tmp_path):
    """Before models knew their microns, --mpp picked the closest level and never resampled:
    such a model (spec version 2, input.mpp set) keeps reading that way (SPEC_INPUT_LEGACY_3)."""
    import tifffile

    from ats_cli.predict import load_predictor

    old = model_spec(TrainConfig(patch_size=16, scale=0.25, n_patches=4, feature_width=8, min_brightness=0.0, mpp=0.5),
                     n_classes=3, channels=3)
    old["version"] = 2
    old["input"] = {k: v for k, v in old["input"].items() if k != "resample"}
    path = tmp_path / "v2.pt"
    save_checkpoint(path, spec=old, classes=["a", "b", "c"], model=create_model(old))
    predictor = load_predictor(path, "cpu")
    assert predictor.input_options["resample"] is False and predictor.input_options["mpp"] == 0.5
    slide = tmp_path / "x40.tif"  # levels at 0.25, 0.75 µm/px: 0.75 is the closest to 0.5 (in log scale)
    with tifffile.TiffWriter(slide) as tw:
        image = np.full((192, 192, 3), 128, np.uint8)
        for k, step in enumerate((1, 3)):
            tw.write(image[::step, ::step].copy(), tile=(64, 64), subfiletype=1 if k else 0, photometric="rgb",
                     metadata=None,
                     resolution=(1e4 / (0.25 * step), 1e4 / (0.25 * step)), resolutionunit="CENTIMETER")
    kw = {"channels": 3, "scale": 0.25, "patch_size": (16, 16)}
    assert predictor.opener()(slide, **kw).source.size == (64, 64)  # level 1, as it is
    assert predictor.opener(mpp=0.5)(slide, **kw).source.size == (96, 96)  # --mpp today: level 0 resampled 1.5x


def test_evaluation_draws_twice_the_training_patches_and_older_models_their_training_count():
    """eval_n_patches (spec version 4): a new model draws n_patches in training and twice as
    many in evaluation and prediction; a model saved before records none and keeps predicting
    with its training count, as its card measured; 0 = as in training; an argument wins."""
    low, image = torch.rand(2, 1, 16, 16), torch.rand(2, 1, 64, 64)

    def drawn(spec, train: bool, n=None) -> int:
        torch.manual_seed(0)
        model = create_model(spec).train(train)
        with torch.no_grad():
            return model(low, image, n_patches=n).offsets.shape[1]

    new = _spec()
    assert new["eval_n_patches"] == 8
    assert (drawn(new, True), drawn(new, False), drawn(new, False, n=5)) == (4, 8, 5)
    old = {k: v for k, v in new.items() if k != "eval_n_patches"} | {"version": 3}
    assert upgrade_spec(old)["eval_n_patches"] == 0 and drawn(old, False) == 4
    assert drawn(_spec(eval_n_patches=0), False) == 4 and drawn(_spec(eval_n_patches=6), False) == 6
