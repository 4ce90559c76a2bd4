"""The "patch source": the only thing the model needs from a full-resolution image.

Attention sampling never needs the whole full-resolution image: the attention network
sees a low-resolution view, and the feature network sees n patches. So the model asks
its input for exactly those n patches through this tiny interface, and an in-memory
tensor, a large TIFF read tile by tile or a whole-slide file can all stand behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from ats_cli.core.patches import extract_patches

__all__ = ["PatchSource", "TensorSource", "gather_patches", "source_sizes"]


@runtime_checkable
class PatchSource(Protocol):
    """A full-resolution image that can hand out patches.

    ``size`` is (H, W) in full-resolution pixels and ``channels`` the channel count.
    ``read_patches(offsets, size)`` takes top-left corners [n, 2] (row, col) and returns
    [n, C, h, w] (uint8 for 8-bit images, float otherwise), zeros outside the image.
    """

    @property
    def size(self) -> tuple[int, int]: ...

    @property
    def channels(self) -> int: ...

    def read_patches(self, offsets: torch.Tensor, size: tuple[int, int]) -> torch.Tensor: ...


class TensorSource:
    """A patch source over an image tensor [C, H, W] already in memory."""

    def __init__(self, image: torch.Tensor):
        if image.dim() != 3:
            raise ValueError(f"TensorSource needs a [C, H, W] tensor, got shape {tuple(image.shape)}")
        self.image = image

    @property
    def size(self) -> tuple[int, int]:
        return int(self.image.shape[1]), int(self.image.shape[2])

    @property
    def channels(self) -> int:
        return int(self.image.shape[0])

    def read_patches(self, offsets: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return extract_patches(self.image[None], offsets[None], size)[0]


Sources = torch.Tensor | Sequence[PatchSource]


def source_sizes(sources: Sources) -> torch.Tensor:
    """Full-resolution sizes [B, 2] of a batch given as a tensor [B, C, H, W] or as sources."""
    if isinstance(sources, torch.Tensor):
        return torch.tensor([list(sources.shape[-2:])] * sources.shape[0], dtype=torch.long)
    return torch.tensor([list(s.size) for s in sources], dtype=torch.long)


def gather_patches(sources: Sources, offsets: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Patches [B, n, C, h, w] for a batch: one vectorised extraction when the batch is a
    tensor (on its own device), otherwise one ``read_patches`` call per image."""
    if isinstance(sources, torch.Tensor):
        return extract_patches(sources, offsets, size)
    if len(sources) != offsets.shape[0]:
        raise ValueError(f"{len(sources)} patch sources for a batch of {offsets.shape[0]}")
    return torch.stack([src.read_patches(off.cpu(), size) for src, off in zip(sources, offsets, strict=True)])
