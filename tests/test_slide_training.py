"""Synthetic whole slides, and the whole slide path through train / predict / visualize."""

from __future__ import annotations

import json
import pickle

import numpy as np
import openslide
import pytest
import tifffile
import torch
from PIL import Image
from typer.testing import CliRunner

from ats_cli.cli import app
from ats_cli.data import load_dataset
from ats_cli.data.slides import ArrayReader, open_image, tissue_mask
from ats_cli.data.synthetic_slides import SyntheticSlidesConfig, generate_synthetic_slides, render_slide

runner = CliRunner()
SMALL = SyntheticSlidesConfig(n_train=6, n_test=4, size=1024, n_spots=4, max_targets=2, spot_radius=20)


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    out = tmp_path_factory.mktemp("slides") / "data"
    generate_synthetic_slides(out, SMALL, workers=1)
    return out


def test_synthetic_slides_are_pyramidal_tiffs_both_backends_read(slides):
    data = load_dataset(slides)
    assert data.classes == ["normal", "tumor"]
    assert [r.label for r in data["train"]] == [0, 1, 0, 1, 0, 1]  # balanced, alternating
    path = data["train"][1].path
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        assert page.is_tiled and page.compression == tifffile.COMPRESSION.JPEG
        assert [p.shape[:2] for p in tif.pages] == [(1024, 1024), (256, 256)]
    assert openslide.OpenSlide.detect_format(str(path)) == "generic-tiff"
    ours, theirs = open_image(path), open_image(path, reader="openslide")
    assert ours.levels == theirs.levels == [(1024, 1024), (256, 256)]
    assert ours.mpp == pytest.approx((0.5, 0.5))
    region = ours.read_region(100, 200, 64, 64, 0)
    assert np.abs(region.astype(int) - theirs.read_region(100, 200, 64, 64, 0).astype(int)).max() <= 2
    # the file holds the rendered slide (JPEG at quality 90: close, not exact)
    image, _ = render_slide(SMALL, "train", 1)
    assert np.abs(region.astype(float) - image[100:164, 200:264]).mean() < 4


def test_targets_only_in_tumor_slides_and_alike_at_low_resolution():
    for index in range(6):
        image, layout = render_slide(SMALL, "train", index)
        assert (len(layout.targets) > 0) == (layout.label == 1)
        assert 1 <= len(layout.targets) + len(layout.decoys) <= SMALL.n_spots
    image, layout = render_slide(SyntheticSlidesConfig(size=1536, n_spots=8, max_targets=4), "train", 1)
    r = 28

    def low_res_mean(c):  # what the attention sees: the spot's mean colour
        return image[c[0] - r:c[0] + r, c[1] - r:c[1] + r].reshape(-1, 3).mean(0)

    targets = np.array([low_res_mean(c) for c in layout.targets])
    decoys = np.array([low_res_mean(c) for c in layout.decoys])
    assert len(targets) and len(decoys)
    # a spot's mean colour is ~60 darker than the stroma, target and decoy within a few units
    assert np.abs(targets.mean(0) - decoys.mean(0)).max() < 8
    stroma = np.median(image.reshape(-1, 3), axis=0)
    assert (stroma - decoys.mean(0)).min() > 30


def test_generation_is_deterministic_and_resumes(tmp_path, slides):
    out = tmp_path / "again"
    generate_synthetic_slides(out, SMALL, workers=2)
    assert (out / "train.csv").read_text() == (slides / "train.csv").read_text()
    first = open_image(out / "test" / "0001.tif").read_region(0, 0, 256, 256, 0)
    assert np.array_equal(first, open_image(slides / "test" / "0001.tif").read_region(0, 0, 256, 256, 0))


def test_an_interrupted_generation_resumes_and_refuses_other_parameters(tmp_path):
    out = tmp_path / "cut"

    def stop_after_three(split, done, total):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_synthetic_slides(out, SMALL, workers=1, progress=stop_after_three)
    assert not (out / "dataset.json").exists() and len(list((out / "train").glob("*.tif"))) == 3
    with pytest.raises(ValueError, match="different parameters"):
        generate_synthetic_slides(out, SyntheticSlidesConfig(**{**SMALL.params(), "seed": 1}), workers=1)
    report = generate_synthetic_slides(out, SMALL, workers=1)
    assert (report.written, report.skipped) == (7, 3)
    assert len(load_dataset(out)["train"]) == SMALL.n_train


def test_an_evicted_reader_still_reads_for_the_batches_holding_it(slides, monkeypatch):
    """A prefetched batch may hold a reader the cache has since dropped: it must still read."""
    from ats_cli.data import slides as slides_module

    monkeypatch.setattr(slides_module, "_REOPEN_LIMIT", 1)
    first = pickle.loads(pickle.dumps(open_image(slides / "train" / "0004.tif")))
    pickle.loads(pickle.dumps(open_image(slides / "train" / "0005.tif")))  # evicts the first
    assert first.read_patches(torch.tensor([[10, 10]]), (16, 16)).shape == (1, 3, 16, 16)


def test_a_lazy_reader_pickles_as_a_reopen(slides):
    reader = open_image(slides / "train" / "0001.tif")
    reader.set_level(1)
    clone = pickle.loads(pickle.dumps(reader))
    assert clone is not reader and clone.level == 1 and clone.size == (256, 256)
    offsets = torch.tensor([[0, 0], [100, 150]])
    assert torch.equal(clone.read_patches(offsets, (32, 32)), reader.read_patches(offsets, (32, 32)))
    assert pickle.loads(pickle.dumps(reader)) is clone  # one open reader per process, reused
    with pytest.raises(TypeError, match="in memory"):
        pickle.dumps(ArrayReader(np.zeros((8, 8, 3), np.uint8)))


def test_tissue_mask_finds_the_synthetic_tissue(slides):
    reader = open_image(slides / "train" / "0000.tif")
    low = reader.low_res_view(1 / 32)
    mask = tissue_mask(low)
    pink = low[0] - low[1] > 0.15  # stroma is pink, glass grey
    agree = (mask == pink).float().mean()
    assert 0.2 < float(pink.float().mean()) < 0.8 and agree > 0.9


TRAIN_FLAGS = ["--epochs", "2", "--batch-size", "2", "--scale", "0.03125", "--patch-size", "64",
               "--n-patches", "4", "--feature-net", "small-cnn", "--set", "feature_width=8",
               "--set", "attention_width=4", "--set", "feature_scale=10", "--lr", "3e-3"]


def test_train_predict_visualize_on_slides_end_to_end(slides, tmp_path):
    """What a user checks after training on slides: every epoch is in the metrics, the
    model reads back with the classes and reading options it was trained with, predict
    gives one row per slide with a class and probabilities, the attention (and so every
    patch read at full resolution) is on tissue, never on the glass around it, and
    visualize draws it. Training reads slides lazily in DataLoader workers (the readers are
    reopened in the training process); predict and visualize read the slides the same way
    by default."""
    from ats_cli.predict import load_predictor, read_inputs_csv

    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(slides), "--out", str(run), "--workers", "2", "--set", "level=0",
                                 "--set", "tissue_mask=on", *TRAIN_FLAGS])
    assert result.exit_code == 0, result.output
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["samples"] == SMALL.n_train  # every training slide, every epoch
        assert all(np.isfinite(m[k]) and m[k] >= 0 for k in ("train_loss", "test_loss", "entropy", "lr"))
        assert 0 <= m["train_acc"] <= 1 and 0 <= m["test_acc"] <= 1
    spec = torch.load(run / "best.pt", weights_only=True)["spec"]
    # the training slides' own microns per pixel, recorded (ats_cli.data.inputs)
    assert spec["input"] == {"reader": None, "level": None, "mpp": 0.5, "tissue": True, "resample": True}
    assert spec["channels"] == 3
    predictor = load_predictor(run, "cpu")  # the run directory stands for its best.pt
    assert predictor.path == run / "best.pt" and predictor.classes == ["normal", "tumor"]

    csv_out = tmp_path / "preds.csv"
    result = runner.invoke(app, ["predict", str(slides / "test.csv"), "--model", str(run), "--out", str(csv_out)])
    assert result.exit_code == 0, result.output
    header, *rows = [line.split(",") for line in csv_out.read_text().splitlines()]
    assert header == ["path", "prediction", "prob_normal", "prob_tumor", "label"]
    truth = {str(item.path): item.label for item in read_inputs_csv(slides / "test.csv")}
    assert sorted(r[0] for r in rows) == sorted(truth) and len(rows) == SMALL.n_test  # each slide once
    for path, prediction, p_normal, p_tumor, label in rows:
        assert prediction in predictor.classes and label == truth[path]
        assert float(p_normal) + float(p_tumor) == pytest.approx(1, abs=1e-5)
        assert prediction == ("tumor" if float(p_tumor) > float(p_normal) else "normal")

    # the attention of those predictions (the library's are the CLI's): all on the tissue mask, and so every patch
    looked = []

    def look(index, row, opened, out, b):
        looked.append((opened, out.attention[b], out.offsets[b]))

    again = predictor.predict(read_inputs_csv(slides / "test.csv"), on_output=look)
    assert sorted((str(r.path), r.prediction) for r in again) == sorted((r[0], r[1]) for r in rows)
    assert len(looked) == SMALL.n_test
    for opened, attention, offsets in looked:
        tissue = opened.support
        assert tissue is not None  # the tissue-mask option saved in the model reached prediction
        assert attention.shape == tissue.shape and 0.2 < float(tissue.float().mean()) < 0.8  # glass around tissue
        assert float(attention[tissue].sum()) == pytest.approx(1, abs=1e-5)  # none on the glass
        cells = (offsets + torch.tensor(predictor.model.patch_size) // 2) * predictor.model.scale  # patch centres
        assert all(tissue[int(r), int(c)] for r, c in cells.floor().long().tolist())

    png = tmp_path / "att.png"
    result = runner.invoke(app, ["visualize", str(slides / "test" / "0001.tif"), "--model", str(run),
                                 "--out", str(png), "--mpp", "2.0"])
    assert result.exit_code == 0, result.output
    assert "label tumor" in result.output and "boxes marked" in result.output  # the targets, from test.csv
    with Image.open(png) as im:
        assert im.width > 400 and im.height > 300
    # --mpp 2.0 picked level 1 (2 um/px): its patches come from the 256x256 level
    result = runner.invoke(app, ["visualize", str(slides / "test" / "0001.tif"), "--model", str(run),
                                 "--out", str(png), "--level", "0", "--mpp", "2.0"])
    assert result.exit_code == 2 and "not both" in result.output


def test_saved_reading_options_are_the_default_and_flags_override_them(slides, tmp_path):
    from ats_cli.predict import load_predictor

    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(slides), "--out", str(run), "--workers", "0", "--mpp", "2.0",
                                 "--set", "tissue_mask=off", "--epochs", "1", *TRAIN_FLAGS[2:]])
    assert result.exit_code == 0, result.output
    predictor = load_predictor(run)
    path = slides / "test" / "0000.tif"
    kw = {"channels": 3, "scale": 1 / 32, "patch_size": (64, 64)}
    saved = predictor.opener()(path, **kw)
    assert saved.source.size == (256, 256) and saved.support is None  # level of 2 um/px, no mask
    flagged = predictor.opener(level=0, tissue=True)(path, **kw)
    assert flagged.source.size == (1024, 1024) and flagged.support is not None


def test_tile_reads_do_not_depend_on_the_shared_file_offset(slides):
    """A forked DataLoader worker shares the file offset of every file the training
    process has open; reads must not use it (positional reads). Between single-tile reads
    the offset is moved, as a buffered file object finalised in a worker does."""
    import os

    path = slides / "train" / "0001.tif"
    truth = open_image(path)
    reader = open_image(path)
    fd = reader._tif.filehandle.fileno()
    size = os.path.getsize(path)
    for k, (row, col) in enumerate([(r, c) for r in range(0, 1024, 256) for c in range(0, 1024, 256)] * 2):
        os.lseek(fd, (k * 7919) % size, os.SEEK_SET)
        assert np.array_equal(reader.read_region(row, col, 256, 256, 0), truth.read_region(row, col, 256, 256, 0))


def test_a_corrupt_slide_stops_training_with_one_line_naming_it(slides, tmp_path):
    """Read in a DataLoader worker, a bad file must still give the CLI's one-line error
    naming it (not the worker's traceback wrapped in a RuntimeError)."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(slides, data)
    bad = data / "train" / "0001.tif"
    bad.write_bytes(bad.read_bytes()[:3000])  # truncated: the header survives, the tiles do not
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(data), "--out", str(run), "--workers", "2", *TRAIN_FLAGS])
    assert result.exit_code != 0
    assert "0001.tif" in "".join(result.output.split()) and "Traceback" not in result.output  # rich wraps lines
    assert "RuntimeError" not in result.output
