"""Vectorised extraction of fixed-size patches at arbitrary positions.

This is the only place that reads pixels at full resolution for an in-memory image,
so it must be exact at the borders (zeros outside the image, like the reference op)
and keep the input dtype: a uint8 slide region is 4x smaller than its float copy, and
conversion happens after extraction, on the few patches only.
"""

from __future__ import annotations

import torch

from ats_cli.core import native

__all__ = ["extract_patches", "extract_patches_torch"]


def extract_patches(images: torch.Tensor, offsets: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Patches [B, n, C, h, w] of ``images`` [B, C, H, W] at ``offsets`` [B, n, 2].

    Uses the native kernel of ``csrc/`` where one is active for the device (CUDA, built
    on first use; see :mod:`ats_cli.core.native`), otherwise :func:`extract_patches_torch`.
    Both give identical values; the kernel's backward is the same scatter-add.
    """
    _check(images, offsets, size)
    module = native.kernel_for(images)
    if module is None:
        return extract_patches_torch(images, offsets, size)
    offsets = offsets.to(device=images.device, dtype=torch.long)
    return native.ExtractPatches.apply(module, images, offsets, int(size[0]), int(size[1]))


def _check(images: torch.Tensor, offsets: torch.Tensor, size: tuple[int, int]) -> None:
    if images.dim() != 4:
        raise ValueError(f"images must be [B, C, H, W], got shape {tuple(images.shape)}")
    B, C, H, W = images.shape
    if offsets.dim() != 3 or offsets.shape[0] != B or offsets.shape[2] != 2:
        raise ValueError(f"offsets must be [B={B}, n, 2], got shape {tuple(offsets.shape)}")
    if offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
        raise TypeError(f"offsets must be an integer tensor, got {offsets.dtype}")
    if int(size[0]) < 1 or int(size[1]) < 1:
        raise ValueError(f"patch size must be positive, got {size}")
    if H < 1 or W < 1:
        raise ValueError(f"images must not be empty, got shape {tuple(images.shape)}")


def extract_patches_torch(images: torch.Tensor, offsets: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Patches [B, n, C, h, w] of ``images`` [B, C, H, W] at ``offsets`` [B, n, 2].

    ``offsets[b, k] = (row, col)`` is the top-left corner of patch k of image b, in
    pixels of ``images``; it may lie partly or wholly outside the image, where the
    patch is zero. One gather for all (image, patch, row, col) at once: no Python loop
    over patches, works for every dtype and device torch indexes (uint8, float16,
    bfloat16, float32 on CPU and CUDA), and is differentiable w.r.t. float ``images``
    (the backward is a scatter-add into the image).
    """
    _check(images, offsets, size)
    B, C, H, W = images.shape
    h, w = int(size[0]), int(size[1])
    offsets = offsets.to(device=images.device, dtype=torch.long)
    rows = offsets[:, :, 0, None] + torch.arange(h, device=images.device)  # [B, n, h]
    cols = offsets[:, :, 1, None] + torch.arange(w, device=images.device)  # [B, n, w]
    inside = ((rows >= 0) & (rows < H))[:, :, :, None] & ((cols >= 0) & (cols < W))[:, :, None, :]
    rows = rows.clamp(0, H - 1)[:, :, :, None]  # [B, n, h, 1]
    cols = cols.clamp(0, W - 1)[:, :, None, :]  # [B, n, 1, w]
    batch = torch.arange(B, device=images.device)[:, None, None, None]
    # Advanced indices separated by a slice put their broadcast shape first: [B, n, h, w, C].
    patches = images[batch, :, rows, cols]
    patches = patches.masked_fill(~inside[..., None], 0)
    return patches.permute(0, 1, 4, 2, 3)
