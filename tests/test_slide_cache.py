"""Training at slide scale: the low-res view cache (ats_cli.data.inputs) and the
synthetic-slides generator rendering and writing in bands (bounded memory at any size)."""

from __future__ import annotations

import json
import os
import time
import tracemalloc

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ats_cli.cli import app
from ats_cli.data import synthetic_slides as ss
from ats_cli.data.inputs import VIEW_CACHE_ENV as ENV
from ats_cli.data.inputs import ImageDataset, ViewCache, open_input
from ats_cli.data.slides import SlideReader
from ats_cli.io import FINE_SETTLE_NS

runner = CliRunner()
SMALL = ss.SyntheticSlidesConfig(n_train=4, n_test=2, size=1024, n_spots=4, max_targets=2, spot_radius=20)
TRAIN_FLAGS = ["--epochs", "2", "--batch-size", "2", "--scale", "0.03125", "--patch-size", "64", "--n-patches", "4",
               "--feature-net", "small-cnn", "--set", "feature_width=8", "--set", "attention_width=4", "--lr", "3e-3",
               "--workers", "0", "--device", "cpu"]
READ = {"channels": 3, "scale": 1 / 32, "patch_size": (64, 64)}


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "data"
    ss.generate_synthetic_slides(out, SMALL, workers=1)
    return out


@pytest.fixture
def count_views(monkeypatch):
    """How many times a slide's low-res view is made from the file."""
    calls = []
    made = SlideReader.low_res

    def counting(self, size):
        calls.append(str(self.path))
        return made(self, size)

    monkeypatch.setattr(SlideReader, "low_res", counting)
    return calls


def test_the_cached_view_and_mask_are_the_uncached_ones_and_are_made_once(slides, tmp_path, count_views):
    path = slides / "train" / "0001.tif"
    plain = open_input(path, **READ)
    cache = ViewCache(tmp_path / "views")
    first = open_input(path, **READ, view_cache=cache)
    assert len(count_views) == 2 and len(list((tmp_path / "views").glob("*.npz"))) == 1
    again = open_input(path, **READ, view_cache=cache)
    assert len(count_views) == 2  # read back, not remade
    for got in (first, again):
        assert torch.equal(got.low, plain.low) and torch.equal(got.support, plain.support)
    # another scale is another entry
    open_input(path, **{**READ, "scale": 1 / 16}, view_cache=cache)
    assert len(count_views) == 3 and len(list((tmp_path / "views").glob("*.npz"))) == 2


def test_a_changed_file_is_not_served_its_old_view(slides, tmp_path, count_views):
    path = tmp_path / "slide.tif"
    path.write_bytes((slides / "train" / "0000.tif").read_bytes())
    cache = ViewCache(tmp_path / "views")
    old = open_input(path, **READ, view_cache=cache)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # touched: made again
    open_input(path, **READ, view_cache=cache)
    assert len(count_views) == 2
    path.write_bytes((slides / "train" / "0001.tif").read_bytes())  # rewritten: the new file's view
    new = open_input(path, **READ, view_cache=cache)
    assert len(count_views) == 3
    assert torch.equal(new.low, open_input(slides / "train" / "0001.tif", **READ).low)
    assert not torch.equal(new.low, old.low)


def test_a_virtual_slide_rendered_anew_is_not_served_its_old_view(tmp_path, count_views, monkeypatch):
    """A virtual slide's pixels are its renderer's: after a renderer change (RENDERER bumped)
    the same spec file is another entry, not the older rendering's view."""
    from ats_cli.data import virtual_slides as vsm

    path = tmp_path / "s.vslide.json"
    vsm.write_spec(path, vsm.VirtualSlideSpec(width=1024, height=1024, seed=3, nests=1, decoys=1,
                                              downsamples=(1, 4, 16, 32)))
    time.sleep(2 * FINE_SETTLE_NS / 1e9)  # a view made within a timestamp tick of the write is not kept
    cache = ViewCache(tmp_path / "views")
    open_input(path, **READ, view_cache=cache)
    open_input(path, **READ, view_cache=cache)
    assert len(count_views) == 1
    monkeypatch.setattr(vsm, "RENDERER", vsm.RENDERER + 1)
    open_input(path, **READ, view_cache=cache)
    assert len(count_views) == 2 and len(list((tmp_path / "views").glob("*.npz"))) == 2


def test_a_damaged_entry_is_made_again(slides, tmp_path, count_views):
    cache = ViewCache(tmp_path / "views")
    path = slides / "train" / "0000.tif"
    good = open_input(path, **READ, view_cache=cache)
    (entry,) = (tmp_path / "views").glob("*.npz")
    entry.write_bytes(b"not an npz")
    again = open_input(path, **READ, view_cache=cache)
    assert len(count_views) == 2 and torch.equal(again.low, good.low)


def test_the_dataset_reads_through_the_cache(slides, tmp_path, count_views):
    from ats_cli.data import load_dataset

    records = load_dataset(slides)["train"]
    data = ImageDataset(records, **READ, view_cache=ViewCache(tmp_path / "views"))
    first = [data[i] for i in range(len(data))]
    second = [data[i] for i in range(len(data))]  # the next epoch
    assert len(count_views) == len(records)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[4], b[4])


def _train(slides, run, monkeypatch, cache: str | None) -> list[dict]:
    if cache is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, cache)
    result = runner.invoke(app, ["train", str(slides), "--out", str(run), *TRAIN_FLAGS])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_training_with_the_cache_is_training_without_it(slides, tmp_path, monkeypatch, count_views):
    cached = _train(slides, tmp_path / "cached", monkeypatch, None)
    n_files = SMALL.n_train + SMALL.n_test
    entries = list((tmp_path / "cached" / "cache" / "views").glob("*.npz"))
    assert len(entries) == n_files
    assert len(set(count_views)) == n_files and len(count_views) == n_files  # once each over two epochs
    count_views.clear()
    plain = _train(slides, tmp_path / "plain", monkeypatch, "off")
    assert not (tmp_path / "plain" / "cache").exists() and len(count_views) > 2 * n_files
    timing = {"samples_per_s", "ms_per_sample", "peak_mem_mb"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in cached] == \
        [{k: v for k, v in r.items() if k not in timing} for r in plain]


# ---------------------------------------------------------------------------- the generator in bands


@pytest.mark.parametrize("stain", [0.0, 0.3])
def test_bands_paint_the_slide_the_whole_renderer_paints(stain):
    """The banded renderer with the whole image's noise gives generator v1's image bit for
    bit, however many bands (stamps across band edges, the noise drawn band by band)."""
    config = ss.SyntheticSlidesConfig(size=1024, n_spots=4, max_targets=2, spot_radius=20, stain_jitter=stain)
    for index in (0, 1):
        whole, layout = ss.render_slide(config, "train", index)
        banded_layout, bands = ss.render_slide_bands(config, "train", index, rows=256, noise=ss._WholeNoise)
        parts = list(bands)
        assert len(parts) == 4 and banded_layout == layout
        assert np.array_equal(np.concatenate(parts), whole)


def test_the_banded_noise_is_the_whole_noise_up_to_rounding():
    whole = ss._WholeNoise(np.random.default_rng(3), 1024, 24).full
    banded = ss._BandNoise(np.random.default_rng(3), 1024, 24)
    rows = np.concatenate([banded.rows(r, min(r + 100, 1024)) for r in range(0, 1024, 100)])
    assert np.abs(rows - whole).max() < 1e-4
    assert np.array_equal(rows, banded.rows(0, 1024))  # a row does not depend on the band it is made in
    assert np.array_equal(rows[5::8], banded.rows(5, 1024, 8))
    # with the banded noise the slide is the same slide: same layout, pixels within rounding
    whole_image, layout = ss.render_slide(SMALL, "test", 1)
    banded_layout, bands = ss.render_slide_bands(SMALL, "test", 1, rows=256, noise=ss._BandNoise)
    diff = np.abs(np.concatenate(list(bands)).astype(int) - whole_image)
    assert banded_layout == layout and (diff > 0).mean() < 1e-4


def test_the_pyramid_written_from_bands_is_the_pyramid_written_whole(tmp_path):
    image, _ = ss.render_slide(ss.SyntheticSlidesConfig(size=1000, spot_radius=20), "train", 0)  # edge tiles
    ss.write_pyramid(tmp_path / "whole.tif", image, min_side=32)
    ss.write_pyramid_bands(tmp_path / "bands.tif", (image[r:r + 256] for r in range(0, 1000, 256)), (1000, 1000),
                           min_side=32)
    assert (tmp_path / "bands.tif").read_bytes() == (tmp_path / "whole.tif").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bands.tif", "whole.tif"]  # no temporaries left


def test_sides_above_the_one_shot_limit_are_generated_in_bounded_memory(tmp_path, monkeypatch):
    """Forced small limits make a 2048-pixel slide take the banded path; its peak traced
    memory (~3 bands: 18 MB measured) stays well below the image in float32 (48 MB) that
    rendering it whole needs."""
    monkeypatch.setattr(ss, "ONE_SHOT_MAX", 512)
    monkeypatch.setattr(ss, "BAND_PIXELS", 256 * 2048)
    config = ss.SyntheticSlidesConfig(size=2048, n_spots=4, max_targets=2, spot_radius=20)
    assert ss.band_rows(2048) == 256 and "rendering" in ss.fingerprint(config)
    tracemalloc.start()
    try:
        layout, bands = ss.render_slide_bands(config, "train", 1)
        ss.write_pyramid_bands(tmp_path / "s.tif", bands, (2048, 2048))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2048 * 2048 * 12 / 2, peak
    from ats_cli.data.slides import open_image

    with open_image(tmp_path / "s.tif") as slide:
        assert slide.levels == [(2048, 2048), (512, 512), (128, 128)]
        assert layout.label == 1 and layout.targets
        r, c = layout.targets[0]
        spot = slide.read_region(r - 20, c - 20, 40, 40, 0).reshape(-1, 3).mean(0)
        assert (spot < ss.STROMA - 20).any()  # a dark nest where the layout says
