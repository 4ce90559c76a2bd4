"""Magnification: a model records the microns per pixel it was trained at, and a slide
scanned at another resolution is read at that scale (ats_cli.data.inputs), so a
40x and a 20x scan of the same tissue give the same answer within noise, and the GeoJSON
still lands on each file's own level-0 pixels."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

from ats_cli.checkpoint import save_checkpoint
from ats_cli.cli import app
from ats_cli.config import ConfigError, TrainConfig, settle_data
from ats_cli.data.dataset import load_dataset, write_dataset
from ats_cli.data.slides import choose_level, open_image
from ats_cli.data.synthetic_slides import SyntheticSlidesConfig, render_slide, write_pyramid
from ats_cli.models import create_model, model_spec
from ats_cli.predict import InputItem, load_predictor

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
CLASSES = ["normal", "tumor"]
TISSUE = SyntheticSlidesConfig(size=1024, n_spots=4, max_targets=2, spot_radius=20)


def halve(image: np.ndarray) -> np.ndarray:
    """2x2 area average: what a scanner at half the magnification records of the same tissue."""
    h, w = image.shape[0] // 2 * 2, image.shape[1] // 2 * 2
    return image[:h, :w].reshape(h // 2, 2, w // 2, 2, -1).mean((1, 3)).round().astype(np.uint8)


@pytest.fixture(scope="module")
def scans(tmp_path_factory) -> dict[str, Path]:
    """One synthetic tissue (a tumor slide) scanned at 0.25 µm/px (2048 px, "40x") and at
    0.5 µm/px (1024 px, "20x"), and a copy of the 40x scan that records no mpp."""
    import tifffile

    out = tmp_path_factory.mktemp("scans")
    fine, layout = render_slide(SyntheticSlidesConfig(**{**TISSUE.params(), "size": 2048, "spot_radius": 40}),
                                "test", 1)
    assert layout.label == 1
    write_pyramid(out / "x40.tif", fine, mpp=0.25)
    write_pyramid(out / "x20.tif", halve(fine), mpp=0.5)
    with tifffile.TiffWriter(out / "nompp.tif") as tw:
        tw.write(fine, tile=(256, 256), photometric="rgb", compression="zlib", metadata=None)
    return {"x40": out / "x40.tif", "x20": out / "x20.tif", "nompp": out / "nompp.tif"}


def make_model(path: Path, *, mpp: float | None = 0.5, n_patches: int = 8) -> Path:
    """A small untrained model (fixed seed) whose answer depends on what its patches show."""
    torch.manual_seed(0)
    # eval_n_patches=0: prediction draws the n_patches these tests compare between two scans
    spec = model_spec(TrainConfig(patch_size=32, scale=1 / 16, n_patches=n_patches, eval_n_patches=0, feature_width=8,
                                  min_brightness=0.0, rarity_prior=0.0), n_classes=2, channels=3, mpp=mpp)
    model = create_model(spec)
    nn.init.normal_(model.attention_net.score.weight, std=0.5)
    save_checkpoint(path, spec=spec, classes=CLASSES, model=model)
    return path


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "model.pt")


def test_the_level_read_is_the_coarsest_at_or_below_the_models_microns():
    levels = [0.25, 1.0, 4.0]  # a 40x scan, pyramid down by 4
    assert choose_level(levels, 0.5) == (0, 2.0)  # level 0, averaged 2x2
    assert choose_level(levels, 1.0) == (1, 1.0)  # a level of that scale: read as it is
    assert choose_level(levels, 1.03) == (1, 1.0)  # within 5%: the same magnification
    assert choose_level(levels, 2.0) == (1, 2.0)  # never from a coarser level (detail is not invented)
    level, factor = choose_level([1.0, 4.0], 0.5)  # a scan coarser than the model: the finest, upsampled
    assert level == 0 and factor == pytest.approx(0.5)
    with pytest.raises(ValueError):
        choose_level(levels, 0)


def test_a_40x_scan_read_at_20x_shows_what_the_20x_scan_shows_within_bounded_memory(scans):
    # a pixel budget far below the 40x level 0 (2048 x 2048 = 4.2 M): patches and the view still read
    x40 = open_image(scans["x40"], max_pixels=1_000_000)
    x20 = open_image(scans["x20"])
    x40.match_mpp(0.5)
    assert (x40.level, x40.factor, x40.size) == (0, 2.0, (1024, 1024)) and x40.patch_downsample == 2.0
    assert x40.pixel_mpp == pytest.approx(0.5)
    offsets = torch.tensor([[100, 200], [500, 480], [900, 30]])
    a, b = x40.read_patches(offsets, (64, 64)).float(), x20.read_patches(offsets, (64, 64)).float()
    assert a.shape == b.shape == (3, 3, 64, 64)
    assert (a - b).abs().mean() < 3  # the same tissue (JPEG noise apart)
    x40.set_level(0)  # read as it is, the same offsets land elsewhere and at twice the zoom
    assert (x40.read_patches(offsets, (64, 64)).float() - b).abs().mean() > 10
    x40.match_mpp(0.5)
    low40, low20 = x40.low_res_view(1 / 16), x20.low_res_view(1 / 16)
    assert low40.shape == low20.shape == (3, 64, 64) and (low40 - low20).abs().mean() < 0.02
    clone = pickle.loads(pickle.dumps(x40))  # training hands readers to the main process this way
    assert (clone.level, clone.factor, clone.size) == (0, 2.0, (1024, 1024))
    assert torch.equal(clone.read_patches(offsets, (64, 64)), x40.read_patches(offsets, (64, 64)))


def test_predict_on_a_40x_and_a_20x_scan_gives_the_same_answer(scans, model_file):
    predictor = load_predictor(model_file, "cpu")
    assert predictor.input_options["mpp"] == 0.5 and predictor.input_options["resample"] is True
    for seed in (0, 1, 2):
        seen = {}

        def keep(index, row, opened, out, b, seen=seen):
            patches = opened.source.read_patches(out.offsets[b], predictor.model.patch_size)
            seen[row.path.stem] = (row.probs, out.attention[b], out.indices[b], patches.float())

        predictor.predict([InputItem(scans["x40"]), InputItem(scans["x20"])], seed=seed, on_output=keep)
        (p40, att40, at40, patches40), (p20, att20, at20, patches20) = seen["x40"], seen["x20"]
        assert abs(p40[1] - p20[1]) < 0.05, (seed, p40, p20)
        # what the model saw: the same attention over the same view, the same places, the same tissue in each patch
        assert att40.shape == att20.shape and (att40 - att20).abs().sum() < 0.1
        assert (at40 == at20).float().mean() >= 0.75
        same = at40 == at20
        assert (patches40[same] - patches20[same]).abs().mean() < 3
    # read as it is (--level 0), the 40x scan is another image to the model: its patches see 4x less tissue
    as_is = predictor.opener(level=0)
    opened = as_is(scans["x40"], channels=3, scale=predictor.model.scale, patch_size=predictor.model.patch_size)
    assert opened.source.size == (2048, 2048) and opened.low.shape[-2:] == (128, 128)


def test_the_cli_says_how_each_slide_was_read_and_geojson_lands_on_each_files_level_0(scans, model_file, tmp_path):
    result = runner.invoke(app, ["predict", str(scans["x40"]), str(scans["x20"]), "--model", str(model_file),
                                 "--out", str(tmp_path / "p.csv")])
    assert result.exit_code == 0, result.output
    assert "x40.tif: level 0 (0.25 µm/px) downsampled 2x to 0.5 µm/px" in result.stderr
    assert "x20.tif: level 0 (0.5 µm/px) read as it is for 0.5 µm/px" in result.stderr
    rows = (tmp_path / "p.csv").read_text().splitlines()[1:]
    assert len({r.split(",")[1] for r in rows}) == 1  # one class for the two scans

    boxes = {}
    for name in ("x40", "x20"):
        out = tmp_path / f"{name}.geojson"
        result = runner.invoke(app, ["visualize", str(scans[name]), "--model", str(model_file), "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert f"{name}.tif: level 0" in result.stderr  # the one-line reading note
        data = json.loads(out.read_text())
        assert data["properties"]["downsample"] == (2.0 if name == "x40" else 1.0)
        boxes[name] = np.array([f["geometry"]["coordinates"][0][0] for f in data["features"]
                                if f["properties"].get("name", "").startswith("patch")], dtype=float)
    # the same sampled places (same seed), in each file's own level-0 pixels: twice the numbers on the 40x scan
    assert boxes["x40"].shape == boxes["x20"].shape and len(boxes["x20"]) > 0
    assert np.abs(boxes["x40"] - 2 * boxes["x20"]).max() <= 2


def test_a_slide_without_microns_is_read_as_it_is_and_said_so(scans, model_file, tmp_path):
    result = runner.invoke(app, ["predict", str(scans["nompp"]), "--model", str(model_file),
                                 "--out", str(tmp_path / "p.csv")])
    assert result.exit_code == 0, result.output
    assert "nompp.tif: level 0 read as it is: the file records no microns per pixel" in result.stderr
    result = runner.invoke(app, ["info", str(scans["x40"]), str(scans["nompp"])])
    assert result.exit_code == 0 and "mpp: 0.25 x 0.25" in result.output and "not recorded" in result.output


def test_mpp_at_predict_overrides_the_models(scans, tmp_path):
    model = make_model(tmp_path / "nompp.pt", mpp=None)  # a model that records none reads as it is...
    predictor = load_predictor(model, "cpu")
    kw = {"channels": 3, "scale": 1 / 16, "patch_size": (32, 32)}
    assert predictor.opener()(scans["x40"], **kw).source.size == (2048, 2048)
    opened = predictor.opener(mpp=0.5)(scans["x40"], **kw)  # ... unless --mpp says at what scale
    assert opened.source.size == (1024, 1024) and "downsampled 2x" in opened.reading


def _settle(tmp_path, paths, **flags):
    """ats train's settling of ``flags`` on a dataset of these training files (nothing left
    to the images: only their microns are read)."""
    root = tmp_path / f"data{len(list(tmp_path.iterdir()))}"
    root.mkdir()
    shutil.copy(paths[0], root / "test.tif")
    rows = {"train": [{"path": str(p), "label": "normal"} for p in paths], "test": [{"path": "test.tif",
                                                                                     "label": "normal"}]}
    write_dataset(root, CLASSES, rows, hints={"channels": 3})
    cfg = TrainConfig(min_brightness=0.0, rarity_prior=0.0, augment="none", patch_gain="off", **flags)
    settled, reasons = settle_data(cfg, load_dataset(root))
    return settled, {r.key: str(r) for r in reasons}


def test_training_records_the_slides_microns_and_converts_microns_to_pixels(scans, tmp_path):
    settled, why = _settle(tmp_path, [scans["x20"]], patch_um=32.0, low_res_um=8.0)
    assert (settled.mpp, settled.config.patch_size, settled.config.scale) == (0.5, 64, 1 / 16)
    assert why["mpp"] == "mpp 0.5 µm/px: the training slides' own (1 of 1 record it)"
    assert why["patch_size"] == "patch_size 64: --patch-um 32 at 0.5 µm/px; 32 µm"
    settled, _ = _settle(tmp_path, [scans["x20"], scans["x40"]], mpp=1.0, patch_um=32.0)  # --mpp: every slide at it
    assert (settled.mpp, settled.config.patch_size) == (1.0, 32)
    # slides at two scales, no --mpp: the model records none, and says why
    settled, why = _settle(tmp_path, [scans["x20"], scans["x40"]])
    assert settled.mpp is None and "range from 0.25 µm/px to 0.5 µm/px" in why["mpp"] and "--mpp" in why["mpp"]
    with pytest.raises(ConfigError, match="--patch-um 32 needs the microns per pixel"):
        _settle(tmp_path, [scans["x20"], scans["x40"]], patch_um=32.0)
    with pytest.raises(ConfigError, match=r"nompp.tif: records no microns per pixel, so it cannot be read at --mpp"):
        _settle(tmp_path, [scans["x20"], scans["nompp"]], mpp=0.5)


def test_ats_train_with_microns_records_them_in_the_model(tmp_path):
    from ats_cli.data.synthetic_slides import generate_synthetic_slides

    data = tmp_path / "data"
    generate_synthetic_slides(data, SyntheticSlidesConfig(n_train=2, n_test=2, size=512, n_spots=2, max_targets=1,
                                                          spot_radius=16, mpp=0.5), workers=1)
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(data), "--out", str(run), "--workers", "0", "--epochs", "1",
                                 "--batch-size", "2", "--n-patches", "2", "--patch-um", "16", "--low-res-um", "16",
                                 "--set", "feature_width=8"])
    assert result.exit_code == 0, result.output
    assert "mpp 0.5 µm/px: the training slides' own" in result.output
    assert "patch_size 32: --patch-um 16 at 0.5 µm/px" in result.output
    ckpt = torch.load(run / "best.pt", weights_only=True)
    spec, config = ckpt["spec"], json.loads((run / "config.json").read_text())
    assert spec["input"]["mpp"] == 0.5 and spec["input"]["resample"] is True
    assert spec["patch_size"] == [32, 32] and spec["scale"] == pytest.approx(1 / 32)
    assert (config["patch_um"], config["patch_size"]) == (16.0, 32)


def test_the_released_slides_model_gives_a_40x_copy_of_a_sample_the_same_class(tmp_path):
    """The shipped samples are 0.5 µm/px; written again at 0.25 µm/px (each pixel 2x2),
    the released model (which records 0.5 µm/px) reads them back at its scale."""
    predictor = load_predictor(ROOT / "models" / "synthetic-slides-ats.pt", "cpu")
    assert predictor.input_options["mpp"] == 0.5
    unmatched = 0
    for i in range(4):
        sample = ROOT / "sample_data" / "synthetic-slides" / f"{i:04d}.tif"
        with open_image(sample) as slide:
            image = slide.read_region(0, 0, *slide.levels[0], 0)
        x40 = tmp_path / sample.name
        write_pyramid(x40, np.repeat(np.repeat(image, 2, 0), 2, 1), mpp=0.25)
        a, b = (predictor.predict([InputItem(p)])[0] for p in (sample, x40))
        assert a.prediction == b.prediction and abs(a.probs[1] - b.probs[1]) < 0.1, (i, a.probs, b.probs)
        as_is = predictor.predict([InputItem(x40)], reader=predictor.opener(level=0))[0]
        unmatched += as_is.prediction != a.prediction
    assert unmatched > 0  # read as it is, the 40x copy is not the same slide to the model
