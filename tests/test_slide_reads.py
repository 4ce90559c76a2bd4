"""Slide patches read in tile order on the shared reading threads, each tile decoded once:
the same pixels as reading the patches one by one (issue 39)."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import tifffile
import torch

from ats_cli.data import slides
from ats_cli.data.slides import open_image

H, W, TILE = 600, 760, 64


@pytest.fixture(scope="module")
def pyramid(tmp_path_factory):
    """A tiled RGB pyramid (zlib), one tile left out (sparse: background)."""
    rng = np.random.default_rng(39)
    img = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    path = tmp_path_factory.mktemp("reads") / "pyr.tif"
    with tifffile.TiffWriter(path) as tw:
        for k in range(3):
            tw.write(img[:: 2**k, :: 2**k], tile=(TILE, TILE), compression="zlib", subfiletype=1 if k else 0,
                     photometric="rgb", metadata=None)
    return path, img


def offsets(n, seed=0, spread=None):
    g = torch.Generator().manual_seed(seed)
    if spread is None:  # anywhere, across every border and wholly outside
        return torch.stack([torch.randint(-70, H + 10, (n,), generator=g),
                            torch.randint(-70, W + 10, (n,), generator=g)], 1)
    centre = torch.tensor([H // 2, W // 2])  # bunched, as the attention draws: shared tiles
    return centre + torch.randint(-spread, spread, (n, 2), generator=g)


def one_by_one(reader, offs, size):
    return torch.from_numpy(np.stack([reader.read_region(r, c, *size, reader.level) for r, c in offs.tolist()])
                            .transpose(0, 3, 1, 2).copy())


def truth(img, offs, size):
    h, w = size
    out = np.zeros((len(offs), h, w, 3), np.uint8)
    for k, (r, c) in enumerate(offs.tolist()):
        r0, c0 = max(r, 0), max(c, 0)
        region = img[r0:max(r + h, 0), c0:max(c + w, 0)]
        out[k, r0 - r:r0 - r + region.shape[0], c0 - c:c0 - c + region.shape[1]] = region
    return torch.from_numpy(out.transpose(0, 3, 1, 2).copy())


@pytest.mark.parametrize("spread", [None, 60], ids=["anywhere", "bunched"])
@pytest.mark.parametrize("budget", [slides.READ_BUDGET_BYTES, 5 * TILE * TILE * 3], ids=["one group", "groups"])
def test_pooled_reads_equal_reading_one_by_one(pyramid, monkeypatch, spread, budget):
    monkeypatch.setattr(slides, "READ_BUDGET_BYTES", budget)
    path, img = pyramid
    with open_image(path, reader="tifffile") as reader:
        for n, size in [(1, (50, 50)), (37, (50, 50)), (80, (100, 70))]:
            offs = offsets(n, seed=n, spread=spread)
            got = reader.read_patches(offs, size)
            assert torch.equal(got, one_by_one(reader, offs, size))
            assert torch.equal(got, truth(img, offs, size))
        reader.set_level(1)
        offs = offsets(20, seed=5) // 2
        assert torch.equal(reader.read_patches(offs, (32, 32)), truth(img[::2, ::2], offs, (32, 32)))


def test_each_tile_is_decoded_once_per_batch(pyramid, monkeypatch):
    path, _ = pyramid
    with open_image(path, reader="tifffile") as reader:
        decoded = []
        segment = reader._segment
        monkeypatch.setattr(reader, "_segment", lambda level, i: decoded.append(i) or segment(level, i))
        offs = offsets(40, spread=40)  # 40 patches of 50x50 within ~2x2 tiles' reach
        reader.read_patches(offs, (50, 50))
        assert len(decoded) == len(set(decoded)) <= 9


def _read_in_child(path, queue):
    with open_image(path, reader="tifffile") as reader:
        queue.put(reader.read_patches(offsets(30, spread=80), (50, 50)).sum().item())


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_the_reading_threads_work_in_a_forked_worker(pyramid):
    """A DataLoader worker is a fork of a process whose pool has already started: its copy has
    no threads behind it, so the child must start its own (a hang otherwise)."""
    path, img = pyramid
    with open_image(path, reader="tifffile") as reader:
        parent = reader.read_patches(offsets(30, spread=80), (50, 50)).sum().item()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(path, queue))
    child.start()
    assert queue.get(timeout=60) == parent
    child.join(timeout=60)
    assert child.exitcode == 0
