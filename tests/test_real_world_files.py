"""Slides as the tools labs use write them, read lazily with the right levels and mpp, or
refused by name (issue 23).

The committed files in tests/data/real-world/ come from libvips and OpenJPEG
(tools/make_real_world_fixtures.py, which CI does not run); formats whose writer is
tifffile anyway (OME-TIFF with SubIFDs, JPEG 2000 SVS, BigTIFF, 16-bit and multi-channel
images) are written here. Pixels are compared with the source image the tool recomputes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tifffile
from typer.testing import CliRunner

from ats_cli.cli import app
from ats_cli.data.slides import SlideReadError, open_image
from tools import make_real_world_fixtures as fixtures

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "real-world"
source_image, block_mean = fixtures.source_image, fixtures.block_mean

JPEG_TOLERANCE = 6.0  # mean |difference| per level (JPEG Q75 on fine stripes); a tile out of place is far above
SMALL = fixtures.SMALL


def _mean_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - want).mean())


def _check_levels_against_source(slide, source: np.ndarray, factor: int, tolerance: float = JPEG_TOLERANCE):
    """Each level, read whole and as a region straddling tile edges, matches the source
    reduced by ``factor`` per level (block means, as the writers made the levels)."""
    for level, (h, w) in enumerate(slide.levels):
        want = block_mean(source, factor**level)
        assert want.shape[:2] == (h, w), (level, want.shape)
        assert _mean_error(slide.read_region(0, 0, h, w, level), want) < tolerance, level
        r, c = h // 3, w // 4  # a region over tile boundaries, and one past the corner (zeros)
        assert _mean_error(slide.read_region(r, c, h // 2, w // 2, level), want[r : r + h // 2, c : c + w // 2]) \
            < tolerance
        corner = slide.read_region(h - 5, w - 7, 10, 10, level)
        assert _mean_error(corner[:5, :7], want[h - 5 :, w - 7 :]) < 3 * tolerance and not corner[5:].any()


def _check_lazy_low_res(path, source: np.ndarray, reader: str = "auto"):
    """With a pixel budget too small for level 0, the low-res view still comes (from a
    small level) and shows the image."""
    h0, w0 = source.shape[:2]
    with open_image(path, reader=reader, max_pixels=h0 * w0 - 1) as slide:
        with pytest.raises(SlideReadError, match="over the limit"):
            slide.low_res((h0, w0))
        view = slide.low_res_view(0.2)
        assert view.shape[1:] == (round(h0 * 0.2), round(w0 * 0.2))
        want = source.reshape(-1, 3).mean(0) / 255
        assert np.abs(view.mean((1, 2)).numpy() - want).max() < 0.02


def _info(*paths) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["info", *map(str, paths)])
    return result.exit_code, result.output


# -- files written by libvips and OpenJPEG (committed) ---------------------------------------------------------------

COMMITTED = {
    # name: (source (H, W), level sizes, mpp (y, x), reduction per level, reader auto picks, vendor)
    "vips-jpeg-pyramid.tif": (fixtures.MAIN, [(601, 1001), (300, 500), (150, 250)], (0.25, 0.25), 2,
                              "tifffile", "generic-tiff"),
    "vips-bigtiff.tif": (SMALL, [(301, 501), (150, 250)], (0.499, 0.499), 2, "tifffile", "generic-tiff"),
    "vips-subifd.tif": (SMALL, [(301, 501), (150, 250)], (0.5, 0.5), 2, "tifffile", "generic-tiff"),
    "vips-nonsquare.tif": (SMALL, [(301, 501), (150, 250)], (0.25, 0.5), 2, "tifffile", "generic-tiff"),
    "aperio-jp2k-33003.svs": (SMALL, [(301, 501), (75, 125)], (0.499, 0.499), 4, "openslide", "aperio"),
}


def test_committed_fixtures_are_small_and_all_tested():
    files = {p.name for p in DATA.iterdir() if p.suffix in (".tif", ".svs")}
    assert files == set(COMMITTED)
    assert all((DATA / name).stat().st_size < 200_000 for name in files)


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_real_world_file_levels_mpp_and_pixels(name):
    size, levels, mpp, factor, reader, vendor = COMMITTED[name]
    source = source_image(*size)
    with open_image(DATA / name) as slide:
        assert (slide.name, slide.vendor, slide.channels) == (reader, vendor, 3)
        assert slide.levels == levels
        h0, w0 = levels[0]
        np.testing.assert_allclose(slide.downsamples, [(h0 / h + w0 / w) / 2 for h, w in levels], rtol=1e-6)
        np.testing.assert_allclose(slide.mpp, mpp, rtol=1e-6)
        _check_levels_against_source(slide, source, factor)


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_tifffile_and_openslide_return_the_same_pixels(name):
    """Both backends decode every file (same libjpeg-turbo; JPEG 2000 YCbCr converted by
    each, hence 1 level apart at most), except that OpenSlide does not see SubIFD levels."""
    with open_image(DATA / name, reader="tifffile") as a, open_image(DATA / name, reader="openslide") as b:
        assert b.levels == (a.levels[:1] if name == "vips-subifd.tif" else a.levels)
        assert a.mpp == pytest.approx(b.mpp, rel=1e-6)
        for level, (h, w) in enumerate(b.levels):
            diff = np.abs(a.read_region(0, 0, h, w, level).astype(int) - b.read_region(0, 0, h, w, level))
            assert diff.max() <= (1 if name.endswith(".svs") else 0)


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_real_world_low_res_is_lazy(name):
    size, *_, reader, _ = COMMITTED[name]
    _check_lazy_low_res(DATA / name, source_image(*size), reader)


def test_ats_info_prints_each_real_world_file():
    code, out = _info(*(DATA / name for name in sorted(COMMITTED)))
    assert code == 0, out
    for name, (_, _, (my, mx), *_) in COMMITTED.items():
        assert name in out and f"{mx:.4g} x {my:.4g} µm (x, y)" in out
    assert "reader: openslide   vendor: aperio" in out and "reader: tifffile   vendor: generic-tiff" in out
    assert "1,001" in out and "0.5 x 0.25 µm (x, y)" in out  # vips-nonsquare: x and y apart


def test_non_square_pixels_choose_a_level_by_their_mean():
    with open_image(DATA / "vips-nonsquare.tif") as slide:
        assert slide.mpp == pytest.approx((0.25, 0.5))
        slide.set_level(mpp=0.75)  # mean 0.375 at level 0, 0.75 at level 1
        assert slide.level == 1


# -- JPEG 2000 as in Aperio SVS (tifffile + imagecodecs) --------------------------------------------------------------

APERIO_DESC = ("Aperio Image Library v12.0.15 \r\n{w}x{h} [0,0 {w}x{h}] (240x240) J2K/KDU Q=70|AppMag = 20|"
               "MPP = 0.4990|Filename = test")


def _aperio_jp2k(path, compression):
    """Aperio's layout (level 0, thumbnail, level 1 at 4x, label, macro) with JPEG 2000
    tiles: 33005 (RGB, Aperio's Kakadu code), 33003 (YCbCr planes, no colour transform)
    or 34712 (tifffile's "jpeg2000", which OpenSlide does not decode)."""
    h, w = SMALL
    img = source_image(h, w)
    level1 = np.round(block_mean(img, 4)).astype(np.uint8)
    with tifffile.TiffWriter(path) as tw:
        for k, lv in enumerate((img, level1)):
            data, args = lv, {"level": 80}
            if compression == 33003:
                data, args = fixtures.rgb_to_ycbcr(lv), {"level": 80, "mct": False}
            tw.write(data, tile=(240, 240), compression=compression, compressionargs=args, photometric="rgb",
                     description=APERIO_DESC.format(h=h, w=w) if k == 0 else None, metadata=None)
            if k == 0:
                tw.write(lv[::8, ::8].copy(), photometric="rgb", compression="jpeg", metadata=None,
                         description=f"Aperio Image Library v12.0.15 \r\n{w}x{h} -> 63x38 - |MPP = 0.4990")
        tw.write(np.full((60, 80, 3), 200, np.uint8), photometric="rgb", subfiletype=1, metadata=None,
                 description="Aperio Image Library v12.0.15\r\nlabel 80x60")
    return img


@pytest.mark.parametrize("compression, auto", [(33005, "openslide"), (33003, "openslide"), (34712, "tifffile")])
def test_aperio_jpeg2000_read_by_both_backends(tmp_path, compression, auto):
    path = tmp_path / f"jp2k-{compression}.svs"
    source = _aperio_jp2k(path, compression)
    with open_image(path) as slide:  # OpenSlide refuses 34712; auto falls back to tifffile
        assert (slide.name, slide.vendor, slide.levels) == (auto, "aperio", [(301, 501), (75, 125)])
        assert slide.mpp == (0.499, 0.499)
        _check_levels_against_source(slide, source, 4, tolerance=3.0)
    with open_image(path, reader="tifffile") as a:
        _check_levels_against_source(a, source, 4, tolerance=3.0)  # 33003: converted from YCbCr as OpenSlide does
        if compression != 34712:
            with open_image(path, reader="openslide") as b:
                assert np.abs(a.read_region(0, 0, 301, 501).astype(int) - b.read_region(0, 0, 301, 501)).max() <= 1
    _check_lazy_low_res(path, source)
    if compression == 34712:
        with pytest.raises(SlideReadError, match=r"jp2k-34712\.svs: OpenSlide cannot open it.*34712"):
            open_image(path, reader="openslide")


class _WithoutJpeg2000(dict):
    """tifffile's decoder table as an installation without JPEG 2000 sees it: missing
    (no imagecodecs: KeyError) or a stand-in that raises ImportError when called
    (imagecodecs built without the codec)."""

    def __init__(self, real, stub: bool):
        super().__init__()
        self.real, self.stub = real, stub

    def __getitem__(self, key):
        if key not in (33003, 33004, 33005, 34712):
            return self.real[key]
        if not self.stub:
            raise KeyError(f"<COMPRESSION.JPEG2000: {key}> requires the 'imagecodecs' package")

        def stub_decode(*args, **kwargs):
            raise ImportError("could not import name 'jpeg2k_decode' from 'imagecodecs'")

        return stub_decode

    def __contains__(self, key):
        try:
            self[key]
        except KeyError:
            return False
        return True


@pytest.mark.parametrize("stub", [False, True])
def test_missing_jpeg2000_codec_is_refused_by_name(tmp_path, monkeypatch, stub):
    _aperio_jp2k(tmp_path / "rgb.svs", 33005)
    _aperio_jp2k(tmp_path / "tf.svs", 34712)
    monkeypatch.setattr(tifffile.TIFF, "DECOMPRESSORS", _WithoutJpeg2000(tifffile.TIFF.DECOMPRESSORS, stub))
    codec = r"JPEG 2000 tiles \(TIFF compression {}\) cannot be decoded here .*pip install -U imagecodecs"
    with pytest.raises(SlideReadError, match=r"rgb\.svs: its " + codec.format(33005)):
        open_image(tmp_path / "rgb.svs", reader="tifffile")
    with open_image(tmp_path / "rgb.svs") as slide:  # OpenSlide decodes Aperio's JPEG 2000 itself
        assert slide.name == "openslide" and slide.read_region(0, 0, 8, 8).any()
    with pytest.raises(SlideReadError, match=r"tf\.svs: OpenSlide cannot open it .*; tifffile cannot read it "
                       r"either: its " + codec.format(34712)) as e:
        open_image(tmp_path / "tf.svs")
    assert "\n" not in str(e.value)
    code, out = _info(tmp_path / "tf.svs")
    assert code == 1 and "tf.svs" in out and "JPEG 2000" in out


# -- OME-TIFF with SubIFD levels, as QuPath and bfconvert export ----------------------------------------------------


def _ome_pyramid(path, img, n_levels=3, physical=None, compression="jpeg", **meta):
    levels = [img[:: 2**k, :: 2**k].copy() for k in range(n_levels)]
    metadata = {"axes": "YXS", **(physical or {"PhysicalSizeX": 0.2527, "PhysicalSizeY": 0.2527}), **meta}
    with tifffile.TiffWriter(path, ome=True, bigtiff=True) as tw:
        tw.write(levels[0], tile=(256, 256), subifds=n_levels - 1, photometric="rgb", compression=compression,
                 metadata=metadata)
        for lv in levels[1:]:
            tw.write(lv, tile=(256, 256), subfiletype=1, photometric="rgb", compression=compression)
    return levels


def test_ome_tiff_subifd_pyramid_levels_and_mpp(tmp_path):
    img = source_image(*fixtures.MAIN)
    path = tmp_path / "qupath.ome.tif"
    levels = _ome_pyramid(path, img, PhysicalSizeXUnit="µm", PhysicalSizeYUnit="µm")
    with open_image(path) as slide:
        assert (slide.name, slide.vendor) == ("tifffile", "ome")
        assert slide.levels == [lv.shape[:2] for lv in levels] == [(601, 1001), (301, 501), (151, 251)]
        assert slide.mpp == (0.2527, 0.2527)
        for level, lv in enumerate(levels):
            h, w = lv.shape[:2]
            assert _mean_error(slide.read_region(0, 0, h, w, level), lv) < JPEG_TOLERANCE
        slide.set_level(mpp=1.0)
        assert slide.level == 2
    _check_lazy_low_res(path, img)
    code, out = _info(path)
    assert code == 0 and "vendor: ome" in out and "0.2527 x 0.2527 µm" in out and "251" in out


def test_ome_physical_size_units_and_non_square_pixels(tmp_path):
    img = source_image(*SMALL)
    path = tmp_path / "nm.ome.tif"
    _ome_pyramid(path, img, 2, {"PhysicalSizeX": 325, "PhysicalSizeXUnit": "nm",
                                "PhysicalSizeY": 0.0004, "PhysicalSizeYUnit": "mm"}, compression="zlib")
    with open_image(path) as slide:
        assert slide.mpp == pytest.approx((0.4, 0.325))
        np.testing.assert_array_equal(slide.read_region(0, 0, 301, 501), img)
    _ome_pyramid(path, img, 2, {"PhysicalSizeX": 1, "PhysicalSizeXUnit": "pixel",
                                "PhysicalSizeY": 1, "PhysicalSizeYUnit": "pixel"}, compression="zlib")
    with open_image(path) as slide:
        assert slide.mpp is None  # a size in pixels is no physical size


# -- BigTIFF declaring a large level 0 --------------------------------------------------------------------------------


def test_bigtiff_with_a_huge_level_0_is_read_from_its_small_level(tmp_path):
    """A BigTIFF whose level 0 is 40960 x 51200 (2.1 G pixels; all but one of its tiles
    left out, as sparse background) and whose level 1 (1/64) holds the image: opening, the
    low-res view and ats info never decode level 0, and stay within a 1 M pixel budget.
    tifffile links levels only 2-4x apart; the reader takes the 1/64 page as a level, and
    not the square label after it."""
    small = source_image(640, 800)
    path = tmp_path / "huge.tif"
    big = (640 * 64, 800 * 64)
    with tifffile.TiffWriter(path, bigtiff=True) as tw:
        n_tiles = (big[0] // 512) * (big[1] // 512)  # the first written (tifffile needs one), the rest left out
        tiles = [np.full((512, 512, 3), 240, np.uint8)] + [None] * (n_tiles - 1)
        tw.write(iter(tiles), shape=(*big, 3), dtype=np.uint8, tile=(512, 512), compression="jpeg",
                 photometric="rgb", resolution=(10_000 / 0.25, 10_000 / 0.25), resolutionunit="CENTIMETER",
                 metadata=None)
        tw.write(small, tile=(256, 256), compression="jpeg", photometric="rgb", subfiletype=1, metadata=None)
        tw.write(np.full((100, 100, 3), 90, np.uint8), photometric="rgb", subfiletype=1, metadata=None)  # a label
    assert path.stat().st_size < 1_000_000
    with open_image(path, max_pixels=1_000_000) as slide:
        assert slide.levels == [big, (640, 800)] and slide.downsamples == [1.0, 64.0]
        assert slide.mpp == pytest.approx((0.25, 0.25))
        view = slide.low_res_view(0.01)  # 410 x 512, from level 1
        assert tuple(view.shape) == (3, 410, 512)
        assert _mean_error(slide.read_region(100, 200, 300, 400, 1), small[100:400, 200:600]) < JPEG_TOLERANCE
        assert not slide.read_region(5000, 7000, 64, 64, 0).any()  # a tile left out reads as background
        with pytest.raises(SlideReadError, match=r"huge\.tif: level 0 .*over the limit"):
            slide.low_res((20_000, 25_000))
    result = CliRunner().invoke(app, ["info", str(path), "--max-pixels", "1000000"])
    assert result.exit_code == 0 and "40,960" in result.output and "51,200" in result.output
    assert "64" in result.output and "0.25 x 0.25 µm" in result.output


# -- 16-bit and multi-channel: refused by name, with the channel count --------------------------------------------


def _fluorescence_ome(path, channels=5, dtype=np.uint16):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 4096 if dtype == np.uint16 else 256, (channels, *SMALL)).astype(dtype)
    with tifffile.TiffWriter(path, ome=True) as tw:  # as QuPath exports fluorescence: planes per channel, SubIFDs
        tw.write(data, tile=(256, 256), subifds=1, photometric="minisblack", compression="zlib",
                 metadata={"axes": "CYX", "Channel": {"Name": ["DAPI", "FITC", "TRITC", "Cy5", "AF750"][:channels]},
                           "PhysicalSizeX": 0.325, "PhysicalSizeY": 0.325})
        tw.write(data[:, ::2, ::2], tile=(256, 256), subfiletype=1, photometric="minisblack", compression="zlib")


def test_sixteen_bit_and_multichannel_files_are_refused_with_the_channel_count(tmp_path):
    img = source_image(*SMALL)
    _fluorescence_ome(tmp_path / "fluo16.ome.tif")
    _fluorescence_ome(tmp_path / "fluo8.ome.tif", dtype=np.uint8)
    tifffile.imwrite(tmp_path / "rgb16.tif", img.astype(np.uint16) * 257, photometric="rgb", tile=(256, 256))
    tifffile.imwrite(tmp_path / "four.tif", np.dstack([img, img[..., :1]]), photometric="minisblack",
                     planarconfig="contig", tile=(256, 256))
    tifffile.imwrite(tmp_path / "six.tif", np.dstack([img, img]), photometric="minisblack", planarconfig="contig")
    tifffile.imwrite(tmp_path / "three.tif", img, photometric="minisblack", planarconfig="contig")
    tifffile.imwrite(tmp_path / "zstack.ome.tif", np.stack([img] * 3), photometric="rgb", metadata={"axes": "ZYXS"})
    tifffile.imwrite(tmp_path / "ycc.tif", fixtures.rgb_to_ycbcr(img), photometric="ycbcr", subsampling=(1, 1),
                     compression="zlib")  # tifffile would hand out the Y, Cb, Cr values as if RGB
    refused = {
        "fluo16.ome.tif": r"has 5 channels \(axes CYX\) of 16-bit samples \(uint16\); ats reads 8-bit gray",
        "fluo8.ome.tif": r"has 5 channels \(axes CYX\); ats reads 8-bit gray \(1 channel\) or RGB \(3\)",
        "rgb16.tif": r"16-bit samples \(uint16\) are not supported: .*no one right 8-bit scaling",
        "four.tif": r"has 4 channels \(4 samples per pixel, photometric MINISBLACK\)",
        "six.tif": r"has 6 channels \(6 samples per pixel",
        "three.tif": r"has 3 channels \(3 samples per pixel, photometric MINISBLACK\)",  # intensities, not colour
        "zstack.ome.tif": r"holds several images \(3 along Z; axes ZYXS\)",
        "ycc.tif": r"YCbCr samples under ADOBE_DEFLATE compression are not supported",
    }
    for name, message in refused.items():
        with pytest.raises(SlideReadError, match=name.replace(".", r"\.") + ": " + message) as e:
            open_image(tmp_path / name)
        assert "\n" not in str(e.value)
    code, out = _info(*(tmp_path / name for name in refused))
    assert code == 1 and f"{len(refused)} of {len(refused)} file(s) failed" in out
    for name in refused:
        assert name in out


def test_alpha_and_padding_samples_are_dropped(tmp_path):
    img = source_image(*SMALL)
    alpha = np.full((*SMALL, 1), 255, np.uint8)
    tifffile.imwrite(tmp_path / "rgba.tif", np.dstack([img, alpha]), photometric="rgb", extrasamples=["unassalpha"],
                     tile=(256, 256))
    tifffile.imwrite(tmp_path / "rgbx.tif", np.dstack([img, alpha]), photometric="rgb", extrasamples=["unspecified"])
    tifffile.imwrite(tmp_path / "graya.tif", np.dstack([img[..., :1], alpha]), photometric="minisblack",
                     extrasamples=["assocalpha"], planarconfig="contig")
    for name, want in (("rgba.tif", img), ("rgbx.tif", img), ("graya.tif", img[..., :1])):
        with open_image(tmp_path / name) as slide:
            assert slide.channels == want.shape[2]
            np.testing.assert_array_equal(slide.read_region(0, 0, *SMALL), want)
