"""ats_cli.render draws plain records: it imports no model code (nor torch or matplotlib
until a figure is drawn), its heat is the smooth patch-sized map the figure has always
shown, and its figures open as images at the extremes (one patch, 200 patches, a tiny
image, a huge slide)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from ats_cli.render.evolution import EpochPanel, EvolutionFigure, draw_evolution
from ats_cli.render.figure import MAX_STRIP, AttentionFigure, _max_filter, _upsample, draw_attention
from ats_cli.render.geojson import feature_collection
from ats_cli.render.qupath import render_preview
from ats_cli.render.records import AttentionRecord, DigitBox, LevelFrame, patch_sites

MODULES = ["ats_cli.render", "ats_cli.render.records", "ats_cli.render.draw", "ats_cli.render.figure",
           "ats_cli.render.evolution", "ats_cli.render.geojson", "ats_cli.render.qupath"]


@pytest.mark.parametrize("module", MODULES)
def test_the_renderers_import_no_model_code(module):
    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib') or "
            "m.startswith(('ats_cli.core', 'ats_cli.predict', 'ats_cli.models', 'ats_cli.visualize')))\n"
            "print(repr(bad))")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True,
                          env={"PYTHONPATH": str(root), "PATH": ""})
    assert done.stdout.strip() == "[]", done.stdout


def test_the_heat_is_torchs_max_pool_then_bilinear_upsampling():
    t = np.random.default_rng(0).random((7, 11))
    pooled = F.max_pool2d(torch.from_numpy(t)[None, None], 5, stride=1, padding=2)
    np.testing.assert_allclose(_max_filter(t, 5), pooled[0, 0].numpy())
    up = F.interpolate(torch.from_numpy(t)[None, None], scale_factor=6, mode="bilinear", align_corners=False)
    np.testing.assert_allclose(_upsample(t, 6), up[0, 0].numpy(), atol=1e-12)


def test_patch_sites_rank_by_contribution():
    offsets = [[0, 0], [5, 5], [9, 1]]
    sites = patch_sites(offsets, [0.5, 0.3, 0.2], [0.1, 0.5, 0.4], [0.3, 0.2, 0.1])
    assert [(s.row, s.col) for s in sites] == [(0, 0), (5, 5), (9, 1)]
    assert [s.weight for s in sites] == [0.1, 0.5, 0.4] and [s.contribution for s in sites] == [0.3, 0.2, 0.1]


def figure(n: int, size: tuple[int, int], patch: int = 16, cells: tuple[int, int] = (12, 12), seed: int = 0,
           ranking: str = "contribution") -> AttentionFigure:
    """A made-up record: a peaked map, n draws at random places, weights and contributions."""
    rng = np.random.default_rng(seed)
    H, W = size
    att = rng.random(cells) ** 8
    att /= att.sum()
    offsets = np.stack([rng.integers(-patch // 2, H - patch // 2, n), rng.integers(-patch // 2, W - patch // 2, n)],
                       axis=1)
    weights, contributions = rng.random(n), rng.random(n)
    known = {"contribution": (weights, contributions), "weight": (weights, None), "attention": (None, None)}[ranking]
    return AttentionFigure(
        image_name="made-up.png", size=size, background=rng.random((3, min(H, 300), min(W, 300))),
        attention=att, attention_extent=(0, W, H, 0), patch_size=(patch, patch),
        sites=patch_sites(offsets.tolist(), rng.random(n).tolist(), *known), patches=rng.random((n, 3, patch, patch)),
        prediction="tumor", probability=0.83, ranking=ranking, label="tumor",
        boxes=[DigitBox("x", H // 4, W // 4, max(H // 8, 1), max(W // 8, 1))], model_name="made-up.pt",
        sampling=f"{n} patches, seed 0", entropy=1.5)


@pytest.mark.parametrize("n,size,ranking", [(1, (512, 512), "weight"), (200, (1500, 1500), "contribution"),
                                            (4, (20, 30), "attention"), (24, (100_000, 80_000), "contribution")])
def test_the_figure_opens_at_the_extremes(tmp_path, n, size, ranking):
    out = tmp_path / "fig.png"
    drawn = draw_attention(figure(n, size, patch=min(16, size[0]), ranking=ranking), out)
    with Image.open(out) as im:
        assert im.size == drawn.size_px and 600 <= im.width <= 4000 and 300 <= im.height <= 4000
    assert len(drawn.strip) == min(n, MAX_STRIP, len(drawn.sites))
    shares = [s.contribution for s in drawn.strip]
    assert shares == sorted(shares, reverse=True)


def test_the_evolution_figure_opens(tmp_path):
    rng = np.random.default_rng(0)
    panels = [EpochPanel(e, (m := rng.random((9, 9)) ** e) / m.sum(), e / 10) for e in (1, 2, 3, 4, 5, 6)]
    size = draw_evolution(EvolutionFigure("x.png", (90, 90), rng.random((1, 30, 30)), (0, 90, 90, 0), panels,
                                          run_name="run", boxes=[DigitBox("7", 10, 10, 20, 20)]), tmp_path / "e.png")
    with Image.open(tmp_path / "e.png") as im:
        assert im.size == size


def _shares(a: float, b: float) -> np.ndarray:
    """A 20x20 map with two objects, A (up left) and B (down right), in the ratio a:b; the
    rest holds next to nothing."""
    m = np.full((20, 20), 1e-7)
    m[2:4, 2:4], m[14:16, 14:16] = a, b
    return m / m.sum()


def test_the_evolution_figure_shows_what_changes_between_epochs(tmp_path):
    """Epochs whose maps differ only in how they share the attention between two objects (A
    going from a fifth to four fifths) looked alike on the shared log scale. Under the later epoch the figure
    draws the change: red where the attention grew, blue where it shrank, at those places."""
    boxes = [DigitBox("7", 20, 20, 20, 20)]  # object A, in full-res pixels (10 per cell)
    panels = [EpochPanel(1, _shares(1.0, 4.0)), EpochPanel(2, _shares(4.0, 1.0))]
    out = tmp_path / "e.png"
    draw_evolution(EvolutionFigure("x.png", (200, 200), np.zeros((1, 50, 50)), (0, 200, 200, 0), panels,
                                   boxes=boxes), out, dpi=60)
    rgb = np.asarray(Image.open(out).convert("RGB")).astype(int)
    rgb = rgb[:, : int(rgb.shape[1] * 0.8)]  # the panels, not the colour bars on the right
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    blue = (b > r + 50) & (b > 70)  # the diverging scale's "less": no colour of the attention scale is blue
    red = (r > g + 60) & (r > b + 40)  # its "more" (and the box drawn around A)
    assert blue.sum() > 20 and red.sum() > 20, (blue.sum(), red.sum())
    ys, xs = np.nonzero(blue)
    by, bx = ys.mean(), xs.mean()
    ys, xs = np.nonzero(red)
    assert xs.mean() < bx and ys.mean() < by  # A (gaining) up and left of B (losing), as in the maps


def test_the_share_of_attention_on_the_recorded_objects_and_the_entropy():
    from ats_cli.render.evolution import entropy, on_objects

    m = _shares(4.0, 1.0)
    share = on_objects(m, (0, 200, 200, 0), [DigitBox("7", 20, 20, 20, 20)])
    assert share == pytest.approx(m[2:4, 2:4].sum())
    assert on_objects(m, (0, 200, 200, 0), []) is None
    assert entropy(np.full((4, 4), 1 / 16)) == pytest.approx(np.log(16))


def test_the_preview_draws_the_collection(tmp_path):
    """From the collection alone, over a thumbnail of any size: the image's extent comes from the file."""
    rng = np.random.default_rng(0)
    att = rng.random((8, 8)) ** 6
    record = AttentionRecord(att / att.sum(), np.array([[-8, -8], [500, 300]]), np.array([0.3, 0.2]),
                             np.array([0.6, 0.4]), np.array([0.6, 0.4]), (16, 16), (64, 48), 0,
                             LevelFrame(0, 1.0, (512, 384), (512, 384)))
    collection = json.loads(json.dumps(feature_collection(record, ["a", "b"], [0.3, 0.7], label="b",
                                                          boxes=[("x", 10, 10, 30, 30)])))
    width, height = render_preview(collection, rng.integers(0, 255, (128, 96, 3), dtype=np.uint8),
                                   tmp_path / "p.png", geojson_name="p.geojson", image_name="p.tif")
    with Image.open(tmp_path / "p.png") as im:
        assert im.size == (width, height) and width > 500


def test_the_figure_subtitle_wraps_before_it_runs_past_the_edges():
    """A long file or model name (a 100k² virtual slide, a released model) split the
    subtitle over two lines, each within the figure's width; a short one stays one line."""
    from ats_cli.render.figure import _one_or_two_lines

    short = ["0001.tif 2048x2048", "best.pt", "20 patches, seed 0", "attention entropy 2.1 nats (uniform 9.7)"]
    assert "\n" not in _one_or_two_lines(short, 8.8)
    long = ["0000.vslide.json 100000x100000", "synthetic-slides-100k-ats.pt",
            "16 regions x 8 patches, seed 0, threshold estimator", "attention entropy 2.48 nats (uniform 9.75)"]
    lines = _one_or_two_lines(long, 8.8).split("\n")
    assert len(lines) == 2 and all(len(line) <= 8.8 * 72 / (0.6 * 7.5) for line in lines)
