"""The GeoJSON preview (``ats visualize SLIDE --out X.geojson --preview X.png``) reads at any
slide size (issue 66): on a 20k slide, where a cell of the attention map or a patch is a
pixel or two of the preview, the attention is a visible heat layer, not thousands of
one-pixel specks; patch boxes are big enough to see and lie inside the image; numbers do
not cover one another."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from ats_cli.render.geojson import CELL_CLASS
from ats_cli.visualize import PREVIEW_SIDE, _thumbnail, write_attention_geojson

ROOT = Path(__file__).resolve().parents[1]
SLIDES_MODEL = ROOT / "models" / "synthetic-slides-ats.pt"
SPEC = ROOT / "sample_data" / "virtual-slides" / "0001.vslide.json"  # a tumor slide's tissue and nests
# the preview's image panel, in PNG pixels (ats_cli.render.qupath: 0.75 in left, 0.85 in top, 6.2 in wide, 110 dpi)
PANEL_LEFT, PANEL_TOP, PANEL_SIDE = round(0.75 * 110), round(0.85 * 110), round(6.2 * 110)


@pytest.fixture(scope="module")
def slide_20k(tmp_path_factory) -> Path:
    spec = json.loads(SPEC.read_text())
    spec.update(width=20_000, height=20_000, downsamples=[2**k for k in range(8)])
    path = tmp_path_factory.mktemp("s20k") / "s20k.vslide.json"
    path.write_text(json.dumps(spec))
    return path


def _panel(png: Path) -> np.ndarray:
    with Image.open(png) as im:
        rgb = np.asarray(im.convert("RGB"), dtype=np.int16)
    # inside the frame, clear of its line
    return rgb[PANEL_TOP + 3:PANEL_TOP + PANEL_SIDE - 3, PANEL_LEFT + 3:PANEL_LEFT + PANEL_SIDE - 3]


def _solid(mask: np.ndarray, k: int = 5) -> np.ndarray:
    """Pixels whose whole k x k neighbourhood is in ``mask``: a region, not a speck."""
    windows = np.lib.stride_tricks.sliding_window_view(mask, (k, k))
    return windows.all(axis=(-2, -1))


def test_a_20k_slides_preview_shows_the_attention_as_a_heat_layer(slide_20k, tmp_path):
    from ats_cli.render.qupath import render_preview

    out, png = tmp_path / "x.geojson", tmp_path / "x.png"
    write_attention_geojson(SLIDES_MODEL, slide_20k, out, preview=png)
    collection = json.loads(out.read_text())
    assert collection["properties"]["image_size"] == {"width": 20_000, "height": 20_000}
    # the same preview without any attention: the plain slide, boxes and numbers
    plain = dict(collection, features=[f for f in collection["features"]
                                       if f["properties"].get("classification", {}).get("name") != CELL_CLASS])
    render_preview(plain, _thumbnail(slide_20k, None, PREVIEW_SIDE), tmp_path / "plain.png",
                   geojson_name="x.geojson", image_name=slide_20k.name)
    heat, base = _panel(png), _panel(tmp_path / "plain.png")
    assert heat.shape == base.shape
    changed = np.abs(heat - base).sum(axis=-1) > 40
    tissue = (base.astype(float).std(axis=-1) > 12) | (base.sum(axis=-1) < 600)  # pink, not the white glass
    assert tissue.mean() > 0.15  # the slide's tissue is in the panel
    assert changed[tissue].mean() > 0.5, changed[tissue].mean()  # the heat covers the tissue ...
    assert _solid(changed).mean() > 0.1, _solid(changed).mean()  # ... in regions, not as specks
    assert changed[~tissue].mean() < 0.1  # and leaves the glass clear (but for the glow of a peak)


def test_patch_boxes_are_big_enough_to_see_and_lie_inside_the_image():
    from ats_cli.render.qupath import patch_places

    H0 = W0 = 100_000
    side = 7 * W0 / 682  # 7 preview pixels, in level-0 pixels
    boxes = [(0, 0, 64, 64), (99_950, 99_950, 100_000, 100_000), (50_000, 50_000, 50_064, 50_064),
             (50_032, 50_000, 50_096, 50_064), (20_000, 80_000, 20_064, 80_064), (20_000, 80_000, 20_064, 80_064)]
    places = patch_places(boxes, [1, 2, 3, 4, 5, 6], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], (H0, W0), side)
    assert [(d, round(w, 3)) for _, d, w in places] == [([1], 0.1), ([2], 0.2), ([3, 4], 0.7), ([5, 6], 1.1)]
    for (x0, y0, x1, y1), _, _ in places:
        assert 0 <= x0 < x1 <= W0 and 0 <= y0 < y1 <= H0
        assert x1 - x0 >= side - 1e-6 and y1 - y0 >= side - 1e-6
    # patches the preview shows at their own size keep their own boxes, overlapping or not
    own = patch_places([(0, 0, 50, 50), (25, 25, 75, 75)], [1, 2], [0.5, 0.5], (500, 500), 7 * 500 / 682)
    assert [b for b, _, _ in own] == [(0, 0, 50, 50), (25, 25, 75, 75)]


def test_numbers_next_to_crowded_boxes_never_cover_one_another_or_leave_the_image():
    from ats_cli.render.draw import place_labels

    fig = Figure(figsize=(6.2, 6.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.1, 0.1, 0.8, 0.8))
    ax.set_xlim(0, 20_000)
    ax.set_ylim(20_000, 0)
    rng = np.random.default_rng(0)
    corners = np.concatenate([rng.uniform(0, 20_000, (40, 2)), rng.uniform(9_000, 10_000, (20, 2)),
                              [[0, 0], [19_800, 19_800]]])
    boxes = [(x, y, x + 200, y + 200) for x, y in corners]
    written = place_labels(ax, boxes, [str(k + 1) for k in range(len(boxes))], colour="magenta", skip=True)
    assert 0 < sum(written) < len(boxes)  # the crowd at (9,000-10,000) cannot all be numbered
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    extents = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(extents) == sum(written)
    for i, a in enumerate(extents):
        assert frame.x0 - 1 <= a.x0 and a.x1 <= frame.x1 + 1 and frame.y0 - 1 <= a.y0 and a.y1 <= frame.y1 + 1
        for b in extents[i + 1:]:
            assert not a.overlaps(b)


def test_the_heat_keeps_a_peak_that_is_smaller_than_a_preview_pixel():
    from ats_cli.render.qupath import heat_raster

    att = np.full((3000, 3000), 1e-9)  # a 96k slide's one-level map (32 px cells), 3000 cells over 600 pixels
    att[1234, 2345] = 0.5
    raster = heat_raster(att, (0.0, 0.0, 96_000.0, 96_000.0), (96_000, 96_000), (600, 600))
    assert raster.max() == 0.5 and tuple(np.argwhere(raster == 0.5)[0]) == (1234 // 5, 2345 // 5)
    # a map over part of the image (the attention net's margin): 0 outside it
    part = heat_raster(np.ones((10, 10)), (100.0, 100.0, 900.0, 900.0), (1000, 1000), (100, 100))
    assert part[:10].max() == 0 and part[:, 90:].max() == 0 and part[10:90, 10:90].min() == 1
