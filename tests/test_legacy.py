"""Files written by an older ats load as their runs meant them (ats_cli.legacy)."""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("name", ["megapixel-mnist-ats.pt"])
def test_released_models_are_version_0_specs_read_as_auto(name):
    path = ROOT / "models" / name
    assert "version" not in torch.load(path, weights_only=True)["spec"]  # written before specs had one
    model, ckpt = load_model(path)
    assert ckpt["spec"]["version"] == SPEC_VERSION and model.estimator == "auto"
