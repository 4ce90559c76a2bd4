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
from ats_cli.core.threads import thread_pool

__all__ = ["PatchSource", "TensorSource", "gather_patches", "source_shapes", "source_sizes", "uniform_shape"]


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


def source_shapes(sources: Sources) -> list[tuple[int, int]]:
    """Full-resolution (H, W) of each image of a batch, as Python ints: known on the host
    without reading anything from a device (a tensor's shape is host metadata)."""
    if isinstance(sources, torch.Tensor):
        return [(int(sources.shape[-2]), int(sources.shape[-1]))] * sources.shape[0]
    return [(int(s.size[0]), int(s.size[1])) for s in sources]


def source_sizes(sources: Sources) -> torch.Tensor:
    """Full-resolution sizes [B, 2] (host, int64) of a batch given as a tensor [B, C, H, W] or as sources."""
    return torch.tensor(source_shapes(sources), dtype=torch.long).reshape(-1, 2)


def uniform_shape(shapes: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """The (H, W) every image of the batch shares, or None when they differ."""
    return shapes[0] if shapes and all(s == shapes[0] for s in shapes) else None


def gather_patches(sources: Sources, offsets: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Patches [B, n, C, h, w] for a batch: one vectorised extraction when the batch is a
    tensor (on its own device: no host round trip when it is the offsets' device),
    otherwise one ``read_patches`` call per image on the host.

    Lazy sources read on the host what the device drew, so their offsets cross to the host
    once per batch (one transfer for the whole batch, never one per image), and the images
    are read concurrently (their reads release the GIL: file reads, zlib, codecs; in-memory
    images are cut one after the other, each by a kernel that has the intra-op threads)."""
    if isinstance(sources, torch.Tensor):
        return extract_patches(sources, offsets, size)
    if len(sources) != offsets.shape[0]:
        raise ValueError(f"{len(sources)} patch sources for a batch of {offsets.shape[0]}")
    host = offsets.cpu()
    read = lambda k: sources[k].read_patches(host[k], size)  # noqa: E731
    ks = range(len(sources))
    lazy = len(sources) > 1 and not all(isinstance(src, TensorSource) for src in sources)
    return torch.stack(list(thread_pool("sources").map(read, ks) if lazy else map(read, ks)))
