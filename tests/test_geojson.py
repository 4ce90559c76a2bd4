"""GeoJSON for QuPath (ats visualize --out X.geojson, ats predict --save-attention): the
polygons land on the right level-0 pixels at every pyramid level and via --mpp and stay on
the image, the file is valid GeoJSON, the estimator weights are the ones the model used,
the preview draws it, and predict keeps going past a bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
import torch.nn as nn
from typer.testing import CliRunner

import ats_cli.predict as predict_mod
import ats_cli.visualize as visualize_mod
from ats_cli.checkpoint import save_checkpoint
from ats_cli.cli import app
from ats_cli.config import TrainConfig
from ats_cli.core.source import positions_to_offsets
from ats_cli.models import check_model, create_model, model_spec
from ats_cli.predict import load_predictor, resolve_inputs
from ats_cli.render.geojson import (
    MAX_CELLS,
    cell_boxes,
    feature_collection,
    geojson_text,
    patch_boxes,
    select_cells,
    unique_names,
)
from ats_cli.render.records import AttentionRecord, LevelFrame

runner = CliRunner()
CLASSES = ["normal", "tumor"]
H0, W0 = 256, 384  # level 0, rows x columns: not square, so that x/y swaps show
SQUARE = (128, 192, 256, 320)  # bright square, level-0 rows [128, 192) x columns [256, 320); centre (160, 288)
MPP0 = 0.25  # level-0 microns per pixel; levels 1 and 2 are 0.5 and 1.0
PATCH, SCALE = 16, 0.125  # the model: 16x16 patches (in the pixels of the level read), low-res view 1/8

# The patch on the square's centre cell, in level-0 pixels (x0, y0, x1, y1), per level read.
# Level L (downsample d = 2**L) has the low-res view (32, 48) / 2**L; the hot cell is at 0.625, 0.75 of it:
#   level 0: cell (20, 36), centre (164, 292) -> top-left (156, 284), 16 px
#   level 1: cell (10, 18), centre (84, 148) in level 1 -> (76, 140) -> x 2*140.., y 2*76.., 32 px
#   level 2: cell (5, 9), centre (44, 76) in level 2 -> (36, 68) -> x 4*68.., y 4*36.., 64 px
EXPECTED = {0: (284, 156, 300, 172), 1: (280, 152, 312, 184), 2: (272, 144, 336, 208)}


def level0_image() -> np.ndarray:
    """[H0, W0, 3] uint8: gray texture (no saturation, so the tissue mask keeps every cell) with a white square."""
    rng = np.random.default_rng(0)
    gray = rng.integers(0, 200, (H0, W0), dtype=np.uint8)
    r0, r1, c0, c1 = SQUARE
    gray[r0:r1, c0:c1] = 255
    return np.repeat(gray[..., None], 3, axis=2)


def write_pyramid(path: Path, image: np.ndarray) -> Path:
    """Levels 1, 1/2, 1/4 as separate IFDs (as tests/test_slides.py), resolution tags at MPP0."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tifffile.TiffWriter(path) as tw:
        for k in range(3):
            tw.write(image[:: 2**k, :: 2**k].copy(), tile=(64, 64), compression="zlib", subfiletype=1 if k else 0,
                     photometric="rgb", metadata=None, resolution=(1e4 / MPP0, 1e4 / MPP0),
                     resolutionunit="CENTIMETER")
    return path


def make_model(path: Path, *, n_patches: int = 1, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    # eval_n_patches=0: prediction draws exactly n_patches, which these tests count
    spec = model_spec(TrainConfig(patch_size=PATCH, scale=SCALE, n_patches=n_patches, eval_n_patches=0,
                                  feature_width=8), n_classes=len(CLASSES), channels=3)
    model = create_model(spec)
    nn.init.normal_(model.attention_net.score.weight, std=0.5)  # a peaked, non-uniform attention
    save_checkpoint(path, spec=spec, classes=CLASSES, model=model)
    return path


class HotCells(nn.Module):
    """Attention on given cells only, at fractions (row, col) of the view (scores 0 there, -1e4 elsewhere:
    probability exactly 0), so the sampled positions are known at every level."""

    margin = 0

    def __init__(self, *fracs: tuple[float, float]):
        super().__init__()
        self.fracs = fracs

    def forward(self, low: torch.Tensor) -> torch.Tensor:
        h, w = low.shape[-2:]
        scores = torch.full((low.shape[0], 1, h, w), -1e4)
        for fr, fc in self.fracs:
            scores[..., int(fr * h), int(fc * w)] = 0.0
        return scores


@pytest.fixture(scope="module")
def slide(tmp_path_factory) -> Path:
    return write_pyramid(tmp_path_factory.mktemp("slide") / "slide.tif", level0_image())


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "model.pt")


def hot_predictor(model_file: Path, *fracs):
    predictor = load_predictor(model_file, "cpu")
    predictor.model.attention_net = HotCells(*fracs)
    predictor.model.n_patches = len(fracs)
    return predictor


def run_record(predictor, slide: Path, **reading):
    """One forward pass with the patches returned; (record, collection, patches [n, C, h, w] uint8)."""
    net = predictor.model
    opened = predictor.opener(**reading)(slide, channels=3, scale=net.scale, patch_size=net.patch_size)
    with torch.no_grad():
        out = net(opened.low[None], [opened.source], generator=torch.Generator().manual_seed(0), return_patches=True,
                  support_mask=None if opened.support is None else opened.support[None])
    record = AttentionRecord.from_output(net, opened, out, 0)
    probs = torch.softmax(out.logits[0], 0).tolist()
    collection = feature_collection(record, CLASSES, probs, image=slide)
    patches = (out.patches[0] * 255).round().to(torch.uint8).numpy()
    return record, collection, patches


def patch_features(collection: dict) -> list[dict]:
    return [f for f in collection["features"] if f["properties"]["name"].startswith("patch ")]


def box_of(feature: dict) -> tuple[float, float, float, float]:
    ring = np.asarray(feature["geometry"]["coordinates"][0], dtype=float)
    return ring[:, 0].min(), ring[:, 1].min(), ring[:, 0].max(), ring[:, 1].max()


def read_box(feature: dict) -> tuple[float, float, float, float]:
    """The box the model read (properties.patch_box), which the polygon clips to the image."""
    return tuple(feature["properties"]["patch_box"])


def region0(image: np.ndarray, box, d: int) -> np.ndarray:
    """The level-0 pixels a box covers, taken every d-th (the pyramid's levels are image[::d, ::d]),
    zeros outside the image: what a reader at that level returns for the box."""
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    out = np.zeros(((y1 - y0) // d, (x1 - x0) // d, image.shape[2]), dtype=np.uint8)
    for i, y in enumerate(range(y0, y1, d)):
        for j, x in enumerate(range(x0, x1, d)):
            if 0 <= y < image.shape[0] and 0 <= x < image.shape[1]:
                out[i, j] = image[y, x]
    return out


def check_valid(collection: dict) -> None:
    """A FeatureCollection of closed, counter-clockwise polygons with finite numbers, readable as JSON."""
    text = geojson_text(collection)

    def no_constant(name):
        raise AssertionError(f"non-finite number {name} in the GeoJSON")

    data = json.loads(text, parse_constant=no_constant)
    assert data["type"] == "FeatureCollection" and data["features"]
    for f in data["features"]:
        assert f["type"] == "Feature" and f["geometry"]["type"] == "Polygon"
        ring = f["geometry"]["coordinates"][0]
        assert len(ring) >= 4 and ring[0] == ring[-1]
        xs, ys = np.asarray(ring, dtype=float).T
        assert np.isfinite(xs).all() and np.isfinite(ys).all()
        assert 0.5 * float(np.sum(xs[:-1] * ys[1:] - xs[1:] * ys[:-1])) > 0  # counter-clockwise (RFC 7946)
        p = f["properties"]
        assert p["objectType"] in ("annotation", "detection")
        assert all(math.isfinite(v) for v in p.get("measurements", {}).values())


# ---------------------------------------------------------------------------- geometry


@pytest.mark.parametrize("level", [0, 1, 2])
def test_patch_lands_on_the_square_at_every_level(model_file, slide, level):
    predictor = hot_predictor(model_file, (0.625, 0.75))
    record, collection, patches = run_record(predictor, slide, level=level)
    assert record.frame == LevelFrame(level, float(2**level), (H0 >> level, W0 >> level), (H0, W0), (MPP0, MPP0))
    (feature,) = patch_features(collection)
    assert box_of(feature) == EXPECTED[level]
    x0, y0, x1, y1 = EXPECTED[level]
    assert x0 <= 288 < x1 and y0 <= 160 < y1  # on the square's centre
    assert (patches[0] == 255).mean() > 0.5  # and the model saw the square there
    np.testing.assert_array_equal(region0(level0_image(), box_of(feature), 2**level), patches[0].transpose(1, 2, 0))
    m = feature["properties"]["measurements"]
    assert m == {"attention": 1.0, "draw_order": 1, "weight": 1.0}  # the only cell: exact, weight a = 1
    check_valid(collection)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_every_patch_covers_the_pixels_the_model_read(model_file, slide, level):
    """Corners too (patches partly outside the image, zero-padded): the level-0 pixels under each
    patch_box, every d-th, are exactly the patch the model was given, and the polygon is that box
    cut to the image."""
    predictor = hot_predictor(model_file, (0.0, 0.0), (0.999, 0.999), (0.625, 0.75), (0.3, 0.1))
    record, collection, patches = run_record(predictor, slide, level=level)
    features = patch_features(collection)
    assert len(features) == 4 and [f["properties"]["measurements"]["draw_order"] for f in features] == [1, 2, 3, 4]
    image = level0_image()
    for feature, patch in zip(features, patches, strict=True):
        np.testing.assert_array_equal(region0(image, read_box(feature), 2**level), patch.transpose(1, 2, 0))
        x0, y0, x1, y1 = read_box(feature)
        assert box_of(feature) == (max(x0, 0), max(y0, 0), min(x1, W0), min(y1, H0))
    boxes = {read_box(f) for f in features}
    d = 2**level
    assert (-4 * d, -4 * d, 12 * d, 12 * d) in boxes  # the top-left cell's patch sticks out of the image
    assert EXPECTED[level] in boxes


@pytest.mark.parametrize("kind", ["slide", "png"])
def test_patch_polygons_stay_on_the_image(tmp_path, slide, model_file, monkeypatch, kind):
    """QuPath draws the polygons on the slide: a patch at the border, which the reader pads
    with zeros, is clipped to the image there, through `ats visualize --out X.geojson`, for a
    pyramid read at level 1 and for a plain PNG; patch_box keeps what the model read."""
    hot_cells(monkeypatch, (0.0, 0.0), (0.999, 0.999))
    image = slide
    if kind == "png":
        from PIL import Image

        image = tmp_path / "image.png"
        Image.fromarray(level0_image()).save(image)
    out = tmp_path / "x.geojson"
    flags = ["--level", "1"] if kind == "slide" else []
    result = runner.invoke(app, ["visualize", str(image), "--model", str(model_file), "--out", str(out), *flags])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    patches = patch_features(data)
    assert len(patches) == 2
    for f in data["features"]:
        x0, y0, x1, y1 = box_of(f)
        assert 0 <= x0 < x1 <= W0 and 0 <= y0 < y1 <= H0, (f["properties"]["name"], box_of(f))
    outside = [read_box(f) for f in patches if read_box(f) != box_of(f)]
    assert len(outside) == 2  # both corners' patches stick out ...
    assert any(b[0] < 0 and b[1] < 0 for b in outside) and any(b[2] > W0 and b[3] > H0 for b in outside)


def test_cells_and_patches_share_one_footprint():
    """Each cell's square is centred on the patch positions_to_offsets gives its index (to rounding),
    with a margin, a non-square view and a level of downsample 2."""
    frame = LevelFrame(1, 2.0, (300, 410), (600, 820))
    att_shape, low, margin = (5, 7), (14, 19), 2
    cells = cell_boxes(att_shape, low, margin, frame)
    idx = torch.arange(35)[None]
    offsets = positions_to_offsets(idx, att_shape, (300, 410), (32, 32), low_size=low, margin=margin)[0]
    patches = patch_boxes(offsets, (32, 32), frame)
    centre = lambda b: ((b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2)  # noqa: E731
    for a, b in zip(centre(cells), centre(patches), strict=True):
        assert np.abs(a - b).max() <= 0.5 * frame.downsample + 1e-9
    # the cells tile the map's footprint: margin 2 of 14 low-res rows -> level-0 rows 2/14*600 .. 12/14*600
    assert cells[:, 1].min() == pytest.approx(2 / 14 * 600) and cells[:, 3].max() == pytest.approx(12 / 14 * 600)
    assert cells[:, 0].min() == pytest.approx(2 / 19 * 820) and cells[:, 2].max() == pytest.approx(17 / 19 * 820)


def test_select_cells_is_bounded():
    uniform = np.full((300, 300), 1 / 90000)  # an untrained map of a large slide
    assert len(select_cells(uniform)) == MAX_CELLS
    peaked = np.zeros((10, 10))
    peaked.flat[[3, 50, 7]] = [0.7, 0.295, 0.005]
    assert select_cells(peaked).tolist() == [3, 50]  # 99.5% in two cells; zeros never
    assert select_cells(peaked, mass=1.0).tolist() == [3, 50, 7]


def test_unique_names():
    names = unique_names(["a/x.tif", "b/x.tif", "x-2.png", "c/X.svs", "y.ome.tif"])
    assert names == ["x.geojson", "x-2.geojson", "x-2-2.geojson", "X-3.geojson", "y.ome.geojson"]


def test_check_model():
    with pytest.raises(ValueError, match="attention-sampling model"):
        check_model(nn.Linear(2, 2))


# ---------------------------------------------------------------------------- weights


@pytest.mark.parametrize("estimator,samples", [("threshold", 1), ("threshold", 3), ("sequential", 2)])
def test_the_weights_written_are_the_models(tmp_path, slide, estimator, samples):
    """logits = W (sum_k w_k f_k) + b = sum_k w_k (patch_logit_k - b) + b: the weights the output
    carries reproduce the model's own logits, through Predictor.predict (batch of 2, several
    samplings), and --save-attention writes them."""
    predictor = load_predictor(make_model(tmp_path / "m.pt", n_patches=5), "cpu")
    predictor.model.estimator = estimator
    seen = []
    other = write_pyramid(tmp_path / "other.tif", level0_image()[:, ::-1].copy())
    rows = predictor.predict(resolve_inputs([slide, other]), samples=samples, batch_size=2, seed=7,
                             on_output=lambda i, row, opened, out, b: seen.append((i, opened, out, b)))
    assert all(r.ok for r in rows) and len(seen) == 2 and seen[0][2] is seen[1][2]  # one batch
    out = seen[0][2]
    w = out.weights.double()
    bias = predictor.model.classifier.bias.double()
    rebuilt = torch.einsum("bn,bnc->bc", w, out.patch_logits.double() - bias) + bias
    torch.testing.assert_close(rebuilt, out.logits.double(), atol=1e-4, rtol=1e-4)
    if estimator == "sequential":
        torch.testing.assert_close(w.sum(1), torch.ones(2, dtype=torch.float64))
    for i, opened, output, b in seen:
        record = AttentionRecord.from_output(predictor.model, opened, output, b)
        collection = feature_collection(record, CLASSES, rows[i].probs)
        written = [f["properties"]["measurements"]["weight"] for f in patch_features(collection)]
        assert written == [float(f"{v:.4g}") for v in w[b].tolist()]


# ---------------------------------------------------------------------------- the commands


def hot_cells(monkeypatch, *fracs):
    """load_predictor hands out models whose attention sits on the cells at ``fracs``, one patch each."""
    real = predict_mod.load_predictor

    def load(*args, **kwargs):
        predictor = real(*args, **kwargs)
        predictor.model.attention_net = HotCells(*fracs)
        predictor.model.n_patches = len(fracs)
        return predictor

    monkeypatch.setattr(predict_mod, "load_predictor", load)
    monkeypatch.setattr(visualize_mod, "load_predictor", load)


@pytest.fixture
def hot_model(monkeypatch):
    """load_predictor hands out models whose attention sits on the square's centre cell."""
    hot_cells(monkeypatch, (0.625, 0.75))


@pytest.mark.parametrize("flags,level", [([], 0), (["--level", "1"], 1), (["--mpp", "0.5"], 1), (["--mpp", "1"], 2)])
def test_visualize_writes_geojson_by_extension(tmp_path, slide, model_file, hot_model, flags, level):
    out = tmp_path / "out" / "slide.GeoJSON"
    result = runner.invoke(app, ["visualize", str(slide), "--model", str(model_file), "--out", str(out), *flags])
    assert result.exit_code == 0, result.output
    assert f"level {level}" in result.output and "1 patches" in result.output
    data = json.loads(out.read_text())
    check_valid(data)
    assert data["properties"]["level"] == level and data["properties"]["downsample"] == 2**level
    assert data["properties"]["image_size"] == {"width": W0, "height": H0}
    (feature,) = patch_features(data)
    assert box_of(feature) == EXPECTED[level]
    head = data["features"][0]["properties"]
    assert head["objectType"] == "annotation" and set(head["measurements"]) == {"prob_normal", "prob_tumor"}
    cells = [f for f in data["features"] if f["properties"]["name"].startswith("cell ")]
    assert len(cells) == 1 and box_of(cells[0])[2] - box_of(cells[0])[0] == 8 * 2**level  # one 8-px cell, at level 0


def test_visualize_geojson_errors(tmp_path, slide, model_file):
    (tmp_path / "run" / "epochs").mkdir(parents=True)
    result = runner.invoke(app, ["visualize", str(tmp_path / "run"), "--image", str(slide), "--out",
                                 str(tmp_path / "x.geojson")])
    assert result.exit_code == 2 and "IMAGE mode" in result.stderr


def test_predict_save_attention(tmp_path, slide, model_file):
    a = write_pyramid(tmp_path / "a" / "slide.tif", level0_image())
    b = write_pyramid(tmp_path / "b" / "slide.tif", level0_image()[::-1].copy())
    corrupt = tmp_path / "corrupt.tif"
    corrupt.write_bytes(b"II*\x00 not a tiff at all")
    folder = tmp_path / "attention"
    result = runner.invoke(app, ["predict", str(a), str(corrupt), str(b), "--model", str(model_file),
                                 "--save-attention", str(folder), "--device", "cpu"])
    assert result.exit_code == 1, result.output
    assert str(corrupt) in result.stderr and "2 attention file(s)" in result.output
    assert sorted(p.name for p in folder.iterdir()) == ["slide-2.geojson", "slide.geojson"]
    first, second = (json.loads((folder / n).read_text()) for n in ("slide.geojson", "slide-2.geojson"))
    assert first["properties"]["image"] == str(a) and second["properties"]["image"] == str(b)
    for data in (first, second):
        check_valid(data)
        patches = patch_features(data)
        assert len(patches) == 1 and set(patches[0]["properties"]["measurements"]) == {"attention", "draw_order",
                                                                                       "weight"}
    # a file where the folder should be: refused before anything is predicted
    result = runner.invoke(app, ["predict", str(a), "--model", str(model_file), "--save-attention", str(corrupt)])
    assert result.exit_code == 2 and "not a directory" in result.stderr.lower()


def test_preview_of_the_geojson(tmp_path, slide, model_file, hot_model):
    """--preview draws the file written over the image; without a .geojson --out it is refused."""
    out, png = tmp_path / "x.geojson", tmp_path / "preview" / "x.png"
    result = runner.invoke(app, ["visualize", str(slide), "--model", str(model_file), "--out", str(out),
                                 "--preview", str(png)])
    assert result.exit_code == 0, result.output
    assert out.is_file() and f"wrote {png}" in result.output
    from PIL import Image

    with Image.open(png) as im:
        assert im.format == "PNG" and im.width > 500 and f"{im.width}x{im.height} px" in result.output
    result = runner.invoke(app, ["visualize", str(slide), "--model", str(model_file), "--out", str(tmp_path / "f.png"),
                                 "--preview", str(png)])
    assert result.exit_code == 2 and "--out X.geojson" in result.stderr
