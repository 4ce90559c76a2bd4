"""Everyday TIFFs (issue 66): resolution tags that a tool wrote without measuring anything
(libvips' 72 dpi, Pillow's or a print's 300 dpi) are no scale. Such a file reads as "scale
unknown", said in one line by ats info, predict and visualize, and is read as it is, with
--mpp or without; a microscope's scale (40,000 px/cm = 0.25 µm/px, OME, Aperio) is kept.

Files are written as libvips writes them (72 dpi stored as 28.34 pixels per centimetre,
each level its own IFD, which OpenSlide reads too), by tifffile (per inch) and by Pillow;
with libvips itself when ``vips`` is installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tifffile
from PIL import Image
from typer.testing import CliRunner

from ats_cli.cli import app
from ats_cli.data.slides import open_image
from ats_cli.data.synthetic_slides import SyntheticSlidesConfig, render_slide, write_pyramid
from ats_cli.data.tiff_meta import not_a_microscope_scale
from tests.test_mpp import make_model

runner = CliRunner(env={"COLUMNS": "1000"})
VIPS = shutil.which("vips")
needs_vips = pytest.mark.skipif(VIPS is None, reason="libvips' vips command is not installed")
VIPS_72_DPI = 28.34  # pixels per centimetre: what libvips 8.x stores for its default 72 dpi


def _openslide_present() -> bool:
    try:
        import openslide  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


READERS = ["tifffile"] + (["openslide"] if _openslide_present() else [])


@pytest.fixture(scope="module")
def tissue() -> np.ndarray:
    return render_slide(SyntheticSlidesConfig(size=1024, n_spots=4, max_targets=2, spot_radius=20), "test", 1)[0]


@pytest.fixture(scope="module")
def files(tissue, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tiffs")
    paths = {name: out / f"{name}.tif" for name in ("vips72", "inch72", "inch96", "pillow300", "far", "x40",
                                                      "inch_scope")}
    write_pyramid(paths["vips72"], tissue, mpp=1e4 / VIPS_72_DPI)  # libvips' tags, a level per IFD
    for name, dpi in (("inch72", 72), ("inch96", 96)):
        tifffile.imwrite(paths[name], tissue, tile=(256, 256), photometric="rgb", metadata=None,
                         resolution=(dpi, dpi), resolutionunit="INCH")
    Image.fromarray(tissue).save(paths["pillow300"], dpi=(300, 300))
    tifffile.imwrite(paths["far"], tissue, tile=(256, 256), photometric="rgb", metadata=None,
                     resolution=(0.5, 0.5), resolutionunit="CENTIMETER")  # 20 mm a pixel
    write_pyramid(paths["x40"], tissue, mpp=0.25)  # a scanner's 40,000 px/cm
    tifffile.imwrite(paths["inch_scope"], tissue, tile=(256, 256), photometric="rgb", metadata=None,
                     resolution=(101_600, 101_600), resolutionunit="INCH")  # 0.25 µm/px, per inch
    if VIPS:
        png = out / "tissue.png"
        Image.fromarray(tissue).save(png)
        paths["libvips72"] = out / "libvips72.tif"
        paths["libvips_2000"] = out / "libvips_2000.tif"
        base = [VIPS, "tiffsave", str(png)]
        subprocess.run([*base, str(paths["libvips72"]), "--tile", "--pyramid", "--compression", "jpeg"], check=True)
        subprocess.run([*base, str(paths["libvips_2000"]), "--tile", "--pyramid", "--compression", "jpeg",
                        "--xres", "2000", "--yres", "2000"], check=True)  # 2000 px/mm: 0.5 µm/px
    return paths


@pytest.mark.parametrize(("per_inch", "mpp", "unknown"), [
    (72, 352.8, True), (VIPS_72_DPI * 2.54, 352.9, True), (96, 264.6, True), (300, 84.67, True), (600, 42.33, True),
    (2.54 * 0.5, 2e4, True),  # 0.5 px/cm: no density a tool writes, but no microscope's either
    (101_600, 0.25, False), (50_800, 0.5, False), (127_000, 0.2, False),  # scanners' 40x, 20x
    (None, 0.25, False), (None, 352.8, True),  # OME-XML or a vendor's property: the range alone
])
def test_a_tools_density_or_an_implausible_size_is_no_microscope_scale(per_inch, mpp, unknown):
    why = not_a_microscope_scale((mpp, mpp), "the tags", per_inch)
    assert bool(why) is unknown, why
    if unknown:
        assert why.startswith("the tags") and ("dpi" in why or "pixels per inch" in why or "plausible" in why)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize(("name", "said"), [
    ("vips72", "28.34 pixels per centimetre (72 dpi), are a screen or print density"),
    ("inch72", "72 pixels per inch, are a screen or print density"),
    ("inch96", "96 pixels per inch, are a screen or print density"),
    ("pillow300", "300 pixels per inch, are a screen or print density"),
    ("far", "0.5 pixels per centimetre: 2e+04 µm/px, outside the plausible"),
    pytest.param("libvips72", "(72 dpi), are a screen or print density", marks=needs_vips),
])
def test_files_whose_tags_are_no_scale_read_as_scale_unknown(files, name, said, reader):
    if reader == "openslide" and name in ("pillow300", "inch72", "inch96", "far"):
        pytest.skip("OpenSlide reads per-centimetre tags of tiled pyramids only")  # it records no mpp for them
    with open_image(files[name], reader=reader) as slide:
        assert slide.mpp is None and slide.level_mpps is None
        assert said in slide.scale_unknown


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize(("name", "mpp"), [("x40", 0.25), ("inch_scope", 0.25),
                                           pytest.param("libvips_2000", 0.5, marks=needs_vips)])
def test_a_microscopes_scale_is_kept(files, name, mpp, reader):
    if reader == "openslide" and name == "inch_scope":
        pytest.skip("OpenSlide records no mpp for per-inch tags")
    with open_image(files[name], reader=reader) as slide:
        assert slide.mpp == pytest.approx((mpp, mpp), rel=1e-3) and slide.scale_unknown == ""


def test_ome_and_aperio_sizes_are_kept_and_an_absurd_one_is_unknown(tissue, tmp_path):
    for size, kept in ((0.2527, True), (350.0, False)):
        ome = tmp_path / f"ome{size}.ome.tif"
        tifffile.imwrite(ome, tissue, tile=(256, 256), photometric="rgb",
                         metadata={"axes": "YXS", "PhysicalSizeX": size, "PhysicalSizeY": size})
        svs = tmp_path / f"aperio{size}.tif"
        tifffile.imwrite(svs, tissue, tile=(256, 256), photometric="rgb", metadata=None,
                         description=f"Aperio Image Library v12.0.15\r\n1024x1024 |AppMag = 40|MPP = {size}")
        for path in (ome, svs):
            with open_image(path, reader="tifffile") as slide:
                if kept:
                    assert slide.mpp == pytest.approx((size, size)) and not slide.scale_unknown, path
                else:
                    assert slide.mpp is None and "outside the plausible" in slide.scale_unknown, path


def _one_line(text: str, path: Path) -> list[str]:
    return [line for line in text.splitlines() if "scale unknown" in line and path.name in line]


@pytest.mark.parametrize("name", ["vips72", pytest.param("libvips72", marks=needs_vips)])
def test_ats_info_says_scale_unknown_in_one_line(files, name):
    result = runner.invoke(app, ["info", str(files[name])])
    assert result.exit_code == 0, result.output
    line = [line for line in result.output.splitlines() if "mpp:" in line]
    assert len(line) == 1 and "mpp: scale unknown, read as it is: the TIFF resolution tags" in line[0], result.output
    # no 352.8 µm/px (25,400 / 72) stated as the scale; a bare "352" is also in pytest's tmp paths
    assert "72 dpi" in line[0] and not re.search(r"352\.\d", result.output), result.output


@pytest.mark.parametrize("name", ["vips72", pytest.param("libvips72", marks=needs_vips)])
def test_predict_and_visualize_read_a_72_dpi_pyramid_with_or_without_mpp(files, name, tmp_path):
    model = make_model(tmp_path / "model.pt")  # a 0.5 µm/px model
    path = files[name]
    for k, extra in enumerate(([], ["--mpp", "0.5"])):
        csv = tmp_path / f"p{k}.csv"
        result = runner.invoke(app, ["predict", str(path), "--model", str(model), "--out", str(csv), *extra])
        assert result.exit_code == 0, result.output
        said = _one_line(result.stderr, path)
        assert len(said) == 1 and "level 0 read as it is for 0.5 µm/px, its scale unknown" in said[0], result.output
        assert len(csv.read_text().splitlines()) == 2
        out = tmp_path / f"v{k}.geojson"
        result = runner.invoke(app, ["visualize", str(path), "--model", str(model), "--out", str(out), *extra])
        assert result.exit_code == 0, result.output
        assert len(_one_line(result.stderr, path)) == 1 and out.stat().st_size > 0


def _tiff_dataset(root: Path, files: dict[str, Path], names: tuple[str, ...]) -> Path:
    """A dataset of two classes over the TIFFs ``names`` (absolute paths), the first two training."""
    from ats_cli.data.dataset import write_dataset

    rows = [{"path": str(files[name]), "label": "ab"[i % 2]} for i, name in enumerate(names)]
    write_dataset(root, ["a", "b"], {"train": rows[:2], "test": rows[2:]}, hints={"channels": 3})
    return root


def test_ats_train_says_once_that_the_tiffs_scale_is_unknown(files, tmp_path):
    """Issue 66's leftover: training on TIFFs whose tags are no scale (72 and 96 dpi) reads
    them as pixels and says so in one line of the settle log, as ats info says it; a
    scanner's scale (negative control) is taken as the model's, with no such line."""
    data = _tiff_dataset(tmp_path / "dpi", files, ("inch72", "inch96", "pillow300"))
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(data), "--out", str(run), "--epochs", "1", "--n-patches", "2",
                                 "--patch-size", "32", "--scale", "0.05", "--feature-net", "small-cnn",
                                 "--set", "feature_width=4", "--set", "attention_width=4", "--workers", "0"])
    assert result.exit_code == 0, result.output
    said = [line for line in result.output.splitlines() if "scale unknown" in line]
    assert len(said) == 1, result.output
    assert said[0].strip().startswith("mpp none: scale unknown: "), said[0]
    assert "inch72.tif: the TIFF resolution tags, 72 pixels per inch, are a screen or print density" in said[0]
    assert "read as pixels (2 of 2 training files record no scale)" in said[0], said[0]
    assert json.loads((run / "settled.json").read_text())["mpp"] is None

    from ats_cli.config import TrainConfig, settle_data
    from ats_cli.data.dataset import load_dataset

    scanned = load_dataset(_tiff_dataset(tmp_path / "x40", files, ("x40", "inch_scope", "far")))
    settled, reasons = settle_data(TrainConfig(patch_size=32, scale=0.05), scanned)
    assert settled.mpp == pytest.approx(0.25) and not [r for r in reasons if "scale unknown" in str(r)]
    # tags without a unit (ResolutionUnit NONE) record no size at all: said once, read as pixels too
    for i in range(3):
        tifffile.imwrite(tmp_path / f"n{i}.tif", np.full((64, 64, 3), 200, np.uint8), photometric="rgb",
                         metadata=None, resolution=(1, 1), resolutionunit="NONE")
    unit = {f"n{i}": tmp_path / f"n{i}.tif" for i in range(3)}
    settled, reasons = settle_data(TrainConfig(patch_size=16, scale=0.25), load_dataset(
        _tiff_dataset(tmp_path / "nounit", unit, ("n0", "n1", "n2"))))
    said = [str(r) for r in reasons if r.key == "mpp"]
    assert said == ["mpp none: the training slides and TIFFs record no microns per pixel; read as pixels (2 of 2 "
                    "training files record no scale); predict reads slides by level"] and settled.mpp is None
