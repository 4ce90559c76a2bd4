"""From dataset records to model inputs: the low-res view is made here, in the
DataLoader workers, and the full-resolution image stays a uint8 tensor on the host.

The model then reads only the sampled patches from it, so the device never holds more
than the low-res views and n patches per image, whatever the image size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset as TorchDataset

from ats_cli.core.geometry import low_res_view
from ats_cli.core.source import TensorSource
from ats_cli.data.dataset import Record
from ats_cli.data.images import read_image

__all__ = ["ImageDataset", "Batch", "collate", "single_thread_worker"]


class ImageDataset(TorchDataset):
    """Records of one split -> (low-res view, full-res uint8 image, label, index)."""

    def __init__(self, records: Sequence[Record], *, channels: int, scale: float):
        self.records = list(records)
        self.channels = channels
        self.scale = scale

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        rec = self.records[i]
        image = read_image(rec.path, self.channels)
        return low_res_view(image, self.scale), image, rec.label, i


@dataclass
class Batch:
    low: torch.Tensor  # [B, C, h, w] float
    sources: torch.Tensor | list[TensorSource]  # full-res images, stacked when they share a size
    labels: torch.Tensor  # [B]
    indices: torch.Tensor  # [B] positions in the split

    def pin_memory(self) -> Batch:
        self.low = self.low.pin_memory()
        return self


def collate(items: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> Batch:
    lows, images, labels, indices = zip(*items, strict=True)
    if len({tuple(x.shape) for x in lows}) != 1:
        shapes = sorted({tuple(im.shape[-2:]) for im in images})
        raise ValueError(
            f"images of different sizes {shapes[:3]} in one batch; use --batch-size 1 for such datasets"
        )
    sources = torch.stack(images) if len({im.shape for im in images}) == 1 else [TensorSource(im) for im in images]
    return Batch(torch.stack(lows), sources, torch.tensor(labels), torch.tensor(indices))


def single_thread_worker(_: int) -> None:
    """DataLoader worker init: one intra-op thread per worker. Decoding and resizing are
    per-image work; letting every worker also spawn a full thread pool oversubscribes the
    cores and starves the training step (measured: 2x more system time on 2 cores)."""
    torch.set_num_threads(1)
