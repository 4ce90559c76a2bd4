"""ats pretrain's regions from QuPath GeoJSON: an annotation file per row gives the same
regions -- and so the same model -- as the boxes it was drawn from; a broken or missing
file or an unknown class stops the run in one line naming the file; RGB images on white,
as slides are, train too."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from ats_cli.checkpoint import load_checkpoint
from ats_cli.cli import app
from ats_cli.data import load_dataset
from ats_cli.data.dataset import write_dataset
from ats_cli.data.megapixel_mnist import generate_megapixel_mnist, make_config
from ats_cli.data.mnist import load_bundled_digits
from ats_cli.pretrain import PretrainError
from ats_cli.pretrain.annotations import read_annotations
from ats_cli.pretrain.patches import cut_patches
from ats_cli.pretrain.regions import row_regions
from ats_cli.pretrain.run import PretrainOptions, pretrain

SMALL = {"images": 12, "test_images": 4, "workers": 1, "device": "cpu", "epochs": 1, "attention_epochs": 1,
         "attention_net": "block-attention", "attention_width": 16, "feature_width": 16}
runner = CliRunner()


def _polygon(cls: str, top: int, left: int, h: int, w: int, *, multi: bool = False) -> dict:
    """A QuPath annotation (x = column, y = row) whose outline's bounding box is the box:
    a diamond-ish octagon touching all four sides, so the box is not the polygon."""
    ring = [[left + w / 2, top], [left + w, top + h / 3], [left + w, top + h], [left + w / 3, top + h],
            [left, top + h / 2], [left + w / 2, top]]
    geometry = ({"type": "MultiPolygon", "coordinates": [[ring]]} if multi
                else {"type": "Polygon", "coordinates": [ring, [[left + 5, top + 5], [left + 6, top + 5],
                                                                [left + 6, top + 6], [left + 5, top + 5]]]})
    return {"type": "Feature", "id": "x", "geometry": geometry,
            "properties": {"objectType": "annotation", "classification": {"name": cls, "color": [255, 0, 0]}}}


def _annotated(root: Path) -> Path:
    """A small Megapixel MNIST set whose rows also name a GeoJSON file of their digits."""
    config = make_config("small", n_train=12, n_test=4, width=300, height=300, n_noise=6, seed=0,
                         noise="fragments,glyphs")
    generate_megapixel_mnist(root, config, load_bundled_digits(), workers=1)
    data = load_dataset(root)
    splits = {}
    for split in ("train", "test"):
        rows = []
        for k, rec in enumerate(data[split]):
            boxes = json.loads(rec.extra["digits"])
            features = [_polygon(c, r, col, h, w, multi=bool(i % 2)) for i, (c, r, col, h, w) in enumerate(boxes)]
            features.append({"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [[[0, 0], [9, 0],
                             [9, 9], [0, 0]]]}, "properties": {"objectType": "annotation"}})  # unclassified: skipped
            name = f"annotations/{split}-{k}.geojson"
            (root / name).parent.mkdir(exist_ok=True)
            doc = {"type": "FeatureCollection", "features": features} if k % 2 else features  # both layouts
            (root / name).write_text(json.dumps(doc))
            rows.append({"path": str(rec.path), "label": data.classes[rec.label], **rec.extra, "annotations": name})
        splits[split] = rows
    write_dataset(root, data.classes, splits, hints=data.hints, generator=data.meta.get("generator"))
    return root


def test_geojson_regions_are_the_boxes_they_were_drawn_from_and_train_the_same_model(tmp_path: Path) -> None:
    data = _annotated(tmp_path / "mix")
    dataset = load_dataset(data)
    for rec in dataset["train"]:
        assert (row_regions(dict(rec.extra), "annotations", dataset.classes, "x", data)
                == row_regions(dict(rec.extra), "digits", dataset.classes, "x"))
    for column in ("digits", "annotations"):
        pretrain(PretrainOptions(data=str(data), out=str(tmp_path / f"{column}.pt"), regions=column, **SMALL),
                 log=lambda line: None)
    a, b = (load_checkpoint(tmp_path / f"{c}.pt") for c in ("digits", "annotations"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert b["pretrain"]["regions"] == "annotations"


@pytest.mark.parametrize(("content", "says"), [
    (None, "annotation file not found"),
    ("{not json", "not a GeoJSON file"),
    ('{"type": "Topology"}', "not a GeoJSON FeatureCollection"),
    (json.dumps([_polygon("cat", 10, 10, 20, 20)]), "feature 1 has class 'cat', not one of the dataset's"),
    (json.dumps([{"type": "Feature", "geometry": {"type": "Point", "coordinates": [3, 4]},
                  "properties": {"classification": {"name": "7"}}}]), "feature 1 ('7') is a 'Point'"),
])
def test_a_bad_annotation_file_is_refused_in_one_line_naming_it(tmp_path: Path, content, says) -> None:
    path = tmp_path / "slide 1.geojson"
    if content is not None:
        path.write_text(content)
    with pytest.raises(PretrainError, match=re.escape(says)) as info:
        read_annotations(path, [str(c) for c in range(10)])
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_the_command_names_the_annotation_file(tmp_path: Path) -> None:
    data = _annotated(tmp_path / "mix")
    (data / "annotations" / "train-3.geojson").write_text("[")
    result = runner.invoke(app, ["pretrain", str(data), "--out", str(tmp_path / "x.pt"), "--regions", "annotations",
                                 "--workers", "0"])
    assert result.exit_code == 1 and "train-3.geojson: not a GeoJSON file" in " ".join(result.output.split())
    assert "Traceback" not in result.output and not (tmp_path / "x.pt").exists()


def test_rgb_images_on_white_train_from_geojson(tmp_path: Path) -> None:
    """A slide-like set: RGB tiles on white glass, a dark 'nest' per tumour tile annotated in
    GeoJSON, normal tiles with an empty annotation file. Patches are cut in colour, the
    clutter patches on tissue rather than glass, and the checkpoint reads three channels."""
    rng = np.random.default_rng(0)
    rows = {"train": [], "test": []}
    for split, n in (("train", 6), ("test", 2)):
        for k in range(n):
            image = np.full((240, 240, 3), 240, np.uint8)
            for _ in range(6):  # pink decoy cells
                r, c = rng.integers(10, 220, 2)
                image[r : r + 12, c : c + 12] = (200, 120, 160)
            features = []
            if k % 2:
                r, c = rng.integers(20, 180, 2)
                image[r : r + 30, c : c + 30] = (90, 40, 110)
                features.append(_polygon("tumor", int(r), int(c), 30, 30))
            Image.fromarray(image).save(tmp_path / f"{split}{k}.png")
            (tmp_path / f"{split}{k}.geojson").write_text(json.dumps({"type": "FeatureCollection",
                                                                      "features": features}))
            rows[split].append({"path": f"{split}{k}.png", "label": "tumor" if k % 2 else "normal",
                                "annotations": f"{split}{k}.geojson"})
    write_dataset(tmp_path, ["normal", "tumor"], rows, hints={"channels": 3, "patch_size": [48, 48]})
    image = np.asarray(Image.open(tmp_path / "train1.png")).transpose(2, 0, 1).copy()
    regions = row_regions({"annotations": "train1.geojson"}, "annotations", ["normal", "tumor"], "x", tmp_path)
    patches, labels = cut_patches(image, regions, 48, seed=0, shrunken=0, none=2)
    assert patches.shape[1:] == (3, 48, 48) and 1 in labels and 2 in labels
    assert (patches[labels == 2].min(axis=(1, 2, 3)) < 220).mean() > 0.5  # clutter patches hold tissue
    with pytest.raises(PretrainError, match="give --shrunken 0"):
        pretrain(PretrainOptions(data=str(tmp_path), out=str(tmp_path / "x.pt"), regions="annotations", **SMALL))
    pretrain(PretrainOptions(data=str(tmp_path), out=str(tmp_path / "rgb.pt"), regions="annotations", shrunken=0,
                             scale=0.25, **SMALL), log=lambda line: None)
    ckpt = load_checkpoint(tmp_path / "rgb.pt")
    assert ckpt["classes"] == ["normal", "tumor"] and ckpt["spec"]["channels"] == 3
