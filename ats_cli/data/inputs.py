"""From an input file to what the model needs: low-res view, patch source, tissue mask.

:func:`open_input` is the one place this happens, for ``ats predict``, ``ats visualize``
and training's data loader alike, so an image is read the same way in all three.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ats_cli.core.source import PatchSource, TensorSource, low_res_size
from ats_cli.data.formats import is_lazy  # importable from here as before
from ats_cli.data.images import ImageReadError, read_image, resize_in_bands

__all__ = ["OpenedImage", "open_input", "is_lazy", "batch_sources", "batch_support"]


@dataclass
class OpenedImage:
    """An input ready for the model: its low-res view [C, h, w] (float, [0, 1]) and the
    patch source standing for the full-resolution image."""

    low: torch.Tensor
    source: PatchSource
    support: torch.Tensor | None = None  # bool [h, w] over ``low``: where sampling may go (tissue mask)
    reading: str | None = None  # how a slide was read (level, resampling), one line: ats_cli.data.magnification


def low_res_view(image: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`ats_cli.core.source.low_res_view` of a uint8 image [C, H, W], bit for bit,
    converting one band of rows to float at a time: the whole image in float32 would be
    four times its size (1.2 GB for a 10000x10000 RGB image), twice over."""
    C, H, W = image.shape
    return resize_in_bands(lambda r0, r1: image[:, r0:r1], (C, H, W), low_res_size((H, W), scale), divide=255.0)


def open_input(path: str | os.PathLike[str], *, channels: int, scale: float,
               patch_size: tuple[int, int], reader: str | None = None, level: int | None = None,
               mpp: float | None = None, tissue: bool | None = None, max_pixels: int | None = None,
               resample: bool = True, view_cache=None) -> OpenedImage:
    """Read one input file into (low-res view, patch source): the only function that
    knows how files are read.

    TIFFs and whole-slide formats (or any file when ``reader`` is given) go through the
    lazy readers of :mod:`ats_cli.data.slides`: the view comes from a small pyramid level
    and patches are decoded tile by tile at the sampled positions, so memory does not grow
    with the slide. ``level``/``mpp`` choose the level patches are read from; with
    ``resample`` (the default) ``mpp`` is a physical scale to match: a file that records
    its microns per pixel is read from the level at or below ``mpp`` and resampled to it
    (:meth:`~ats_cli.data.slides.SlideReader.match_mpp`), any other file at ``level`` as
    it is (``reading`` says so); without it
    ``mpp`` picks the closest level, read as it is, and a file
    without mpp is refused. ``tissue`` (default: on for slides read lazily, off for
    ordinary images) restricts sampling to
    the Otsu tissue mask. Other files are read whole with :func:`read_image`, as before.
    ``max_pixels`` is the pixel budget of :mod:`ats_cli.data.slides` (default
    ``ATS_MAX_PIXELS``, else 64 M): larger reads are refused from the file's header.
    ``mpp`` 0 means off, as ``--mpp 0`` does in training: no physical scale is matched and
    the file is read at ``level`` as it is (the way to read a file whose metadata gives
    an implausible scale, which matching refuses: :mod:`ats_cli.data.scale_bounds`).

    An image smaller than a patch in either dimension is refused: zero padding would make
    it run, but every patch would then be mostly padding the model never saw in training,
    and the prediction would look confident while meaning little. Raises
    :class:`ImageReadError` naming the file.
    """
    from ats_cli.data.magnification import describe_reading
    from ats_cli.data.slides import open_image, tissue_mask

    if not mpp:  # --mpp 0 (and a model that records none): off, read by level as it is
        mpp = None
    lazy = is_lazy(path, reader, level, None if resample else mpp)
    note = None
    if lazy:
        slide = open_image(path, reader=reader or "auto", max_pixels=max_pixels).as_channels(channels)
        if resample and mpp is not None and slide.mpp is not None:
            slide.match_mpp(mpp)
        else:
            slide.set_level(level, None if resample else mpp)
        low, mask = view_cache.view(slide, scale) if view_cache is not None else (slide.low_res_view(scale), None)
        source: PatchSource = slide
        note = describe_reading(slide, mpp if resample else None)
    else:
        image = read_image(path, channels, max_pixels=max_pixels)
        low, source, mask = low_res_view(image, scale), TensorSource(image), None
    H, W = source.size
    ph, pw = patch_size
    if H < ph or W < pw:
        raise ImageReadError(path, f"is {W}x{H} pixels (width x height), smaller than the model's {pw}x{ph} patch")
    support = (tissue_mask(low) if mask is None else mask) if (lazy if tissue is None else tissue) else None
    return OpenedImage(low=low, source=source, support=support, reading=note)


def batch_sources(sources: Sequence[PatchSource]) -> torch.Tensor | list[PatchSource]:
    """A batch's patch sources as the model takes them: one [B, C, H, W] tensor when every
    source is an in-memory image of one size (one vectorised patch extraction), else the
    sources themselves (lazy readers, or images of different sizes)."""
    if all(isinstance(s, TensorSource) for s in sources) and len({s.image.shape for s in sources}) == 1:
        return torch.stack([s.image for s in sources])
    return list(sources)


def batch_support(masks: Sequence[torch.Tensor | None], view_shape: Sequence[int]) -> torch.Tensor | None:
    """A batch's tissue masks [B, h, w] (True everywhere for an input without one), or
    None when no input has one. ``view_shape``: the (h, w) the batch's views share."""
    if all(m is None for m in masks):
        return None
    everywhere = torch.ones(tuple(view_shape), dtype=torch.bool)
    return torch.stack([everywhere if m is None else m for m in masks])

