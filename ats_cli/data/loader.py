"""From dataset records to model inputs: the low-res view is made here, in the
DataLoader workers, and the full-resolution image stays on the host: a uint8 tensor for
ordinary images, a lazy reader for slides and TIFFs (the file is reopened in the
training process, see ``SlideReader.__reduce__``; it is never decoded whole).

The model then reads only the sampled patches from it, so the device never holds more
than the low-res views and n patches per image, whatever the image size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset as TorchDataset

from ats_cli.core.source import PatchSource
from ats_cli.data.dataset import Record
from ats_cli.data.images import ImageReadError
from ats_cli.data.inputs import batch_sources, batch_support, open_input

__all__ = ["ImageDataset", "Batch", "Unreadable", "collate", "readable", "single_thread_worker"]


Item = tuple[torch.Tensor, PatchSource, int, int, "torch.Tensor | None"]


@dataclass(frozen=True)
class Unreadable:
    """An input a DataLoader worker could not read. It travels to the training process as
    data and is raised there as :class:`ImageReadError` by :func:`readable`: raised inside
    the worker, torch would re-raise it wrapped in a RuntimeError with the worker's
    traceback as its message, instead of the one line naming the file."""

    path: str
    problem: str


class ImageDataset(TorchDataset):
    """Records of one split -> (low-res view, patch source, label, index, tissue mask or
    None), read by :func:`open_input` exactly as ``ats predict`` reads them: the source is
    the uint8 image in memory (``TensorSource``) or a lazy slide reader.

    ``reader``/``level``/``mpp``/``tissue`` are ``ats predict``'s options of the same
    names; a model trained with them is predicted with them (they are saved in its spec).
    ``view_cache``: where slides' low-res views and tissue masks are kept once made
    (:mod:`ats_cli.data.view_cache`); None: remade at every read. ``prepared``: a
    :class:`~ats_cli.data.prepared.PreparedStore`; an image with a fresh entry there is
    read from it (the same view and patches, bit for bit, without decoding), any other
    from its file.
    """

    def __init__(self, records: Sequence[Record], *, channels: int, scale: float,
                 patch_size: tuple[int, int] = (1, 1), reader: str | None = None, level: int | None = None,
                 mpp: float | None = None, tissue: bool | None = None, view_cache=None, prepared=None):
        self.records = list(records)
        self.prepared = prepared
        self.view_cache = view_cache
        self.channels = channels
        self.scale = scale
        self.options = {"patch_size": patch_size, "reader": reader, "level": level, "mpp": mpp, "tissue": tissue}

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Item | Unreadable:
        rec = self.records[i]
        try:
            opened = None if self.prepared is None else self.prepared.open_input(
                rec.path, patch_size=self.options["patch_size"], tissue=self.options["tissue"])
            if opened is None:
                opened = open_input(rec.path, channels=self.channels, scale=self.scale, view_cache=self.view_cache,
                                    **self.options)
        except ImageReadError as e:
            return Unreadable(str(e.path), e.problem)
        return opened.low, opened.source, rec.target, i, opened.support


@dataclass
class Batch:
    low: torch.Tensor  # [B, C, h, w] float
    sources: torch.Tensor | list[PatchSource]  # full-res images, stacked when they share a size
    labels: torch.Tensor  # [B] class indices, or [B, classes] multi-hot (multi-label)
    indices: torch.Tensor  # [B] positions in the split
    support: torch.Tensor | None = None  # [B, h, w] bool: tissue masks (True everywhere for images without one)

    def pin_memory(self) -> Batch:
        self.low = self.low.pin_memory()
        return self

    def support_on(self, device: torch.device) -> torch.Tensor | None:
        return None if self.support is None else self.support.to(device)


def collate(items: list[Item | Unreadable]) -> Batch | Unreadable:
    for item in items:
        if isinstance(item, Unreadable):
            return item
    lows, sources, labels, indices, masks = zip(*items, strict=True)
    if len({tuple(x.shape) for x in lows}) != 1:
        shapes = sorted({tuple(s.size) for s in sources})
        raise ValueError(
            f"images of different sizes {shapes[:3]} in one batch; use --batch-size 1 for such datasets"
        )
    return Batch(torch.stack(lows), batch_sources(sources), torch.tensor(labels), torch.tensor(indices),
                 batch_support(masks, lows[0].shape[-2:]))


def readable(loader: Iterable[Batch | Unreadable]) -> Iterator[Batch]:
    """The loader's batches; an input that could not be read stops the run here, in the
    training process, with an :class:`ImageReadError` naming the file."""
    for batch in loader:
        if isinstance(batch, Unreadable):
            raise ImageReadError(batch.path, batch.problem)
        yield batch


def single_thread_worker(_: int) -> None:
    """DataLoader worker init: one intra-op thread per worker. Decoding and resizing are
    per-image work; letting every worker also spawn a full thread pool oversubscribes the
    cores and starves the training step."""
    torch.set_num_threads(1)
