"""OME-Zarr stores (NGFF 0.4 on Zarr v2, 0.5 on Zarr v3) as an input like any slide.

The stores are written here, with zarr, in the layout the NGFF spec gives: the group's
``multiscales`` (``.zattrs``, or ``zarr.json``'s ``attributes.ome``) naming datasets
"0", "1", ... with their scale transformations and the axes' units.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

zarr = pytest.importorskip("zarr")

from ats_cli.cli import app  # noqa: E402
from ats_cli.data.inputs import ViewCache, open_input  # noqa: E402
from ats_cli.data.slides import SlideReadError, open_image  # noqa: E402

runner = CliRunner()
H, W = 300, 460


def _image(seed=0, h=H, w=W, channels=3, dtype=np.uint8):
    rng = np.random.default_rng(seed)
    return rng.integers(0, np.iinfo(dtype).max + 1, (h, w, channels), dtype=dtype)


def write_ome_zarr(path, image, *, n_levels=2, mpp=0.25, unit="micrometer", version="0.4", axes="cyx",
                   chunks=64, omero=None):
    """``image`` [H, W, C] as an OME-Zarr store at ``path``: level k is ``image[::2**k, ::2**k]``,
    each a dataset "k" with a scale of ``mpp * 2**k`` on y and x; ``axes`` any of cyx, yx,
    tczyx, yxc. Returns the levels as [h, w, C] arrays."""
    fmt = 2 if version == "0.4" else 3
    group = zarr.open_group(str(path), mode="w", zarr_format=fmt)
    levels = [image[:: 2**k, :: 2**k] for k in range(n_levels)]
    datasets = []
    for k, lv in enumerate(levels):
        arr = lv
        if "c" not in axes:
            arr = lv[:, :, 0]
        elif axes.index("c") < axes.index("y"):
            arr = np.moveaxis(lv, 2, 0)
        arr = arr.reshape([1 if a in "tz" else s for a, s in zip(axes, _dims(axes, lv), strict=True)])
        chunk = [min(chunks, s) if a in "yx" else s for a, s in zip(axes, arr.shape, strict=True)]
        z = group.create_array(str(k), shape=arr.shape, chunks=tuple(chunk), dtype=arr.dtype)
        z[...] = arr
        scale = [mpp * 2**k if a in "yx" else 1.0 for a in axes]
        datasets.append({"path": str(k), "coordinateTransformations": [{"type": "scale", "scale": scale}]})
    kinds = {"t": "time", "c": "channel", "z": "space", "y": "space", "x": "space"}
    named = [{"name": a, "type": kinds[a], **({"unit": unit} if a in "yx" and unit else {})} for a in axes]
    ms = {"axes": named, "datasets": datasets, "name": Path(path).name}
    attrs = {"multiscales": [{"version": "0.4", **ms}] if fmt == 2 else [ms]}
    if omero is not None:
        attrs["omero"] = omero
    if fmt == 2:
        group.attrs.update(attrs)
    else:
        group.attrs["ome"] = {"version": version, **attrs}
    return levels


def _dims(axes, lv):
    size = {"y": lv.shape[0], "x": lv.shape[1], "c": lv.shape[2]}
    return [size.get(a, 1) for a in axes]


@pytest.mark.parametrize("version", ["0.4", "0.5"])
def test_levels_and_microns_come_from_the_stores_own_metadata(tmp_path, version):
    path = tmp_path / "slide.ome.zarr"
    write_ome_zarr(path, _image(), n_levels=3, mpp=0.25, version=version)
    with open_image(path) as slide:
        assert slide.name == "omezarr" and slide.vendor == f"ome-zarr {version}"
        assert slide.levels == [(300, 460), (150, 230), (75, 115)]
        assert slide.downsamples == [1.0, 2.0, 4.0]
        assert slide.mpp == pytest.approx((0.25, 0.25)) and slide.channels == 3
        assert slide.level_mpps == pytest.approx([0.25, 0.5, 1.0])
    # another length unit is converted; no unit is no scale, said as such
    write_ome_zarr(path, _image(), mpp=500.0, unit="nanometer", version=version)
    assert open_image(path).mpp == pytest.approx((0.5, 0.5))
    write_ome_zarr(path, _image(), mpp=0.25, unit=None, version=version)
    with open_image(path) as slide:
        assert slide.mpp is None and "no unit" in slide.scale_unknown


@pytest.mark.parametrize(("version", "axes"), [("0.4", "cyx"), ("0.5", "cyx"), ("0.5", "tczyx"), ("0.4", "yx")])
def test_patches_are_the_arrays_crop_bit_for_bit_at_levels_0_and_1(tmp_path, version, axes):
    image = _image(1, channels=1 if axes == "yx" else 3)
    path = tmp_path / "slide.ome.zarr"
    levels = write_ome_zarr(path, image, version=version, axes=axes)
    slide = open_image(path)
    offsets = torch.tensor([[0, 0], [37, 101], [150, 300], [H - 40, W - 40]])
    for level in (0, 1):
        slide.set_level(level)
        lv = levels[level]
        pad = np.zeros((H + 64, W + 64, lv.shape[2]), np.uint8)
        pad[: lv.shape[0], : lv.shape[1]] = lv  # zeros past the edge, as every reader gives
        got = slide.read_patches(offsets, (48, 64))
        assert got.dtype == torch.uint8 and got.shape == (4, lv.shape[2], 48, 64)
        for (r, c), patch in zip(offsets.tolist(), got, strict=True):
            want = pad[r : r + 48, c : c + 64].transpose(2, 0, 1)
            assert np.array_equal(patch.numpy(), want), (level, r, c)


def test_sixteen_bit_samples_are_scaled_by_the_stores_display_window(tmp_path):
    image = _image(2, dtype=np.uint16) % 4096  # a 12-bit camera
    window = {"channels": [{"window": {"start": 100, "end": 4000, "min": 0, "max": 65535}} for _ in range(3)]}
    path = tmp_path / "fluo.ome.zarr"
    write_ome_zarr(path, image, version="0.5", omero=window)
    got = open_image(path).read_region(10, 20, 30, 40, 0)
    want = np.clip(np.rint((image[10:40, 20:60].astype(float) - 100) * 255 / 3900), 0, 255).astype(np.uint8)
    assert got.dtype == np.uint8 and np.array_equal(got, want)
    write_ome_zarr(path, image, version="0.5")  # no window: no one right scaling, refused by name
    with pytest.raises(SlideReadError, match="16-bit.*display window") as e:
        open_image(path)
    assert str(path) in str(e.value)


def test_a_store_claiming_a_huge_shape_reads_only_the_chunks_a_patch_touches(tmp_path):
    """A 2,000,000-pixel-square level 0 (12 TB as RGB) with two chunks on disk: opened,
    listed by ats info, a patch read from those chunks; the chunks a patch does not touch
    are never looked at (every other one is missing, which a read of it would refuse);
    a view that would need a level over the pixel budget is refused by name."""
    path = tmp_path / "huge.ome.zarr"
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    side = 2_000_000
    arr = group.create_array("0", shape=(3, side, side), chunks=(3, 256, 256), dtype="uint8")
    tile = _image(3, 256, 512)
    arr[:, 1024:1280, 2048:2560] = np.moveaxis(tile, 2, 0)
    group.attrs["ome"] = {"version": "0.5", "multiscales": [{
        "axes": [{"name": "c", "type": "channel"}, {"name": "y", "type": "space", "unit": "micrometer"},
                 {"name": "x", "type": "space", "unit": "micrometer"}],
        "datasets": [{"path": "0", "coordinateTransformations": [{"type": "scale", "scale": [1, 0.5, 0.5]}]}]}]}
    assert sum(len(f) for _, _, f in os.walk(path / "0")) == 3  # zarr.json and the two chunks
    slide = open_image(path)
    assert slide.levels == [(side, side)]
    patch = slide.read_patches(torch.tensor([[1024 + 10, 2048 + 200]]), (64, 96))
    assert np.array_equal(patch[0].numpy(), tile[10:74, 200:296].transpose(2, 0, 1))
    with pytest.raises(SlideReadError, match="missing") as e:
        slide.read_patches(torch.tensor([[0, 0]]), (16, 16))
    assert str(path) in str(e.value) and "0/c/0/0/0" in str(e.value)
    with pytest.raises(SlideReadError, match="pixel"):
        slide.low_res_view(0.001)
    result = runner.invoke(app, ["info", str(path)])
    assert result.exit_code == 0, result.output
    assert "reader: omezarr" in result.output and "2,000,000" in result.output


def test_ats_info_on_a_store_and_on_a_folder_of_them(tmp_path):
    path = tmp_path / "a" / "slide.ome.zarr"
    write_ome_zarr(path, _image(), n_levels=2, mpp=0.25, version="0.5")
    write_ome_zarr(tmp_path / "a" / "other.zarr", _image(4, 200, 260), version="0.4")
    result = runner.invoke(app, ["info", str(path)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "reader: omezarr" in out and "vendor: ome-zarr 0.5" in out and "channels: 3" in out
    assert "mpp: 0.25 x 0.25 µm" in out and "150" in out and "230" in out  # level 1's height and width
    result = runner.invoke(app, ["info", str(tmp_path / "a")])  # a folder: each store once, not its chunks
    assert result.exit_code == 0, result.output
    assert "2 image(s) in 2 size(s), long side 260-460 px" in result.output


@pytest.mark.parametrize("fault", ["missing chunk", "no multiscales", "damaged chunk"])
def test_a_broken_store_is_one_line_naming_it(tmp_path, fault):
    path = tmp_path / "bad.ome.zarr"
    write_ome_zarr(path, _image(), version="0.4", chunks=64)
    if fault == "missing chunk":
        (path / "0" / "0.1.2").unlink()  # (c, y, x) chunk: rows 64-127, columns 128-191
    elif fault == "no multiscales":
        (path / ".zattrs").write_text(json.dumps({"name": "not an image"}))
    else:
        (path / "0" / "0.1.2").write_bytes(b"not a compressed chunk")
    csv = tmp_path / "in.csv"
    csv.write_text(f"path\n{path}\n")
    model = _tiny_model(tmp_path)
    out = tmp_path / "p.csv"
    result = runner.invoke(app, ["predict", str(csv), "--model", str(model), "--out", str(out), "--level", "0",
                                 "--tissue-mask", "off", "--n-patches", "200", "--device", "cpu"])
    assert result.exit_code == 1, result.output
    said = {"missing chunk": "chunk 0/0.1.2 of level 0 (row 64, column 128) is missing",
            "no multiscales": "is not an OME-Zarr image: its .zattrs has no 'multiscales' metadata",
            "damaged chunk": "region at row 64, column 128 of level 0"}[fault]  # the chunk, read whole
    lines = [line for line in result.output.splitlines() if str(path) in line and said in line]
    assert len(lines) == 1, result.output  # the failed inputs' list: the store, and why
    assert "0 predicted, 1 failed" in result.output and not out.read_text().splitlines()[1:]
    assert "Traceback" not in result.output
    if fault == "no multiscales":
        result = runner.invoke(app, ["info", str(path)])
        assert result.exit_code == 1 and str(path) in result.output and "multiscales" in result.output


def _tiny_model(tmp_path):
    """A small RGB model file of the kind ats train writes, to predict with (what it
    predicts is not under test here): test_slides' own."""
    from ats_cli.checkpoint import save_checkpoint
    from ats_cli.config import TrainConfig
    from ats_cli.models import create_model, model_spec

    torch.manual_seed(0)
    spec = model_spec(TrainConfig(patch_size=32, scale=0.1, n_patches=6, feature_width=8), n_classes=2, channels=3)
    save_checkpoint(tmp_path / "m.pt", spec=spec, classes=["normal", "tumour"], model=create_model(spec))
    return tmp_path / "m.pt"


def test_the_view_cache_names_a_store_by_its_files_so_a_rewritten_chunk_is_a_new_entry(tmp_path):
    path = tmp_path / "s.ome.zarr"
    write_ome_zarr(path, _image(), n_levels=2, version="0.5")
    cache = ViewCache(tmp_path / "views")
    slide = open_image(path)
    first = cache.key(slide, 0.1)
    assert cache.key(open_image(path), 0.1) == first
    chunk = sorted(p for p in (path / "1").rglob("*") if p.is_file() and p.name != "zarr.json")[0]
    data = chunk.read_bytes()
    chunk.write_bytes(data)  # same bytes rewritten in place: its times change, the store's directory's do not
    assert cache.key(open_image(path), 0.1) != first


def _synthetic_stores(root: Path) -> None:
    """The synthetic slides of ats_cli.data.synthetic_slides (512 px, the TIFF tests'
    kind) written as OME-Zarr stores, two levels (1, 1/4), 0.5 µm/px, with their CSVs."""
    from ats_cli.data.dataset import write_dataset
    from ats_cli.data.synthetic_slides import SyntheticSlidesConfig, render_slide

    config = SyntheticSlidesConfig(n_train=4, n_test=2, size=512, n_spots=3, max_targets=1, spot_radius=16)
    splits = {}
    for split, n in (("train", config.n_train), ("test", config.n_test)):
        rows = []
        for i in range(n):
            image, layout = render_slide(config, split, i)
            name = f"{split}/{i:04d}.ome.zarr"
            levels = write_ome_zarr(root / name, image, n_levels=1, mpp=0.5, version="0.5" if i % 2 else "0.4",
                                    chunks=128)
            del levels
            group = zarr.open_group(str(root / name), mode="r+")
            small = image[::4, ::4]  # level 1 at 1/4 (as the synthetic TIFFs have it)
            z = group.create_array("1", shape=(3, *small.shape[:2]), chunks=(3, 128, 128), dtype="uint8")
            z[...] = np.moveaxis(small, 2, 0)
            _add_level(root / name, "1", 2.0)
            rows.append({"path": name, "label": ["normal", "tumor"][layout.label]})
        splits[split] = rows
    write_dataset(root, ["normal", "tumor"], splits, hints={"channels": 3})


def _add_level(store: Path, sub: str, mpp: float) -> None:
    """Name the array ``sub`` as the next dataset of the store's multiscales, at ``mpp``."""
    v3 = (store / "zarr.json").is_file()
    doc = json.loads((store / ("zarr.json" if v3 else ".zattrs")).read_text())
    ms = (doc["attributes"]["ome"] if v3 else doc)["multiscales"][0]
    ms["datasets"].append({"path": sub, "coordinateTransformations": [{"type": "scale", "scale": [1, mpp, mpp]}]})
    (store / ("zarr.json" if v3 else ".zattrs")).write_text(json.dumps(doc))


def test_train_predict_visualize_on_ome_zarr_stores_end_to_end(tmp_path):
    """A dataset whose CSVs list OME-Zarr stores trains (in DataLoader workers, readers
    reopened in the training process), records the stores' own microns per pixel, and
    predicts and draws (PNG and GeoJSON) from them, reading from the store's metadata what
    the TIFF tests read from their tags."""
    data = tmp_path / "data"
    _synthetic_stores(data)
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(data), "--out", str(run), "--workers", "2", "--epochs", "1",
                                 "--batch-size", "2", "--scale", "0.0625", "--patch-size", "32", "--n-patches", "4",
                                 "--feature-net", "small-cnn", "--set", "feature_width=8", "--set", "attention_width=4",
                                 "--set", "tissue_mask='on'"])
    assert result.exit_code == 0, result.output
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["samples"] == 4
    spec = torch.load(run / "best.pt", weights_only=True)["spec"]
    assert spec["input"]["mpp"] == 0.5  # the stores' scale, from their coordinateTransformations
    assert any((run / "cache" / "views").iterdir())  # the stores' views were cached

    out = tmp_path / "preds.csv"
    result = runner.invoke(app, ["predict", str(data / "test.csv"), "--model", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    header, *rows = [line.split(",") for line in out.read_text().splitlines()]
    assert header == ["path", "prediction", "prob_normal", "prob_tumor", "label"]
    assert sorted(Path(r[0]).name for r in rows) == ["0000.ome.zarr", "0001.ome.zarr"]
    for _, prediction, p_normal, p_tumor, _ in rows:
        assert prediction in ("normal", "tumor") and float(p_normal) + float(p_tumor) == pytest.approx(1, abs=1e-5)

    # a folder of stores: each store is one input (its chunks are not)
    result = runner.invoke(app, ["predict", str(data / "test"), "--model", str(run), "--out",
                                 str(tmp_path / "dir.csv")])
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "dir.csv").read_text().splitlines()) == 3

    store = data / "test" / "0001.ome.zarr"
    for name in ("att.png", "att.geojson"):
        result = runner.invoke(app, ["visualize", str(store), "--model", str(run), "--out", str(tmp_path / name),
                                     "--mpp", "2.0"])
        assert result.exit_code == 0, result.output
    geo = json.loads((tmp_path / "att.geojson").read_text())
    assert geo["type"] == "FeatureCollection" and geo["features"]


def test_make_dataset_from_a_folder_of_stores(tmp_path):
    src = tmp_path / "src"
    for label, seed in (("a", 0), ("a", 1), ("b", 2), ("b", 3)):
        write_ome_zarr(src / label / f"s{seed}.ome.zarr", _image(seed, 128, 128), version="0.5")
    for mode in ("reference", "copy"):
        out = tmp_path / f"out-{mode}"
        result = runner.invoke(app, ["make-dataset", "from-folder", str(src), str(out), "--test", "0.5",
                                     "--mode", mode])
        assert result.exit_code == 0, result.output
        rows = [line.split(",") for line in (out / "train.csv").read_text().splitlines()[1:]]
        rows += [line.split(",") for line in (out / "test.csv").read_text().splitlines()[1:]]
        assert sorted(Path(p).name for p, _ in rows) == ["s0.ome.zarr", "s1.ome.zarr", "s2.ome.zarr", "s3.ome.zarr"]
        assert json.loads((out / "dataset.json").read_text())["hints"] == {"channels": 3}
        for p, _ in rows:
            store = out / p if mode == "copy" else Path(p)
            assert open_image(store).read_region(0, 0, 8, 8, 0).shape == (8, 8, 3)
    assert not [p for p in (tmp_path / "out-copy").rglob(".*.tmp")]  # copied whole, nothing left beside
    opened = open_input(src / "b" / "s2.ome.zarr", channels=3, scale=0.25, patch_size=(16, 16))
    assert opened.source.size == (128, 128) and opened.low.shape == (3, 32, 32)
