"""extract_patches against a naive loop, at the borders and for every dtype; geometry."""

from __future__ import annotations

import pytest
import torch

from ats_cli.core.patches import extract_patches
from ats_cli.core.source import low_res_size, low_res_view, positions_to_offsets


def naive(images, offsets, size):
    B, C, H, W = images.shape
    n = offsets.shape[1]
    out = torch.zeros(B, n, C, *size, dtype=images.dtype)
    for b in range(B):
        for k in range(n):
            r0, c0 = offsets[b, k].tolist()
            for i in range(size[0]):
                for j in range(size[1]):
                    r, c = r0 + i, c0 + j
                    if 0 <= r < H and 0 <= c < W:
                        out[b, k, :, i, j] = images[b, :, r, c]
    return out


def _images(dtype, B=2, C=3, H=13, W=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (B, C, H, W), generator=g, dtype=torch.uint8)
    return (torch.randn(B, C, H, W, generator=g) * 10).to(dtype)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32])
def test_matches_naive_loop_including_borders(dtype):
    images = _images(dtype)
    # inside, straddling every border and corner, wholly outside
    offsets = torch.tensor(
        [[[0, 0], [-2, -3], [10, 14], [-4, 8], [6, -5], [11, 15]],
         [[3, 4], [12, 16], [-6, -6], [20, 2], [5, 30], [-1, 0]]]
    )
    got = extract_patches(images, offsets, (4, 5))
    assert got.dtype == dtype and got.shape == (2, 6, 3, 4, 5)
    assert torch.equal(got, naive(images, offsets, (4, 5)))


def test_random_shapes_against_naive():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        B, C, H, W = (int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g)),
                      int(torch.randint(1, 20, (1,), generator=g)), int(torch.randint(1, 20, (1,), generator=g)))
        h, w = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        n = int(torch.randint(1, 6, (1,), generator=g))
        images = torch.randn(B, C, H, W, generator=g)
        offsets = torch.stack([torch.randint(-h, H + 1, (B, n), generator=g),
                               torch.randint(-w, W + 1, (B, n), generator=g)], -1)
        assert torch.equal(extract_patches(images, offsets, (h, w)), naive(images, offsets, (h, w)))


def test_gradient_flows_into_the_image_as_a_scatter_add():
    images = torch.zeros(1, 1, 6, 6, requires_grad=True)
    offsets = torch.tensor([[[0, 0], [1, 1]]])  # two overlapping 3x3 patches
    extract_patches(images, offsets, (3, 3)).sum().backward()
    expected = torch.zeros(6, 6)
    expected[0:3, 0:3] += 1
    expected[1:4, 1:4] += 1
    torch.testing.assert_close(images.grad[0, 0], expected)


def test_bad_arguments_are_clear_errors():
    images = torch.zeros(1, 1, 8, 8)
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        extract_patches(images[0], torch.zeros(1, 1, 2, dtype=torch.long), (2, 2))
    with pytest.raises(ValueError, match="offsets"):
        extract_patches(images, torch.zeros(2, 1, 2, dtype=torch.long), (2, 2))
    with pytest.raises(TypeError, match="integer"):
        extract_patches(images, torch.zeros(1, 1, 2), (2, 2))


def test_positions_map_to_patches_centred_on_the_cell_footprint():
    # 100x200 image, 10x20 attention map over a 10x20 low-res view: cells are 10x10 px.
    idx = torch.tensor([[0, 21, 199]])  # (0,0), (1,1), (9,19)
    off = positions_to_offsets(idx, (10, 20), (100, 200), (4, 4), low_size=(10, 20))
    centres = off + 2
    assert centres.tolist() == [[[5, 5], [15, 15], [95, 195]]]


def test_margin_of_a_valid_attention_net_shifts_positions():
    # low-res 12x12 view, attention 'valid' with receptive field 5 -> 8x8 map, margin 2
    idx = torch.tensor([[0]])
    off = positions_to_offsets(idx, (8, 8), (120, 120), (10, 10), low_size=(12, 12), margin=2)
    # cell (0,0) is low-res pixel 2 -> centre 2.5 low-res px -> 25 full-res px
    assert (off + 5).tolist() == [[[25, 25]]]


def test_pooled_attention_cells_cover_several_low_res_pixels():
    idx = torch.tensor([[3]])  # row 0, col 3 of a 4x4 map over a 32x32 view (pool 8)
    off = positions_to_offsets(idx, (4, 4), (320, 320), (20, 20), low_size=(32, 32))
    assert (off + 10).tolist() == [[[40, 280]]]


def test_per_image_sizes_in_one_batch():
    idx = torch.tensor([[0], [0]])
    off = positions_to_offsets(idx, (2, 2), torch.tensor([[100, 100], [1000, 10]]), (2, 2))
    assert (off + 1).tolist() == [[[25, 25]], [[250, 3]]]


def test_low_res_view_is_antialiased_and_scaled():
    img = torch.zeros(1, 100, 100, dtype=torch.uint8)
    img[:, ::2, :] = 255  # one-pixel stripes: aliasing would give all 0 or all 1
    low = low_res_view(img, 0.1)
    assert low.shape == (1, 10, 10) and low.dtype == torch.float32
    assert torch.allclose(low, torch.full_like(low, 0.5), atol=0.05)
    assert low_res_size((1500, 1500), 0.12) == (180, 180)
