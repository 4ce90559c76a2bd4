"""A virtual slide's read costs its pixels, whatever the spec's spot radius (issue #67, case 3).

A valid spec with ``spot_radius`` 4,000 used to take 8.4 s and 2.6 GB to read one 64x64
patch on a spot (the renderer made every nucleus of the spot and the whole disc), a
MemoryError at radius 8,000, and at the largest radius validation allows it asked for
5.7 TiB. Rendering now makes only the nuclei and disc pixels the read's window holds.
The memory tests were seen failing on the code before the fix; the tiling test keeps the
pixels those of a whole-spot read.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from ats_cli.data.slides import open_image
from ats_cli.data.virtual_slides import MAX_SIDE, VirtualSlideSpec, write_spec


def _spec(tmp_path, side, radius, **kw):
    path = tmp_path / "big.vslide.json"
    write_spec(path, VirtualSlideSpec(width=side, height=side, seed=1, nests=1, decoys=1, spot_radius=radius,
                                      downsamples=(1, 2), **kw))
    return path


@pytest.mark.parametrize("side, radius", [(100_000, 1000.0), (MAX_SIDE, MAX_SIDE / 16)])
def test_a_patch_on_a_huge_spot_costs_the_patch(tmp_path, side, radius):
    """64x64 patches on a nest and on a decoy, at level 0 and 1: a few MB, where the old
    renderer made the whole spot (~100 MB at radius 1,000; terabytes at the largest)."""
    slide = open_image(_spec(tmp_path, side, radius))
    assert {s.nest for s in slide.slide.spots} == {True, False}
    tracemalloc.start()
    try:
        for spot in slide.slide.spots:
            for level, d in enumerate((1, 2)):
                patch = slide.read_region(int(spot.row / d) - 32, int(spot.col / d) - 32, 64, 64, level)
                assert patch.shape == (64, 64, 3) and patch.std() > 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"{peak / 2**20:.0f} MiB for 64x64 patches"


def test_a_spot_read_in_tiles_smaller_than_it_is_the_spot_read_whole(tmp_path):
    """Windowed rendering draws the pixels of a whole-spot read, bit for bit, on tiles that
    cut the spot's disc and its nuclei anywhere (the disc is 400 pixels across)."""
    slide = open_image(_spec(tmp_path, 8192, 200.0))
    for spot in slide.slide.spots:
        for level, d in enumerate((1, 2)):
            r0, c0 = int(spot.row / d) - 230 // d, int(spot.col / d) - 230 // d
            n = 460 // d
            whole = slide.read_region(r0, c0, n, n, level)
            tiled = np.concatenate([np.concatenate([slide.read_region(r0 + r, c0 + c, min(37, n - r), min(37, n - c),
                                                                      level)
                                                    for c in range(0, n, 37)], 1) for r in range(0, n, 37)], 0)
            assert np.array_equal(tiled, whole), (spot, level)
