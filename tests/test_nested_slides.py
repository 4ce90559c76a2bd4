"""A two-level model on slides, end to end: train one epoch, predict, visualise, export
GeoJSON (regions and patches, each with its probability and weight); region views read
from the pyramid; bad configurations stop with one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from ats_cli.cli import app
from ats_cli.data.slides import open_image
from ats_cli.data.synthetic_slides import SyntheticSlidesConfig, generate_synthetic_slides

runner = CliRunner()
SMALL = SyntheticSlidesConfig(n_train=4, n_test=2, size=1024, n_spots=4, max_targets=2, spot_radius=20)
FLAGS = ["--epochs", "1", "--batch-size", "2", "--scale", "0.125", "--patch-size", "32", "--n-patches", "3",
         "--set", "levels=2", "--set", "regions=3", "--set", "region_size=256", "--set", "feature_width=8",
         "--set", "attention_width=4",
         "--workers", "0"]


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    out = tmp_path_factory.mktemp("nested") / "data"
    generate_synthetic_slides(out, SMALL, workers=1)
    return out


@pytest.fixture(scope="module")
def run(slides, tmp_path_factory):
    out = tmp_path_factory.mktemp("nested-run") / "run"
    result = runner.invoke(app, ["train", str(slides), "--out", str(out), *FLAGS])
    assert result.exit_code == 0, result.output
    return out



def test_only_the_coarse_views_are_made_for_a_two_level_run(run):
    """Settling probes the images at the view a two-level model reads, the coarse one (4
    pixels per 256-pixel region of the 1024 slides: 16x16), not at the region views' scale
    (1/8: 128x128), which would cost a 100k slide a 3,125² view per probed slide for nothing;
    the only others are the test split's at twice the coarse pixels (32x32), which
    --eval-coarse-px auto tries after the last epoch."""
    shapes = []
    for entry in sorted((run / "cache" / "views").glob("*.npz")):
        with np.load(entry, allow_pickle=False) as z:
            shapes.append(z["low"].shape)
    assert sorted(set(shapes)) == [(16, 16, 3), (32, 32, 3)]
    assert shapes.count((32, 32, 3)) == SMALL.n_test


def _trained_with(monkeypatch, slides, out, gain, *flags):
    """Train FLAGS (+ ``flags``) with evaluate() reporting, for a coarse view finer than
    training's, the accuracy it last measured at training's plus ``gain`` (the rest as
    measured); returns the coarse scales evaluate() was asked at, in order, and the output."""
    import ats_cli.train as train_mod
    from ats_cli.data.images import ImageReadError

    real, asked, last = train_mod.evaluate, [], {}

    def evaluate(model, loader, device, **kw):
        asked.append(model.eval_coarse_scale or model.coarse_scale)
        score = real(model, loader, device, **kw)
        if not last or not model.eval_coarse_scale:  # the epochs' own
            last.update(score)
            return score
        if gain is None:  # the finer view over the pixel budget
            raise ImageReadError("0001.tif", "too large")
        return {**score, "acc": last["acc"] + gain}

    monkeypatch.setattr(train_mod, "evaluate", evaluate)
    result = runner.invoke(app, ["train", str(slides), "--out", str(out), *FLAGS, *flags])
    assert result.exit_code == 0, result.output
    return asked, result.output


def test_auto_keeps_training_s_coarse_view_where_the_finer_one_cannot_be_read(slides, tmp_path, monkeypatch):
    """A finer view over the pixel budget (or the device's memory) ends the check, not the
    run: best.pt reads training's view, the problem recorded and said."""
    from ats_cli.checkpoint import load_checkpoint

    _, output = _trained_with(monkeypatch, slides, tmp_path / "run", None)
    ckpt = load_checkpoint(tmp_path / "run" / "best.pt")
    assert ckpt["coarse_view"]["kept"] is False and "too large" in ckpt["coarse_view"]["problem"]
    assert ckpt["spec"]["eval_coarse_scale"] == 0.0
    assert "could not read the finer view: 0001.tif: too large" in output and "(unread: as trained)" in output


@pytest.mark.parametrize("better", [True, False])
def test_auto_keeps_a_finer_coarse_view_only_where_the_held_out_split_scores_better(slides, tmp_path, monkeypatch,
                                                                                   better):
    """--eval-coarse-px auto: after the last epoch best.pt is evaluated on the test split at
    8 px a region (twice the 4 trained) and keeps that view only where its accuracy is
    higher (then ats predict reads 32x32); not where it is the same (the negative control:
    16x16 at prediction). What was tried is recorded in best.pt either way."""
    from ats_cli.checkpoint import load_checkpoint
    from ats_cli.predict import load_predictor

    run = tmp_path / "run"
    asked, output = _trained_with(monkeypatch, slides, run, 0.5 if better else 0.0)
    assert asked == [pytest.approx(4 / 256), pytest.approx(8 / 256)]  # the epoch, then the finer view once
    ckpt = load_checkpoint(run / "best.pt")
    assert ckpt["coarse_view"]["px"] == 8 and ckpt["coarse_view"]["kept"] is better
    assert ckpt["spec"]["eval_coarse_scale"] == (pytest.approx(8 / 256) if better else 0.0)
    assert f"best.pt reads a coarse view of {8 if better else 4} px a region at prediction" in output
    model = load_predictor(run / "best.pt", "cpu").model
    assert model.eval().scale == pytest.approx((8 if better else 4) / 256) and model.train().scale == 4 / 256
    # a resumed finished run does not try again
    asked.clear()
    result = runner.invoke(app, ["train", "--resume", str(run)])
    assert result.exit_code == 0 and asked == [], result.output


def test_a_given_eval_coarse_px_is_what_evaluation_reads_in_training(slides, tmp_path, monkeypatch):
    """--eval-coarse-px 8 given: every held-out evaluation in training reads 8 px a region
    (the test split's views 32x32), the model records it, and nothing is tried at the end;
    0 (as trained): 4 px, nothing tried."""
    from ats_cli.checkpoint import load_checkpoint

    for given, scale in (("8", 8 / 256), ("0", 4 / 256)):
        run = tmp_path / f"run{given}"
        asked, _ = _trained_with(monkeypatch, slides, run, None, "--set", f"eval_coarse_px={given}")
        assert asked == [pytest.approx(scale)]
        ckpt = load_checkpoint(run / "best.pt")
        assert "coarse_view" not in ckpt
        assert ckpt["spec"]["eval_coarse_scale"] == (pytest.approx(scale) if given != "0" else 0.0)

def test_region_views_come_from_the_pyramid_level_that_matches(slides):
    """A 256-pixel region viewed at 64x64 is read from the 4x-smaller level (256x256 for the
    1024 slide), and is the region of level 0 resized, up to the pyramid's own resampling."""
    reader = open_image(slides / "train" / "0001.tif")
    off = torch.tensor([[256, 512]])
    reads = []
    read_region = reader.read_region
    reader.read_region = lambda *args, **kw: reads.append(args) or read_region(*args, **kw)
    view = reader.read_view(off, (256, 256), (64, 64))
    assert reads == [(64, 128, 64, 64, 1)]  # level 1 (4x): the region's 64x64 pixels there, nothing else
    assert view.shape == (1, 3, 64, 64) and view.dtype == torch.float32
    full = torch.from_numpy(reader.read_region(256, 512, 256, 256, 0).copy()).permute(2, 0, 1)[None].float() / 255
    direct = torch.nn.functional.interpolate(full, size=(64, 64), mode="bilinear", antialias=True)
    assert float((view - direct).abs().mean()) < 0.03


def test_a_two_level_model_trains_predicts_visualises_and_exports(run, slides, tmp_path):
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1] and np.isfinite(metrics[0]["train_loss"])
    spec = torch.load(run / "best.pt", weights_only=True)["spec"]
    assert (spec["levels"], spec["regions"], spec["eval_regions"], spec["region_size"]) == (2, 3, 6, 256)
    assert spec["coarse_scale"] == pytest.approx(4 / 256) and spec["scale"] == 0.125

    csv_out = tmp_path / "preds.csv"
    result = runner.invoke(app, ["predict", str(slides / "test.csv"), "--model", str(run), "--out", str(csv_out)])
    assert result.exit_code == 0, result.output
    header, *rows = [line.split(",") for line in csv_out.read_text().splitlines()]
    assert len(rows) == SMALL.n_test
    for row in rows:
        assert row[1] in ("normal", "tumor") and float(row[2]) + float(row[3]) == pytest.approx(1, abs=1e-5)

    png = tmp_path / "att.png"
    result = runner.invoke(app, ["visualize", str(slides / "test" / "0001.tif"), "--model", str(run), "--out",
                                 str(png)])
    assert result.exit_code == 0, result.output
    with Image.open(png) as im:
        assert im.width > 400 and im.height > 300

    out = tmp_path / "att.geojson"
    result = runner.invoke(app, ["visualize", str(slides / "test" / "0001.tif"), "--model", str(run), "--out",
                                 str(out)])
    assert result.exit_code == 0, result.output
    collection = json.loads(out.read_text())
    props = collection["properties"]
    assert props["regions"]["count"] == 6 and props["regions"]["grid"] == [4, 4]  # eval_regions: twice 3
    regions = [f for f in collection["features"] if f["properties"].get("classification", {}).get("name") == "region"]
    patches = [f for f in collection["features"] if f["properties"]["name"].startswith("patch ")]
    assert len(regions) == 6 and len(patches) == 6 * props["regions"]["patches_per_region"]
    region_box = {}
    for f in regions:
        m = f["properties"]["measurements"]
        assert 0 < m["attention"] <= 1 and m["weight"] > 0
        region_box[m["draw_order"]] = f["properties"]["region_box"]
    for f in patches:
        m = f["properties"]["measurements"]
        assert 0 < m["attention"] <= 1 and m["weight"] >= 0
        x0, y0, x1, y1 = f["properties"]["patch_box"]
        rx0, ry0, rx1, ry1 = region_box[m["region"]]
        assert rx0 <= (x0 + x1) / 2 < rx1 and ry0 <= (y0 + y1) / 2 < ry1  # each patch in its region
    cells = [f for f in collection["features"] if f["properties"].get("classification", {}).get("name") == "attention"]
    assert cells and all(f["geometry"]["coordinates"][0][2][0] - f["geometry"]["coordinates"][0][0][0] == 256
                         for f in cells)  # the coarse cells are the regions


def test_export_sets_the_regions_prediction_draws(run, slides, tmp_path):
    """``ats export --eval-regions`` on a two-level model, one line for a one-level one."""
    from ats_cli.predict import load_predictor

    out = tmp_path / "k4.pt"
    result = runner.invoke(app, ["export", str(run / "best.pt"), str(out), "--eval-regions", "4"])
    assert result.exit_code == 0, result.output
    model = load_predictor(out, "cpu").model
    assert (model.regions, model.eval_regions) == (3, 4) and model.regions_for((4, 4)) == 4
    assert model.train().regions_for((4, 4)) == 3  # training draws --regions
    one = tmp_path / "one"
    result = runner.invoke(app, ["train", str(slides), "--out", str(one), "--epochs", "1", "--batch-size", "2",
                                 "--scale", "0.125", "--patch-size", "32", "--n-patches", "2",
                                 "--set", "feature_width=8", "--set", "attention_width=4", "--workers", "0"])
    assert result.exit_code == 0, result.output
    for flag in ("--eval-regions", "--eval-coarse-px"):
        result = runner.invoke(app, ["export", str(one / "best.pt"), str(tmp_path / "x.pt"), flag, "4"])
        assert result.exit_code == 1 and "is for a two-level model" in result.output
        assert not (tmp_path / "x.pt").exists()


def test_export_sets_a_finer_coarse_view_for_prediction(run, slides, tmp_path):
    """``ats export --eval-coarse-px 8`` on a model trained at 4 pixels per 256-pixel region:
    prediction reads the 1024 slides' coarse view at 32x32, training's at 16x16 (control: the
    model exported without it reads 16x16), and predict runs on it end to end."""
    from ats_cli.predict import load_predictor

    slide = str(slides / "test" / "0001.tif")
    for px, side in ((8, 32), (None, 16)):
        out = tmp_path / f"c{px}.pt"
        result = runner.invoke(app, ["export", str(run / "best.pt"), str(out),
                                     *(["--eval-coarse-px", str(px)] if px else [])])
        assert result.exit_code == 0, result.output
        pred = load_predictor(out, "cpu")
        model = pred.model.eval()
        opened = pred.opener()(slide, channels=3, scale=model.scale, patch_size=model.patch_size)
        assert tuple(opened.low.shape[-2:]) == (side, side)
        assert model.train().scale == pytest.approx(4 / 256)  # training's view is as trained
    csv_out = tmp_path / "preds.csv"
    result = runner.invoke(app, ["predict", str(slides / "test.csv"), "--model", str(tmp_path / "c8.pt"),
                                 "--out", str(csv_out)])
    assert result.exit_code == 0, result.output
    assert "two levels: 6 regions of 256 px, coarse view 8 px a region" in result.output
    result = runner.invoke(app, ["predict", str(slides / "test.csv"), "--model", str(tmp_path / "cNone.pt")])
    assert result.exit_code == 0 and "coarse view 4 px a region" in result.output, result.output
    assert len(csv_out.read_text().splitlines()) == 1 + SMALL.n_test


@pytest.mark.parametrize("flags, message", [
    (["--set", "region_size=2048"], "larger than"),
    (["--set", "regions=17"], "holds only 16 regions"),
    (["--set", "region_size=250"], "not a multiple of --patch-size"),
    (["--set", "region_size=0"], "region_size (pixels) or region_um"),
])
def test_bad_two_level_configurations_stop_with_one_line(slides, tmp_path, flags, message):
    result = runner.invoke(app, ["train", str(slides), "--out", str(tmp_path / "bad"), *FLAGS, *flags])
    assert result.exit_code != 0
    text = " ".join(result.output.split())  # rich wraps long lines
    assert message in text and "Traceback" not in result.output, result.output


def test_region_size_in_microns_is_converted_at_the_model_microns_per_pixel():
    from ats_cli.config import TrainConfig, levels_spec

    cfg = TrainConfig(levels=2, region_um=130.0, patch_size=32, scale=0.125).validate()
    spec = levels_spec(cfg, 0.5)
    assert spec["region_size"] == 256  # 260 px, to the nearest multiple of the 32-pixel patch
    assert spec["coarse_scale"] == pytest.approx(4 / 256)
    with pytest.raises(ValueError, match="microns per pixel are unknown"):
        levels_spec(cfg, None)
    assert levels_spec(TrainConfig(patch_size=32, scale=0.125).validate(), 0.5) == {}  # one level: nothing added


def test_the_patches_of_a_drawn_region_lie_on_its_tissue(run, slides):
    """The coarse tissue mask has 8 pixels per region side; in a drawn region the patches
    are kept on the tissue of the region's own view, not on the glass beside it."""
    from ats_cli.data.slides import tissue_mask
    from ats_cli.predict import load_predictor
    from ats_cli.visualize import sample_attention

    predictor = load_predictor(run, "cpu")
    on = total = 0
    for name in ("0000.tif", "0001.tif"):
        opened = predictor.opener()(slides / "test" / name, channels=3, scale=predictor.model.scale,
                                    patch_size=predictor.model.patch_size)
        fine = tissue_mask(open_image(slides / "test" / name).low_res_view(1 / 8))  # 128x128, 8 px a cell
        for seed in range(3):
            out = sample_attention(predictor, opened, n_patches=None, seed=seed)
            centres = ((out.offsets[0] + 16) // 8).clamp(0, 127)
            on += int(fine[centres[:, 0], centres[:, 1]].sum())
            total += len(centres)
    assert on / total > 0.9, (on, total)


def test_a_two_level_model_end_to_end_on_virtual_slides(tmp_path):
    """The same path on virtual slides (a .vslide.json spec rendered on demand): train one
    epoch, predict, visualise, export GeoJSON with its regions."""
    data = tmp_path / "virtual"
    made = runner.invoke(app, ["make-dataset", "synthetic-slides", str(data), "--size", "1024", "--virtual",
                               "--n-train", "4", "--n-test", "2", "--spot-radius", "20"])
    assert made.exit_code == 0, made.output
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(data), "--out", str(run), *FLAGS])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["predict", str(data / "test.csv"), "--model", str(run), "--out",
                                 str(tmp_path / "p.csv")])
    assert result.exit_code == 0 and len((tmp_path / "p.csv").read_text().splitlines()) == 3, result.output
    slide = data / "test" / "0001.vslide.json"
    for out in (tmp_path / "v.png", tmp_path / "v.geojson"):
        result = runner.invoke(app, ["visualize", str(slide), "--model", str(run), "--out", str(out)])
        assert result.exit_code == 0 and out.stat().st_size > 0, result.output
    regions = json.loads((tmp_path / "v.geojson").read_text())["properties"]["regions"]
    assert regions["count"] == 6 and regions["size_level"] == 256


def _gain_moved(path) -> bool:
    """Whether a checkpoint's patch gain differs from a new one's (weight 0, gain 1)."""
    from ats_cli.checkpoint import load_checkpoint
    from ats_cli.extensions.gain_learned import LearnedGain

    weights, fresh = load_checkpoint(path)["model"], LearnedGain(8).state_dict()
    return any(not torch.equal(weights[f"gain.{k}"], v) for k, v in fresh.items())


def test_two_levels_train_the_patch_gain_from_half_way(slides, tmp_path):
    """--patch-gain auto with two levels on slides is late: the gain is in the model from the
    start, at 1, and trains only from half of the epochs on (ats_cli.config._patch_gain says
    why). Control: --patch-gain on trains it in the first epoch."""
    late = tmp_path / "late"
    flags = list(FLAGS)
    flags[flags.index("--epochs") + 1] = "2"
    result = runner.invoke(app, ["train", str(slides), "--out", str(late), *flags])
    assert result.exit_code == 0, result.output
    assert "patch_gain late" in result.output
    assert not _gain_moved(late / "epochs" / "epoch_001.pt") and _gain_moved(late / "epochs" / "epoch_002.pt")
    on = tmp_path / "on"
    result = runner.invoke(app, ["train", str(slides), "--out", str(on), *FLAGS, "--set", "patch_gain=on"])
    assert result.exit_code == 0, result.output
    assert _gain_moved(on / "epochs" / "epoch_001.pt")


def test_a_late_gain_run_resumes_exactly_across_half_way(slides, tmp_path):
    """The late gain's learning rate is a function of the position (train._set_lr): a run
    interrupted in epoch 1, before the gain trains, and resumed ends with the weights of the
    uninterrupted run, the gain's among them (and the gain did train)."""
    from ats_cli.checkpoint import load_checkpoint
    from ats_cli.recipes import resolve_config
    from ats_cli.train import TrainingInterrupted, train

    def cfg(out):
        return resolve_config(None, data=str(slides), out=str(out), epochs=2, batch_size=2, scale=0.125,
                              patch_size=32, n_patches=3, levels=2, regions=3, region_size=256, feature_width=8,
                              attention_width=4, workers=0, patch_gain="late")

    def interrupt(phase, step, total, info):
        if info["epoch"] == 1 and step == 1:
            raise KeyboardInterrupt

    quiet = {"log": lambda s: None}
    train(cfg(tmp_path / "whole"), **quiet)
    with pytest.raises(TrainingInterrupted):
        train(cfg(tmp_path / "cut"), progress=interrupt, **quiet)
    train(cfg(tmp_path / "cut"), resume=True, **quiet)
    whole, cut = (load_checkpoint(tmp_path / r / "last.pt")["model"] for r in ("whole", "cut"))
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    assert _gain_moved(tmp_path / "whole" / "last.pt")
