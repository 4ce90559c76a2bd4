"""The "patch source": the only thing the model needs from a full-resolution image.

Attention sampling never needs the whole full-resolution image: the attention network
sees a low-resolution view, and the feature network sees n patches. So the model asks
its input for exactly those n patches through this tiny interface, and an in-memory
tensor, a large TIFF read tile by tile or a whole-slide file can all stand behind it.

Where things are lives here too, because it is the other half of the same question
(what the model reads of an image): the low-resolution view and the mapping from an
attention position to the full-resolution patch it stands for. Every command that
samples, reads or draws a patch goes through :func:`positions_to_offsets`, so training,
prediction and the heatmap boxes can never disagree about where a patch is.

How a batch's reads travel lives here as well, since every read goes through this module:

* Lazy sources are read on named thread pools, one per process (:func:`thread_pool`).
  Named, because a batch's sources are read on one pool and each slide's tiles on another:
  a read of the first kind may wait for reads of the second without ever waiting for a
  thread of its own pool (one pool for both could fill every thread with waiting readers).
  Per process, because a DataLoader worker is a fork, and a pool copied by ``fork`` has no
  threads behind it (tasks submitted to it never run).
* Inputs go to the device by :func:`to_device`. A plain ``tensor.to("cuda")`` from pageable
  host memory is synchronous (CUDA stages the bytes through a pinned buffer and torch waits
  for the copy), so the host could not queue the next kernels meanwhile. From pinned memory
  the copy is a DMA the host only enqueues (``non_blocking=True``); torch's caching host
  allocator keeps a pinned block alive until the copy that reads it has run, so the host
  tensor may be dropped right after the call.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from ats_cli.core.patches import extract_patches

__all__ = ["PatchSource", "TensorSource", "gather_patches", "gather_some", "source_shapes", "source_sizes",
           "uniform_shape", "low_res_size", "low_res_view", "positions_to_offsets", "READ_THREADS", "thread_pool",
           "to_device"]


READ_THREADS = 8  # enough to overlap the waits of a batch's reads; the decoding itself is short
_pools: dict[str, tuple[int, ThreadPoolExecutor]] = {}
_lock = threading.Lock()


def thread_pool(name: str) -> ThreadPoolExecutor:
    """This process's pool ``name`` of :data:`READ_THREADS` threads, started on first use."""
    with _lock:
        pid, pool = _pools.get(name, (None, None))
        if pid != os.getpid():
            pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix=f"ats-{name}")
            _pools[name] = (os.getpid(), pool)
        return pool


def to_device(tensor: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    """``tensor`` on ``device``, copied asynchronously (pinned first) when it goes from the
    host to a CUDA device; unchanged when it is there already; None stays None."""
    if tensor is None:
        return None
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


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


def gather_some(sources: Sources, offsets: torch.Tensor, size: tuple[int, int], mask: torch.Tensor) -> torch.Tensor:
    """The patches [m, C, h, w] of a batch that ``mask`` [B, n] (bool, host) selects, in
    row-major (image, draw) order: what :func:`gather_patches` gives, less the others. A
    lazy source reads only those (the feature store's misses: :mod:`ats_cli.data.features`);
    a batch in one tensor is cut whole and indexed (cutting is cheap next to a read)."""
    if isinstance(sources, torch.Tensor):
        return gather_patches(sources, offsets, size)[mask.to(offsets.device)]
    host = offsets.cpu()
    wanted = [k for k in range(len(sources)) if bool(mask[k].any())]
    read = lambda k: sources[k].read_patches(host[k][mask[k]], size)  # noqa: E731
    lazy = len(wanted) > 1 and not all(isinstance(sources[k], TensorSource) for k in wanted)
    return torch.cat(list(thread_pool("sources").map(read, wanted) if lazy else map(read, wanted)))


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
    views: Sequence[tuple[int, int]] | None = None,
    grids: Sequence[tuple[int, int]] | None = None,
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

    A batch of views of different sizes (padded bottom/right to one tensor, see
    :class:`ats_cli.data.inputs.Batch`) gives ``views``, each image's own low-res (h, w),
    and ``grids``, each image's own attention grid (att_h, att_w) in the top-left corner
    of the padded grid ``attention_shape`` (host ints, B pairs each): an index is read as
    a (row, col) of the padded grid and mapped with its own image's geometry, in the same
    float64 operations as that image alone, so its patch is the one it would be alone.
    """
    att_h, att_w = attention_shape
    if views is not None and grids is not None:
        for view, grid in zip(views, grids, strict=True):
            _check_fits(grid, view, margin)
        geometry = torch.tensor([[*v, *g] for v, g in zip(views, grids, strict=True)], dtype=torch.float64)
        geometry = to_device(geometry.reshape(-1, 1, 4), indices.device)
        low_h, low_w, own_h, own_w = geometry.unbind(-1)
    else:
        if low_size is None:
            low_size, margin = (att_h, att_w), 0
        _check_fits(attention_shape, low_size, margin)
        low_h, low_w = low_size
        own_h, own_w = att_h, att_w
    if isinstance(image_size, torch.Tensor):  # [B, 2], one size per image: a (pinned, queued) copy
        sizes = to_device(image_size.to(torch.float64).reshape(-1, 1, 2), indices.device)
        zoom_r, zoom_c = sizes[..., 0] / low_h, sizes[..., 1] / low_w
    else:  # one size: Python floats, the same float64 division, nothing to copy to the device
        zoom_r, zoom_c = float(image_size[0]) / low_h, float(image_size[1]) / low_w
    row = torch.div(indices, att_w, rounding_mode="floor").double()
    col = (indices % att_w).double()
    cell_h = (low_h - 2 * margin) / own_h
    cell_w = (low_w - 2 * margin) / own_w
    centre_r = (margin + (row + 0.5) * cell_h) * zoom_r
    centre_c = (margin + (col + 0.5) * cell_w) * zoom_c
    top = torch.floor(centre_r - patch_size[0] / 2 + 0.5)
    left = torch.floor(centre_c - patch_size[1] / 2 + 0.5)
    return torch.stack([top, left], dim=-1).long()


def _check_fits(attention_shape: Sequence[int], low_size: Sequence[int], margin: int) -> None:
    (att_h, att_w), (low_h, low_w) = attention_shape, low_size
    if low_h - 2 * margin < att_h or low_w - 2 * margin < att_w:
        raise ValueError(
            f"attention map {tuple(attention_shape)} does not fit in low-res view {tuple(low_size)} with margin "
            f"{margin}"
        )
