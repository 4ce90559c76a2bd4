"""Where things are: the low-resolution view and the mapping from an attention
position to the full-resolution patch it stands for.

Every command that samples, reads or draws a patch goes through
:func:`positions_to_offsets`, so training, prediction and the heatmap boxes can never
disagree about where a patch is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ats_cli.core.transfer import to_device

__all__ = ["low_res_size", "low_res_view", "positions_to_offsets"]


def low_res_size(image_size: tuple[int, int], scale: float) -> tuple[int, int]:
    """Size (h, w) of the low-resolution view of an (H, W) image at ``scale`` (at least 1x1)."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    H, W = image_size
    return max(1, round(H * scale)), max(1, round(W * scale))


def low_res_view(image: torch.Tensor, scale: float) -> torch.Tensor:
    """Antialiased bilinear downsampling of ``image`` [C, H, W] or [B, C, H, W] to ``scale``.

    Antialiasing matters: without it a 0.12 view of a thin-stroked digit is a random
    subset of pixels, and the attention network sees aliasing instead of content.
    Returns float32 in the input's value range divided by 255 for uint8 (i.e. [0, 1]).
    """
    batched = image.dim() == 4
    x = image if batched else image[None]
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    size = low_res_size(tuple(x.shape[-2:]), scale)
    out = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    return out if batched else out[0]


def positions_to_offsets(
    indices: torch.Tensor,
    attention_shape: tuple[int, int],
    image_size: torch.Tensor | tuple[int, int],
    patch_size: tuple[int, int],
    *,
    low_size: tuple[int, int] | None = None,
    margin: int = 0,
) -> torch.Tensor:
    """Top-left corners [B, n, 2] (row, col) in full-resolution pixels of the patches for
    flat attention positions ``indices`` [B, n].

    The attention map [att_h, att_w] covers the low-resolution view [low_h, low_w] less
    ``margin`` low-res pixels on each side (a 'valid' attention network with receptive
    field r loses (r - 1) / 2 pixels per side; pooling in it makes one cell cover several
    low-res pixels, which the cell size below accounts for). A cell's footprint is mapped
    to full resolution by the ratio of the image size to the low-res size, and the patch
    is centred on the footprint's centre. ``image_size`` is (H, W), or a [B, 2] tensor
    when the images of a batch differ in size (slides).
    """
    att_h, att_w = attention_shape
    if low_size is None:
        low_size, margin = (att_h, att_w), 0
    low_h, low_w = low_size
    if low_h - 2 * margin < att_h or low_w - 2 * margin < att_w:
        raise ValueError(
            f"attention map {attention_shape} does not fit in low-res view {low_size} with margin {margin}"
        )
    if isinstance(image_size, torch.Tensor):  # [B, 2], one size per image: a (pinned, queued) copy
        sizes = to_device(image_size.to(torch.float64).reshape(-1, 1, 2), indices.device)
        zoom_r, zoom_c = sizes[..., 0] / low_h, sizes[..., 1] / low_w
    else:  # one size: Python floats, the same float64 division, nothing to copy to the device
        zoom_r, zoom_c = float(image_size[0]) / low_h, float(image_size[1]) / low_w
    row = torch.div(indices, att_w, rounding_mode="floor").double()
    col = (indices % att_w).double()
    cell_h = (low_h - 2 * margin) / att_h
    cell_w = (low_w - 2 * margin) / att_w
    centre_r = (margin + (row + 0.5) * cell_h) * zoom_r
    centre_c = (margin + (col + 0.5) * cell_w) * zoom_c
    top = torch.floor(centre_r - patch_size[0] / 2 + 0.5)
    left = torch.floor(centre_c - patch_size[1] / 2 + 0.5)
    return torch.stack([top, left], dim=-1).long()


