"""Virtual slides (ats_cli/data/virtual_slides.py): read like slides, tile-invariant, and the
same pixels as the pyramidal TIFF written from them (through tifffile and OpenSlide)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ats_cli.data.slides import SlideReadError, TiffReader, VirtualSlideReader, open_image
from ats_cli.data.virtual_slides import (
    VirtualSlideError,
    VirtualSlideSpec,
    default_downsamples,
    write_spec,
    write_virtual_tiff,
)


def _spec(tmp_path, name="s.vslide.json", **kw):
    args = dict(width=2048, height=1536, seed=11, nests=2, decoys=4, downsamples=(1, 2, 4, 8, 16))
    args.update(kw)
    path = tmp_path / name
    write_spec(path, VirtualSlideSpec(**args))
    return path


def test_opens_like_a_slide_by_its_suffix(tmp_path):
    with open_image(_spec(tmp_path)) as slide:
        assert isinstance(slide, VirtualSlideReader)
        assert slide.levels == [(1536, 2048), (768, 1024), (384, 512), (192, 256), (96, 128)]
        assert slide.downsamples == [1.0, 2.0, 4.0, 8.0, 16.0]
        assert slide.mpp == (0.5, 0.5)
        assert slide.slide.label == 1 and sum(s.nest for s in slide.slide.spots) == 2
        view = slide.low_res_view(1 / 16)
        assert tuple(view.shape) == (3, 96, 128)


def test_a_pixel_does_not_depend_on_the_region_read(tmp_path):
    """Overlapping, shifted and split reads agree bit for bit, at every level, on spots too."""
    slide = open_image(_spec(tmp_path))
    rng = np.random.default_rng(0)
    for level in range(len(slide.levels)):
        spot = slide.slide.spots[level % len(slide.slide.spots)]
        d = slide.downsamples[level]
        r0, c0 = int(spot.row / d) - 20, int(spot.col / d) - 20  # a read over a nest or decoy
        whole = slide.read_region(r0, c0, 70, 90, level)
        for _ in range(4):
            dr, dc = (int(v) for v in rng.integers(0, 40, 2))
            h, w = (int(v) for v in rng.integers(5, 30, 2))
            part = slide.read_region(r0 + dr, c0 + dc, h, w, level)
            assert np.array_equal(part, whole[dr:dr + h, dc:dc + w]), (level, dr, dc, h, w)
        left, right = slide.read_region(r0, c0, 70, 33, level), slide.read_region(r0, c0 + 33, 70, 57, level)
        assert np.array_equal(np.concatenate([left, right], 1), whole)
    assert not np.array_equal(slide.read_region(0, 0, 64, 64, 0), slide.read_region(0, 64, 64, 64, 0))


def test_spots_look_alike_at_low_resolution_and_differ_at_full(tmp_path):
    slide = open_image(_spec(tmp_path, nests=3, decoys=3))
    bare = open_image(_spec(tmp_path, "bare.vslide.json", nests=0, decoys=0))  # the same slide, no spots
    nests = [s for s in slide.slide.spots if s.nest]
    decoys = [s for s in slide.slide.spots if not s.nest]

    def patch(s, level, r=28, reader=slide):  # a window of 2r level-0 pixels around the spot
        d = int(slide.downsamples[level])
        return reader.read_region(int(s.row - r) // d, int(s.col - r) // d, 2 * r // d, 2 * r // d,
                                  level).astype(float)

    def ink(s, level):  # what the spot darkens, summed over its window, in level-0 pixel units
        d = slide.downsamples[level]
        return (patch(s, level, 64, bare) - patch(s, level, 64)).sum() * d * d

    dark = [(patch(s, 0).mean(-1) < 120).mean() for s in nests + decoys]
    assert max(dark) - min(dark) < 0.25  # the same share of dark nuclei
    full = [np.abs(patch(n, 0) - patch(k, 0)).mean() for n in nests for k in decoys]
    assert min(full) > 20
    for level in (2, 3, 4):  # nests drawn or as their mean, decoys as their mean: alike on average
        a, b = np.mean([ink(s, level) for s in nests]), np.mean([ink(s, level) for s in decoys])
        assert max(a, b) < 1.3 * min(a, b), (level, a, b)


def _against_box(vs, spot, d, side=128, inset=4):
    """(mean |box - render|, std inside the disc of the box-filtered level 0, of the level's
    render) over the spot's disc, ``inset`` level-0 pixels in from its edge."""
    y0, x0 = int(spot.row) // d * d - side // 2, int(spot.col) // d * d - side // 2
    box = vs.render(y0, x0, side, side, 1, 0).astype(float).reshape(side // d, d, side // d, d, 3).mean((1, 3))
    low = vs.render(y0 // d, x0 // d, side // d, side // d, d, 1).astype(float)
    yy, xx = np.mgrid[0:side // d, 0:side // d]
    inside = ((yy + 0.5) * d + y0 - spot.row) ** 2 + ((xx + 0.5) * d + x0 - spot.col) ** 2 \
        <= (vs.spec.spot_radius - inset) ** 2
    return np.abs(box - low)[inside].mean(), box[inside].std(0).mean(), low[inside].std(0).mean()


def test_a_level_is_its_level_0_box_filtered_spots_and_texture_too(monkeypatch):
    """What a real pyramid shows at 1/2..1/8, the virtual level shows: a spot's colour and,
    where the box-filtered level 0 still has it, its nuclei's texture (a nest's 12-pixel grid
    is 1.5 pixels at 1/8). Control: drawing a family as its mean below two pixels (the old
    rule) leaves a nest at 1/8 a flat disc, and the check fails."""
    from ats_cli.data import virtual_slides as vsm

    vs = vsm.VirtualSlide(VirtualSlideSpec(width=2048, height=1536, seed=11, nests=3, decoys=3,
                                           downsamples=(1, 2, 4, 8, 16)))

    def faithful(d):
        for spot in vs.spots:
            err, std_box, std_low = _against_box(vs, spot, d)
            if err > 8 or (std_box > 10 and not 0.7 < std_low / std_box < 1.3):
                return False
        return True

    assert all(faithful(d) for d in (2, 4, 8))
    monkeypatch.setattr(vsm, "MEAN_BELOW", 2.0)
    assert faithful(4) is False or faithful(8) is False


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.8, 1.5, 4.0])
def test_a_disc_covers_its_area_at_every_level(ratio):
    """A disc of radius r drawn at downsample d covers pi (r/d)^2 pixels in all, as a box
    filter keeps it, whether it is narrower or wider than a pixel (the ramp alone covers
    pi ((R/d)^2 + 1/12): a third too much for a disc one pixel wide)."""
    from ats_cli.data.virtual_slides import _discs

    d, areas = 8, []
    rng = np.random.default_rng(3)
    for _ in range(40):
        cover = np.ones((40, 40), np.float32)
        cy, cx = rng.uniform(120, 200, 2)
        _discs(cover, [cy], [cx], [ratio * d], ratio * d, 0, 0, d)
        areas.append(float((1 - cover).sum()))
    # one disc's sum depends on where its centre falls in the pixel; their mean is the integral
    assert np.mean(areas) == pytest.approx(np.pi * ratio ** 2, rel=0.03), (ratio, np.mean(areas))
    assert np.allclose(areas, np.pi * ratio ** 2, rtol=0.15), (ratio, min(areas), max(areas))


@pytest.mark.parametrize("reader", ["tifffile", "openslide"])
def test_the_written_tiff_has_the_virtual_pixels(tmp_path, reader):
    """Every level, whole and at random regions, through both TIFF readers."""
    spec = _spec(tmp_path, width=1024, height=768, downsamples=(1, 2, 4, 16))
    tif = tmp_path / "s.tif"
    write_virtual_tiff(spec, tif, tile=128)
    virtual = open_image(spec)
    with open_image(tif, reader=reader) as real:
        if reader == "tifffile":
            assert isinstance(real, TiffReader)
        assert real.levels == virtual.levels
        assert real.mpp == pytest.approx(virtual.mpp, rel=1e-6)
        rng = np.random.default_rng(1)
        for level, (H, W) in enumerate(virtual.levels):
            assert np.array_equal(real.read_region(0, 0, H, W, level), virtual.read_region(0, 0, H, W, level))
            for _ in range(5):
                h, w = (int(v) for v in rng.integers(1, min(H, W) // 2, 2))
                r, c = int(rng.integers(0, H - h)), int(rng.integers(0, W - w))
                assert np.array_equal(real.read_region(r, c, h, w, level), virtual.read_region(r, c, h, w, level))
        assert np.array_equal(real.thumbnail(200), virtual.thumbnail(200))


def test_huge_slides_cost_their_reads_only(tmp_path):
    """A 10^6 x 10^6 spec opens and reads patches and its smallest level at once."""
    spec = _spec(tmp_path, width=1_000_000, height=1_000_000, decoys=50, nests=1,
                 downsamples=tuple(default_downsamples(1_000_000, 1_000_000)))
    slide = open_image(spec)
    assert slide.levels[-1] == (1_000_000 // 2**11,) * 2
    patch = slide.read_region(500_000, 700_000, 256, 256, 0)
    assert patch.shape == (256, 256, 3) and patch.std() > 0
    assert slide.thumbnail(400).shape == (400, 400, 3)
    assert len(slide.slide.spots) == 51


@pytest.mark.parametrize("change, words", [
    ({"width": 10**9}, "width must be an integer in 512..10,000,000"),
    ({"decoys": 10**6}, "decoys must be an integer"),
    ({"downsamples": [2, 4]}, "downsamples must start at 1"),
    ({"downsamples": [1, 4, 2]}, "downsamples must start at 1 and increase"),
    ({"spot_radius": 1000}, "spot_radius"),
    ({"decoys": 400}, "nests + decoys (402) must be at most one per 100 spot_radius²"),
    ({"format": "x"}, "format must be"),
    ({"stain": [1]}, "stain must be"),
])
def test_absurd_specs_are_one_line_naming_the_file(tmp_path, change, words):
    path = _spec(tmp_path)
    record = json.loads(path.read_text())
    record.update(change)
    path.write_text(json.dumps(record))
    with pytest.raises(VirtualSlideError) as err:
        open_image(path)
    message = str(err.value)
    assert str(path) in message and words in message and "\n" not in message


def test_not_json_is_one_line(tmp_path):
    path = tmp_path / "x.vslide.json"
    path.write_text("{nope")
    with pytest.raises(VirtualSlideError, match="not a readable virtual slide spec"):
        open_image(path)


def test_a_region_past_the_budget_is_refused(tmp_path):
    slide = open_image(_spec(tmp_path), max_pixels=100_000)
    with pytest.raises(SlideReadError, match="region of level 0"):
        slide.read_region(0, 0, 1000, 1000, 0)


def test_reader_pickles_as_reopen(tmp_path):
    import pickle

    slide = open_image(_spec(tmp_path))
    slide.set_level(1)
    again = pickle.loads(pickle.dumps(slide))
    assert again.level == 1 and np.array_equal(again.read_region(5, 5, 20, 20, 1), slide.read_region(5, 5, 20, 20, 1))


def test_make_dataset_virtual_then_predict_train_and_visualize(tmp_path):
    """`make-dataset synthetic-slides --virtual` at 100k: specs at once; rows whose boxes are
    nests; the commands read the specs like slides (a tiny one for predict/train/visualize)."""
    import csv
    import time
    from pathlib import Path

    from typer.testing import CliRunner

    from ats_cli.cli import app

    runner = CliRunner()
    big = tmp_path / "big"
    start = time.perf_counter()
    result = runner.invoke(app, ["make-dataset", "synthetic-slides", str(big), "--size", "100000", "--virtual",
                                 "--n-train", "4", "--n-test", "2", "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert time.perf_counter() - start < 6 * 1.0  # well under a second a slide
    rows = list(csv.DictReader(open(big / "train.csv")))
    assert [r["label"] for r in rows] == ["normal", "tumor"] * 2
    for r in rows:
        slide = open_image(big / r["path"])
        assert slide.dimensions == (100_000, 100_000) and slide.level_mpps[5] == 16.0
        boxes = json.loads(r["boxes"])
        assert len(boxes) == sum(s.nest for s in slide.slide.spots) and (len(boxes) > 0) == (r["label"] == "tumor")
        for _, row, col, h, w in boxes:  # a nest: dark nuclei at full resolution there
            assert (slide.read_region(row, col, h, w, 0).mean(-1) < 120).mean() > 0.2
    again = runner.invoke(app, ["make-dataset", "synthetic-slides", str(big), "--size", "100000", "--virtual",
                                "--n-train", "4", "--n-test", "2", "--workers", "1"])
    assert again.exit_code == 0 and "wrote 0 images, skipped 6" in again.output

    small = tmp_path / "small"
    assert runner.invoke(app, ["make-dataset", "synthetic-slides", str(small), "--size", "1024", "--virtual",
                               "--n-train", "4", "--n-test", "2", "--spot-radius", "20"]).exit_code == 0
    model = Path(__file__).resolve().parents[1] / "models" / "synthetic-slides-ats.pt"
    pred = runner.invoke(app, ["predict", str(small / "test.csv"), "--model", str(model), "--out",
                               str(tmp_path / "p.csv")])
    assert pred.exit_code == 0, pred.output
    assert len(list(csv.DictReader(open(tmp_path / "p.csv")))) == 2
    train = runner.invoke(app, ["train", str(small), "--out", str(tmp_path / "run"), "--epochs", "1", "--workers",
                                "0", "--device", "cpu", "--n-patches", "2", "--batch-size", "2"])
    assert train.exit_code == 0, train.output
    vis = runner.invoke(app, ["visualize", str(small / "test" / "0001.vslide.json"), "--model", str(model),
                              "--out", str(tmp_path / "v.png")])
    assert vis.exit_code == 0 and (tmp_path / "v.png").stat().st_size > 0, vis.output


def test_folder_scans_take_specs_for_slides_and_no_other_json(tmp_path):
    from ats_cli.data.dataset import is_input_file
    from ats_cli.data.folder import dataset_from_folder

    for c in ("normal", "tumor"):
        (tmp_path / "src" / c).mkdir(parents=True)
        for i in range(3):
            _spec(tmp_path / "src" / c, f"{i}.vslide.json", nests=int(c == "tumor"), seed=i)
        (tmp_path / "src" / c / "notes.json").write_text("{}")
    assert is_input_file(tmp_path / "src" / "tumor" / "0.vslide.json")
    assert not is_input_file(tmp_path / "src" / "tumor" / "notes.json")
    dataset_from_folder(tmp_path / "src", tmp_path / "ds", test_fraction=1 / 3)
    rows = (tmp_path / "ds" / "train.csv").read_text() + (tmp_path / "ds" / "test.csv").read_text()
    assert rows.count(".vslide.json") == 6 and "notes.json" not in rows


def test_a_read_rendered_in_bands_equals_one_rendered_whole(tmp_path, monkeypatch):
    slide = open_image(_spec(tmp_path))
    whole = slide.read_region(100, 200, 300, 500, 0)
    monkeypatch.setattr(VirtualSlideReader, "BAND_PIXELS", 500 * 7)  # 7 rows at a time
    assert np.array_equal(slide.read_region(100, 200, 300, 500, 0), whole)
    view = slide.low_res_view(1 / 8)
    monkeypatch.undo()
    assert np.array_equal(slide.low_res_view(1 / 8).numpy(), view.numpy())


def test_make_dataset_virtual_tiff_writes_the_same_slides_as_files(tmp_path):
    import csv

    from typer.testing import CliRunner

    from ats_cli.cli import app

    runner = CliRunner()
    common = ["--size", "1024", "--n-train", "2", "--n-test", "2", "--spot-radius", "20", "--workers", "1"]
    make = ["make-dataset", "synthetic-slides"]
    assert runner.invoke(app, [*make, str(tmp_path / "v"), "--virtual", *common]).exit_code == 0
    result = runner.invoke(app, [*make, str(tmp_path / "t"), "--virtual", "--tiff", *common])
    assert result.exit_code == 0, result.output
    virtual = list(csv.DictReader(open(tmp_path / "v" / "test.csv")))
    files = list(csv.DictReader(open(tmp_path / "t" / "test.csv")))
    assert [r["path"].replace(".vslide.json", ".tif") for r in virtual] == [r["path"] for r in files]
    assert [(r["label"], r["boxes"]) for r in virtual] == [(r["label"], r["boxes"]) for r in files]
    for v, f in zip(virtual, files, strict=True):
        a, b = open_image(tmp_path / "v" / v["path"]), open_image(tmp_path / "t" / f["path"])
        assert np.array_equal(a.read_region(300, 200, 400, 500, 0), b.read_region(300, 200, 400, 500, 0))
    bad = runner.invoke(app, ["make-dataset", "synthetic-slides", str(tmp_path / "x"), "--tiff", *common])
    assert bad.exit_code == 1 and "give --virtual too" in bad.output
