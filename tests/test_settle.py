"""Settling a run's configuration: one rule per value left to the data, given values win,
every value says why, and the decision is a pure function of the flags and the facts."""

from __future__ import annotations

import builtins
import copy
import io
import json
import re
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from ats_cli.config import (
    AUTO_MIN_BRIGHTNESS,
    AUTO_RARITY_PRIOR,
    AUTO_VIEW_PIXELS,
    DATA_DEFAULTS,
    TWO_LEVEL_RARITY_CAP,
    TWO_LEVEL_RARITY_PRIOR,
    TWO_LEVEL_REGION_TEMPERATURE,
    ConfigError,
    TrainConfig,
    levels_spec,
    read_hints,
    settle,
    settle_data,
)
from ats_cli.data.dataset import load_dataset, write_dataset
from ats_cli.data.facts import DataFacts, SettledFileError, load_facts, save_settled

SETTLED = ("n_patches", "patch_size", "scale", "batch_size", "eval_n_patches", "min_brightness", "augment",
           "rarity_prior", "rarity_cap", "patch_loss", "patch_gain", "feature_net", "feature_train",
           "feature_store", "position_features", "pooling", "none_class", "count_floor", "eval_count_floor")
MNIST = DataFacts(hints={"n_patches": 10, "patch_size": 50, "scale": 0.12}, channels=1, files=40, probed=16, dark=0.9)
SLIDES = DataFacts(hints={"n_patches": 12, "patch_size": 64, "scale": 1 / 32}, channels=3, files=12,
                   mpps=(0.5,) * 12, mpps_agree=True, probed=12, masked=12)


def _why(reasons) -> dict[str, str]:
    return {r.key: str(r) for r in reasons}


def test_settle_is_pure_and_leaves_no_auto_value(monkeypatch):
    flags, facts = TrainConfig(data="d", out="o"), SLIDES
    before = (copy.deepcopy(flags), copy.deepcopy(facts))

    def no_io(*args, **kwargs):
        raise AssertionError("settle read a file")

    monkeypatch.setattr(builtins, "open", no_io)
    monkeypatch.setattr(io, "open", no_io)  # pathlib's
    first, second = settle(flags, facts), settle(flags, facts)
    monkeypatch.undo()
    assert (flags, facts) == before  # nothing mutated
    assert first == second and first[0].config is not flags
    config = first[0].config
    assert config.eval_n_patches >= 0 and config.min_brightness >= 0 and config.rarity_prior >= 0
    assert config.rarity_cap >= 0
    assert "auto" not in (config.augment, config.patch_gain, config.feature_net, config.feature_train,
                          config.feature_store, config.position_features, config.pooling, config.none_class)
    assert config.count_floor >= 0 and config.eval_count_floor >= 0
    assert config.n_patches and config.patch_size and config.scale
    assert [r.key for r in first[1]] == ["mpp", *SETTLED]  # one reason per value, the microns first


def test_values_given_by_the_user_always_win():
    given = dict(n_patches=7, patch_size=32, scale=0.25, eval_n_patches=0, min_brightness=0.3, augment="colour",
                 rarity_prior=0.5, patch_gain="off", batch_size=5)
    for facts in (MNIST, SLIDES):  # facts that would decide otherwise
        settled, reasons = settle(TrainConfig(**given), facts)
        assert {k: getattr(settled.config, k) for k in given} == given
        assert all(r.why.startswith("given") for r in reasons if r.key in given)


def test_sizes_come_from_the_dataset_hints_then_the_papers_defaults():
    settled, reasons = settle(TrainConfig(n_patches=7), SLIDES)
    assert (settled.config.n_patches, settled.config.patch_size, settled.config.scale) == (7, 64, 1 / 32)
    why = _why(reasons)
    assert why["n_patches"] == "n_patches 7: given"
    assert why["patch_size"] == "patch_size 64: dataset.json hint; 32 µm"  # the slides' microns say what it covers
    bare, reasons = settle(TrainConfig(), DataFacts())
    assert tuple(getattr(bare.config, k) for k in DATA_DEFAULTS) == tuple(DATA_DEFAULTS.values())
    assert _why(reasons)["scale"] == "scale 0.12: default (the paper's Megapixel MNIST)"


def test_sizes_without_a_hint_follow_the_images_size_in_the_papers_proportions():
    """No flag, no hint: a 180-px view, as the paper's 1500-px Megapixel MNIST (0.12), and 32
    patches of 1/16 of the typical long side; ats info prints the same (sizes_for)."""
    for side, (patch, scale) in {1500: (96, 0.12), 1284: (80, 0.1402), 800: (48, 0.225), 6000: (128, 0.03),
                                 100: (32, 1.0), 20: (20, 1.0)}.items():
        settled, reasons = settle(TrainConfig(), DataFacts(long_side=side))
        assert (settled.config.n_patches, settled.config.patch_size, settled.config.scale) == (32, patch, scale), side
        assert f"typical long side is {side} px" in _why(reasons)["scale"]
    # a flag or a hint still wins
    assert settle(TrainConfig(scale=0.5), DataFacts(long_side=800))[0].config.scale == 0.5


def test_eval_n_patches_auto_is_twice_the_training_count():
    assert _why(settle(TrainConfig(), MNIST)[1])["eval_n_patches"] == "eval_n_patches 20: twice n_patches"
    assert settle(TrainConfig(n_patches=3), MNIST)[0].config.eval_n_patches == 6
    assert settle(TrainConfig(eval_n_patches=0), MNIST)[0].config.eval_n_patches == 0  # 0: as many as in training


def test_min_brightness_auto_is_on_for_a_black_background_only():
    settled, reasons = settle(TrainConfig(), MNIST)
    assert settled.config.min_brightness == AUTO_MIN_BRIGHTNESS
    assert "90% of the low-res pixels dark in the first 16 training images" in _why(reasons)["min_brightness"]
    light = DataFacts(probed=16, dark=0.1)
    assert settle(TrainConfig(), light)[0].config.min_brightness == 0.0
    assert settle(TrainConfig(method="uniform"), MNIST)[0].config.min_brightness == 0.0  # baselines: everywhere


@pytest.mark.parametrize("facts, method, want", [
    (SLIDES, "ats", "colour+flips"),  # RGB slides: stain, exposure and orientation vary
    (DataFacts(channels=1, probed=4, masked=4), "ats", "none"),  # grey slides: no stain to jitter
    (DataFacts(channels=3, probed=4, masked=1), "ats", "none"),  # photographs, digits: a turned 6 is a 9
    (SLIDES, "uniform", "none"),  # the baselines train as the thesis's did
])
def test_augment_auto_is_colour_and_flips_for_rgb_slides_only(facts, method, want):
    settled, reasons = settle(TrainConfig(method=method), facts)
    assert settled.config.augment == want
    assert _why(reasons)["augment"].startswith(f"augment {want}: ")


@pytest.mark.parametrize("facts, method, gain, prior", [
    (SLIDES, "ats", "on", AUTO_RARITY_PRIOR),
    (DataFacts(channels=1, probed=4, masked=4), "ats", "on", AUTO_RARITY_PRIOR),  # the label decides, not the stain
    (MNIST, "ats", "off", 0.0),  # a count weighs each object alike; the black canvas needs no prior
    (SLIDES, "uniform", "off", 0.0),  # the baselines pool and sample as the thesis's did
])
def test_patch_gain_and_rarity_prior_auto_are_on_for_slides_only(facts, method, gain, prior):
    settled, reasons = settle(TrainConfig(method=method), facts)
    assert (settled.config.patch_gain, settled.config.rarity_prior) == (gain, prior)
    assert ("on: slides: a tissue mask on 12 of the first 12 training images" in _why(reasons)["patch_gain"]) == (
        facts is SLIDES and method == "ats")


def test_two_levels_start_the_coarse_attention_on_the_unusual_regions():
    two = dict(levels=2, region_size=768)
    settled, reasons = settle(TrainConfig(**two), SLIDES)
    c = settled.config
    assert (c.rarity_prior, c.rarity_cap, c.region_temperature) == (
        TWO_LEVEL_RARITY_PRIOR, TWO_LEVEL_RARITY_CAP, TWO_LEVEL_REGION_TEMPERATURE) == (10.0, 4.5, 0.1)
    keys = [r.key for r in reasons]
    assert keys.index("rarity_cap") == keys.index("rarity_prior") + 1 and "region_temperature" in keys
    assert "two levels" in _why(reasons)["rarity_prior"] and "two levels" in _why(reasons)["rarity_cap"]
    assert c.patch_gain == "late" and "two levels" in _why(reasons)["patch_gain"]
    # one level on the same slides: as it always was (prior 2, no cap, no region temperature decided)
    one, reasons = settle(TrainConfig(), SLIDES)
    assert (one.config.rarity_prior, one.config.rarity_cap, one.config.patch_gain) == (AUTO_RARITY_PRIOR, 0.0, "on")
    assert "region_temperature" not in [r.key for r in reasons]
    # two levels off slides: no prior, so no cap; the region score still follows its largest cell
    bare = settle(TrainConfig(**two), MNIST)[0].config
    assert (bare.rarity_prior, bare.rarity_cap, bare.region_temperature) == (0.0, 0.0, 0.1)
    # given values win, each alone: a given prior is still capped with two levels, a given cap or t stays
    assert settle(TrainConfig(**two, rarity_prior=3.0), SLIDES)[0].config.rarity_cap == TWO_LEVEL_RARITY_CAP
    given = settle(TrainConfig(**two, rarity_cap=0.0, region_temperature=1.0), SLIDES)[0].config
    assert (given.rarity_prior, given.rarity_cap, given.region_temperature) == (TWO_LEVEL_RARITY_PRIOR, 0.0, 1.0)


def test_batch_size_auto_keeps_a_steps_views_bounded():
    """32 images a step, unless their low-res views would hold more than AUTO_VIEW_PIXELS:
    100k² slides seen at 1/64 (a two-level model's coarse view, or one level's) train 3 a
    step; 3k slides at 1/32 the usual 32; a given size wins."""
    big = replace(SLIDES, sizes=("100000x100000 at 0.5 µm/px",), n_sizes=1, pixels=100_000 ** 2)
    two = dict(levels=2, regions=8, region_size=768, coarse_px=12, scale=0.125, patch_size=64)
    settled, reasons = settle(TrainConfig(**two), big)
    assert settled.config.batch_size == 3 == AUTO_VIEW_PIXELS // round((100_000 / 64) ** 2)
    assert "low-res view 2.4 M pixels: at most 8 M a step" in _why(reasons)["batch_size"]
    assert settle(TrainConfig(scale=1 / 64), big)[0].config.batch_size == 3  # one level at the same scale
    assert settle(TrainConfig(**two, batch_size=4), big)[0].config.batch_size == 4
    small = replace(SLIDES, sizes=("3072x3072 at 0.5 µm/px",), n_sizes=1, pixels=3072 ** 2, files=1000)
    assert settle(TrainConfig(), small)[0].config.batch_size == 32


def test_batch_size_auto_gives_a_small_dataset_steps():
    """A small dataset trains at least AUTO_MIN_STEPS steps an epoch, in batches of at least
    MIN_STEP_BATCH; a large one the usual 32 (negative control); the view bound still wins."""
    photos = replace(SLIDES, sizes=("800x800",), n_sizes=1, pixels=800 ** 2)
    for files, batch in ((144, 9), (40, 4), (512, 32), (5000, 32)):
        settled, reasons = settle(TrainConfig(), replace(photos, files=files))
        assert settled.config.batch_size == batch, files
    assert "144 training images: 16 steps an epoch" in _why(settle(TrainConfig(), replace(photos, files=144))[1])[
        "batch_size"]
    big = replace(SLIDES, sizes=("100000x100000 at 0.5 µm/px",), n_sizes=1, pixels=100_000 ** 2, files=144)
    assert settle(TrainConfig(scale=1 / 64), big)[0].config.batch_size == 3


def test_position_features_auto_follows_the_datasets_hint():
    """The top task's label is where a digit is: its dataset.json says so, and auto obeys;
    no hint (negative control), a baseline or a given value: the thesis's model or the flag."""
    top = DataFacts(hints=MNIST.hints, probed=16, dark=0.9, position_hint="on")
    settled, reasons = settle(TrainConfig(), top)
    assert settled.config.position_features == "on"
    assert _why(reasons)["position_features"].startswith("position_features on: dataset.json hint")
    assert settle(TrainConfig(), MNIST)[0].config.position_features == "off"
    assert settle(TrainConfig(method="uniform"), top)[0].config.position_features == "off"
    assert settle(TrainConfig(position_features="off"), top)[0].config.position_features == "off"
    assert settle(TrainConfig(position_features="on"), MNIST)[0].config.position_features == "on"


def test_the_models_microns_and_sizes_in_microns():
    settled, reasons = settle(TrainConfig(patch_um=32.0, low_res_um=8.0), SLIDES)
    assert (settled.mpp, settled.config.patch_size, settled.config.scale) == (0.5, 64, 1 / 16)
    why = _why(reasons)
    assert why["mpp"] == "mpp 0.5 µm/px: the training slides' own (12 of 12 record it)"
    assert why["patch_size"] == "patch_size 64: --patch-um 32 at 0.5 µm/px; 32 µm"
    assert settle(TrainConfig(mpp=1.0, patch_um=32.0), SLIDES)[0].config.patch_size == 32  # --mpp: read at it
    # a resumed run's config.json holds both forms of a setting, in agreement: accepted
    assert settle(TrainConfig(patch_um=32.0, patch_size=64, low_res_um=8.0, scale=1 / 16), SLIDES)[0].mpp == 0.5
    two_scans = DataFacts(files=2, mpps=(0.25, 0.5))
    settled, reasons = settle(TrainConfig(), two_scans)
    assert settled.mpp is None and "range from 0.25 µm/px to 0.5 µm/px (give --mpp" in _why(reasons)["mpp"]
    assert settle(TrainConfig(), MNIST)[1][0].key == "n_patches"  # images without microns: nothing to say
    with pytest.raises(ConfigError, match="--patch-um 32 needs the microns per pixel"):
        settle(TrainConfig(patch_um=32.0), two_scans)
    with pytest.raises(ConfigError, match=r"b.tif: records no microns per pixel, so it cannot be read at --mpp 0.5 "
                                          r"\(1 of 2 training files"):
        settle(TrainConfig(mpp=0.5), DataFacts(files=2, mpps=(0.5,), no_mpp="b.tif"))
    with pytest.raises(ConfigError, match="64 pixels at 0.5 µm/px, --patch-size is 50: give one"):
        settle(TrainConfig(patch_um=32.0, patch_size=50), SLIDES)
    with pytest.raises(ConfigError, match="finer than the patches"):
        settle(TrainConfig(low_res_um=0.25), SLIDES)


def _pngs(root, background: int, channels: int = 1, sides=(64, 64, 64, 64)):
    rng = np.random.default_rng(0)
    rows = {}
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
        rows[split] = []
        for i, side in enumerate(sides):
            shape = (64, side) if channels == 1 else (64, side, 3)
            pixels = (background + 10 * rng.random(shape)).clip(0, 255).astype(np.uint8)  # 0: all dark
            Image.fromarray(pixels).save(root / split / f"{i}.png")
            rows[split].append({"path": f"{split}/{i}.png", "label": "a"})
    write_dataset(root, ["a"], rows, hints={"channels": channels, "scale": 0.25, "patch_size": [16, 16]})
    return load_dataset(root)


def gather_facts(flags, data):
    """The facts the one settle of ``flags`` on ``data`` read (the look at the images included)."""
    return settle_data(flags, data)[0].facts


def test_the_facts_are_read_from_the_first_training_images(tmp_path):
    dark = gather_facts(TrainConfig(), _pngs(tmp_path / "dark", background=0))
    assert (dark.probed, dark.masked, dark.dark > 0.5, dark.hints) == (4, 0, True, {"scale": 0.25, "patch_size": 16})
    light = gather_facts(TrainConfig(), _pngs(tmp_path / "light", background=200, channels=3))
    assert (light.channels, light.dark, light.files, light.mpps) == (3, 0.0, 4, ())
    assert settle(TrainConfig(), light)[0].config.min_brightness == 0.0
    tissue = gather_facts(TrainConfig(tissue_mask="on"), load_dataset(tmp_path / "light"))  # as slides are read
    assert tissue.masked == 4 and tissue.slides
    # nothing left to the images: they are not looked at
    given = TrainConfig(min_brightness=0.0, rarity_prior=0.0, patch_loss=0.0, augment="none", patch_gain="off")
    assert gather_facts(given, load_dataset(tmp_path / "light")).probed == 0


def test_batch_size_auto_batches_images_of_different_sizes(tmp_path):
    """Views of different sizes are padded to the largest and batched together: a cohort of
    mixed sizes settles on the default batch like one of a single size, bounded by the
    padded view (the largest height times the largest width); two levels and the
    baselines, which stack views of one size only, still take one image per step."""
    same = replace(gather_facts(TrainConfig(), _pngs(tmp_path / "same", background=200)), files=1000)
    assert (same.n_sizes, same.sizes) == (1, ("64x64",))
    settled, reasons = settle(TrainConfig(), same)
    assert settled.config.batch_size == 32
    assert _why(reasons)["batch_size"] == "batch_size 32: every training image is 64x64"
    mixed = replace(gather_facts(TrainConfig(), _pngs(tmp_path / "mixed", background=200, sides=(64, 80, 64, 96))),
                    files=1000)  # a large dataset: its batch is not cut for steps (test_..._small_dataset_steps)
    assert (mixed.n_sizes, mixed.sizes, mixed.frame_h, mixed.frame_w) == (3, ("64x64", "64x80", "64x96"), 64, 96)
    settled, reasons = settle(TrainConfig(), mixed)
    assert settled.config.batch_size == 32
    assert _why(reasons)["batch_size"] == ("batch_size 32: the training images come in 3 sizes (64x64, 64x80, "
                                           "64x96), their views padded to the largest height and width (64x96)")
    # the bound counts the padded frame: one tall and one wide image pad to a square of both
    tall_wide = replace(mixed, sizes=("20000x5000", "5000x20000"), n_sizes=2, pixels=10 ** 8, frame_h=20000,
                        frame_w=20000)
    settled, reasons = settle(TrainConfig(scale=0.05), tall_wide)
    assert settled.config.batch_size == 8  # 8 M // 1000²; the largest image alone (1000x250) would allow 32
    assert _why(reasons)["batch_size"].endswith("(20000x20000), its low-res view 1 M pixels: at most 8 M a step "
                                                "(memory)")
    assert settle(TrainConfig(scale=0.05), replace(tall_wide, frame_h=0, frame_w=0))[0].config.batch_size == 32
    two = TrainConfig(levels=2, region_size=32, coarse_px=4)
    settled, reasons = settle(two, mixed)
    assert settled.config.batch_size == 1 and "two levels stacks views of one size only" in _why(reasons)["batch_size"]
    assert settle(TrainConfig(method="deepmil"), mixed)[0].config.batch_size == 1
    assert settle(TrainConfig(batch_size=4), mixed)[0].config.batch_size == 4  # given wins
    assert settle(TrainConfig(), DataFacts())[0].config.batch_size == 32  # facts of an older run: the default


def test_a_mixed_size_dataset_trains_with_the_defaults(tmp_path):
    from typer.testing import CliRunner

    from ats_cli.cli import app

    _pngs(tmp_path / "mixed", background=200, sides=(64, 80, 64, 96))
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(tmp_path / "mixed"), "--out", str(run), "--epochs", "1",
                                      "--n-patches", "2", "--set", "feature_width=4", "--set", "attention_width=4",
                                      "--workers", "0", "--no-prepare"])
    assert result.exit_code == 0, result.output
    assert json.loads((run / "config.json").read_text())["batch_size"] == 4  # the 4 images, padded, in one step


def test_an_exif_rotated_photo_counts_at_the_size_it_is_read(tmp_path):
    from ats_cli.data.images import decode_pil
    from ats_cli.data.inputs import file_facts

    im = Image.new("RGB", (80, 40))  # width 80, height 40, turned a quarter by its EXIF tag
    exif = im.getexif()
    exif[0x0112] = 6
    im.save(tmp_path / "turned.jpg", exif=exif)
    im.save(tmp_path / "turned.png", exif=exif)  # a PNG's eXIf chunk, before its pixels
    assert file_facts(tmp_path / "turned.jpg") == (None, (80, 40))  # read as 80 high, 40 wide
    assert file_facts(tmp_path / "turned.png") == (None, (80, 40))
    assert decode_pil(tmp_path / "turned.png").shape[:2] == (80, 40)  # as the decoder turns it
    assert file_facts(tmp_path / "missing.png") == (None, None)


def test_the_facts_and_reasons_are_saved_with_the_run(tmp_path):
    settled, reasons = settle(TrainConfig(), SLIDES)
    save_settled(tmp_path, settled, reasons)
    saved = json.loads((tmp_path / "settled.json").read_text())
    assert saved["reasons"][0] == "mpp 0.5 µm/px: the training slides' own (12 of 12 record it)"
    assert saved["mpp"] == 0.5 and load_facts(tmp_path) == SLIDES
    assert settle(settled.config, load_facts(tmp_path))[0] == settled  # a settled config settles to itself
    assert load_facts(tmp_path / "older") is None
    (tmp_path / "settled.json").write_text("{}")
    with pytest.raises(SettledFileError, match="settled.json: not a settled.json"):
        load_facts(tmp_path)



def test_pooling_auto_follows_the_datasets_hint():
    """The max task's label is the highest digit present: its dataset.json names the pooling
    ``highest-counts``, a none logit and a floor, and auto obeys; no hint (negative control)
    or a baseline: the thesis's features, no none logit, no floor; a given value wins; a
    multi-label dataset refuses ``highest`` in one line; a none logit without votes too."""
    largest = replace(MNIST, pooling_hint="highest-counts", none_class_hint="on", count_floor_hint=0.15)
    settled, reasons = settle(TrainConfig(), largest)
    assert (settled.config.pooling, settled.config.none_class, settled.config.count_floor) == \
        ("highest-counts", "on", 0.15)
    assert _why(reasons)["pooling"].startswith("pooling highest-counts: dataset.json hint")
    assert _why(reasons)["count_floor"].startswith("count_floor 0.15: dataset.json hint")
    plain = settle(TrainConfig(), MNIST)[0].config
    assert (plain.pooling, plain.none_class, plain.count_floor) == ("features", "off", 0.0)
    baseline = settle(TrainConfig(method="uniform"), largest)[0].config
    assert (baseline.pooling, baseline.none_class, baseline.count_floor) == ("features", "off", 0.0)
    votes = settle(TrainConfig(pooling="votes"), largest)[0].config  # a vote has a none logit, no floor
    assert (votes.pooling, votes.none_class, votes.count_floor) == ("votes", "on", 0.0)
    given = settle(TrainConfig(none_class="off", count_floor=0.3), largest)[0].config
    assert (given.none_class, given.count_floor) == ("off", 0.3)
    with pytest.raises(ConfigError, match="pooling highest \\(given\\) reads one label per image"):
        settle(TrainConfig(pooling="highest"), replace(MNIST, multilabel=True))
    assert settle(TrainConfig(), replace(MNIST, multilabel=True))[0].config.pooling == "features"
    with pytest.raises(ConfigError, match="none_class on needs pooling votes"):
        settle(TrainConfig(none_class="on"), MNIST)  # auto settles features, which has no vote


def test_the_reading_floor_is_the_hint_else_the_training_floor_and_the_spec_says_it_only_when_it_differs():
    """eval_count_floor auto: the dataset's hint for a counting pooling, else the settled
    count floor (negative control: no hint reads at the training floor, and the spec of such
    a model is the one it always was); a given value wins; a pooling that counts nothing
    reads at its floor, 0."""
    from ats_cli.models import extension_specs

    top = replace(MNIST, pooling_hint="topmost-counts", none_class_hint="on", count_floor_hint=0.15,
                  eval_count_floor_hint=0.07)
    settled, reasons = settle(TrainConfig(), top)
    assert (settled.config.count_floor, settled.config.eval_count_floor) == (0.15, 0.07)
    assert _why(reasons)["eval_count_floor"].startswith("eval_count_floor 0.07: dataset.json hint")
    assert extension_specs(settled.config)["pooling"] == {"name": "topmost-counts", "none_class": True,
                                                          "floor": 0.15, "eval_floor": 0.07}
    unhinted = settle(TrainConfig(), replace(top, eval_count_floor_hint=-1.0))[0].config
    assert unhinted.eval_count_floor == 0.15 and "eval_floor" not in extension_specs(unhinted)["pooling"]
    assert settle(TrainConfig(eval_count_floor=0.02), top)[0].config.eval_count_floor == 0.02
    plain = settle(TrainConfig(), MNIST)[0].config
    assert (plain.count_floor, plain.eval_count_floor) == (0.0, 0.0)
    with pytest.raises(ConfigError, match="eval_count_floor must be in"):
        TrainConfig(eval_count_floor=1.5).validate()


def test_a_hint_ats_cannot_use_is_named_not_dropped_in_silence(tmp_path):
    """A misspelt key or a value of the wrong kind is read as no hint, as before, and each
    gives one line that ats train prints as a warning; the hints make-dataset writes give
    none (negative control), and the facts say which hints were used."""
    written = {"channels": 1, "image_size": [1500, 1500], "scale": 0.12, "patch_size": [50, 50], "n_patches": 10,
               "pooling": "highest-counts", "none_class": "on", "count_floor": 0.15, "position_features": "on"}
    used, ignored = read_hints(written)
    assert ignored == ()
    assert (used["pooling_hint"], used["count_floor_hint"], used["position_hint"]) == ("highest-counts", 0.15, "on")
    used, ignored = read_hints({"poolng": "highest", "pooling": "bogus", "count_floor": "x", "scale": -1,
                                "none_class": True, "channels": "rgb", "n_patches": 10})
    assert (used["pooling_hint"], used["count_floor_hint"], used["none_class_hint"]) == ("", -1.0, "")
    assert used["hints"] == {"n_patches": 10} and "channels" not in used
    assert len(ignored) == 6 and not any(line.startswith("dataset.json hint n_patches") for line in ignored)
    assert ignored[0].startswith("dataset.json hint 'poolng' ignored: not one ats train reads (n_patches, ")
    assert 'dataset.json hint pooling "bogus" ignored: not one of features, votes, counts' in ignored[1]
    assert 'count_floor "x" ignored: not a number in [0, 1]' in ignored[2]
    assert "hint scale -1 ignored: not a positive number" in ignored[3]
    assert 'hint none_class true ignored: not "on" or "off"' in ignored[4]
    assert 'hint channels "rgb" ignored: not a whole number >= 1' in ignored[5]
    # gathered from a dataset.json, and kept in the facts a resumed run reads back
    data = _pngs(tmp_path / "d", background=0)
    data.hints["poolng"] = "highest"
    facts = gather_facts(TrainConfig(), data)
    assert facts.ignored_hints == (ignored[0],)
    (tmp_path / "run").mkdir()
    save_settled(tmp_path / "run", *settle(TrainConfig(), facts))
    assert load_facts(tmp_path / "run") == facts


def test_ats_info_prints_what_train_settles_for_a_file_and_a_folder(tmp_path):
    """`ats info` on a file, and on a folder of class folders (the typical long side of its
    images), prints the sizes ats train settles without flags or hints: one rule."""
    from PIL import Image
    from typer.testing import CliRunner

    from ats_cli.cli import app
    from ats_cli.config import sizes_for

    for i, (h, w) in enumerate([(600, 900), (700, 1000), (800, 1300)]):
        (tmp_path / "photos" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (w, h), (120, 90, 60)).save(tmp_path / "photos" / f"c{i % 2}" / f"{i}.jpg")

    def expected(side):
        return " ".join(f"--{k.replace('_', '-')} {v:g}" for k, (v, _) in sizes_for(side).items())

    folder = CliRunner().invoke(app, ["info", str(tmp_path / "photos")])
    assert folder.exit_code == 0, folder.output
    assert "3 image(s) in 3 size(s), long side 900-1300 px, typically 1000 px" in folder.output
    assert expected(1000) in folder.output and "--patch-size 64" in folder.output
    one = CliRunner().invoke(app, ["info", str(tmp_path / "photos" / "c0" / "2.jpg")])
    assert one.exit_code == 0 and expected(1300) in one.output, one.output


def _train_flags() -> set[str]:
    """The options ``ats train --help`` lists (its parameters' declarations, not its help's text)."""
    import typer

    from ats_cli.cli import app

    params = typer.main.get_command(app).commands["train"].params
    return {opt for p in params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--")}


# another command's flag named in a text about training (ats export's, make-dataset's): not ats train's
OTHER_COMMANDS = re.compile(r"(?:ats export|make-dataset)(?: [\w./-]+)*? --[a-z][a-z0-9-]*")


def named_flags(text: str) -> set[str]:
    return set(re.findall(r"--[a-z][a-z0-9-]*", OTHER_COMMANDS.sub("", text)))


def test_no_settle_or_validate_message_names_a_flag_ats_train_lacks(tmp_path):
    """Since the recipes, most settings are keys (--set KEY=VALUE, a recipe, --config), not
    flags: a message that tells a user to give ``--levels 2`` or ``--init`` names a flag the
    command refuses. Every reason settle gives on the defaults and on each shipped recipe,
    over tiny datasets and the facts of slides, photographs and a black canvas, and every
    refusal of validate() and settle() for a handful of bad configurations, may name only
    the flags ``ats train --help`` lists."""
    from ats_cli.recipes import load_recipe, packaged_recipes

    flags = _train_flags()
    assert {"--n-patches", "--set", "--mpp"} <= flags and "--levels" not in flags
    photos = DataFacts(channels=3, files=8, probed=8, dark=0.1, long_side=640)
    configs = [TrainConfig(), TrainConfig(init="runs/a/best.pt"), TrainConfig(init="runs/a/best.pt", feature_lr=0.0),
               TrainConfig(feature_weights="w.safetensors"), TrainConfig(method="uniform"),
               *(TrainConfig(**load_recipe(r.name).values) for r in packaged_recipes())]
    texts = []
    for cfg in configs:
        for facts in (MNIST, SLIDES, photos, DataFacts(files=2, mpps=(0.25, 0.5)),
                      DataFacts(files=2, mpps=(0.5,), no_mpp="b.tif", unscaled=1, scale_unknown="b.tif: 72 dpi")):
            texts += [str(r) for r in settle(cfg, facts)[1]]
    data = _pngs(tmp_path / "pngs", background=0)
    texts += [str(r) for r in settle_data(TrainConfig(), data)[1]]
    texts += [str(r) for r in settle_data(TrainConfig(**load_recipe("megapixel-mnist-max").values), data)[1]]
    bad = [dict(levels=2), dict(levels=2, region_size=64, pooling="counts"), dict(levels=3), dict(count_floor=2.0),
           dict(none_class="on", pooling="features"), dict(method="cnn", feature_lr=0.5), dict(level=1, mpp=0.5),
           dict(levels=2, regions=0, region_size=64), dict(rarity_cap=0.5), dict(patch_gain="sometimes")]
    for values in bad:
        with pytest.raises(ConfigError) as e:
            TrainConfig(**values).validate()
        texts.append(str(e.value))
    for values, facts in ((dict(patch_um=32.0), MNIST), (dict(mpp=0.5), DataFacts(files=1, no_mpp="a.tif")),
                          (dict(pooling="highest"), replace(MNIST, multilabel=True))):
        with pytest.raises(ConfigError) as e:
            settle(TrainConfig(**values), facts)
        texts.append(str(e.value))
    for values in (dict(region_um=100.0), dict(region_size=120)):  # the two-level sizes, when the model is made
        with pytest.raises(ValueError) as e:
            levels_spec(TrainConfig(levels=2, patch_size=50, **values), None)
        texts.append(str(e.value))
    assert len(texts) > 300
    wrong = {text for text in texts if named_flags(text) - flags}
    assert not wrong, "\n".join(sorted(wrong))
