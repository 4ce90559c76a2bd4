"""Reading ordinary image files (the ``pillow`` backend of :mod:`ats_cli.data.dataset`:
PNG, JPEG, ...) into uint8 arrays and tensors, with errors that name the file.

:func:`decode_pil` is the one PIL decoder (:func:`read_image` and the slide module's
``PillowReader`` both use it) and :data:`PIL_MODES` the one table of what each PIL mode
becomes, so an image reads the same whichever path reaches it. torch is imported only by
the functions that return tensors: the torch-free from-folder converter reads headers
here too.

Images stay uint8 on the host: a 1500x1500 grayscale image is 2.25 MB as uint8 and 9 MB
as float32, and only the low-res view and the sampled patches are ever converted.

Memory is bounded by a pixel budget (:func:`max_pixels_limit`: ``--max-pixels``, else
``ATS_MAX_PIXELS``, else ``DEFAULT_MAX_PIXELS``) checked from the file's header before
anything is decoded: a PNG or JPEG is decoded whole, so one larger than the budget is
refused by name (it replaces PIL's decompression-bomb guard, which raised an exception
of its own). The slide readers apply the same budget to what they decode at once.

What is decoded is the image as a viewer shows it, once: the EXIF orientation of a
phone or camera JPEG is applied (a portrait photo stored sideways is read upright, as
every photo viewer and the user's own eye see it; the low-res view and the patches both
come from that one decoded array, so they agree). A file of several frames (an animated
GIF, APNG or WebP, a multi-page image) is refused by name rather than read as its first
frame: which frame is "the image" is the user's call, and a silent first frame answers
for a picture nobody chose. A camera's MPO JPEG is the exception (its extra frame is a
preview of the same photo). A directory given as an image is named as a directory.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps

from ats_cli.data.remote import ImageReadError, RemoteReadError  # defined with the inputs they name

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_MAX_PIXELS", "PIL_MODES", "ImageReadError", "RemoteReadError", "decode_pil", "max_pixels_limit",
           "open_pil", "over_budget", "pil_channels", "read_image", "resize_in_bands", "to_model_pixels"]

# The most pixels decoded at once from one input. 64 M (8000 x 8000) keeps the peak memory
# of ats predict / info / visualize on any input near 1.5 GB (figures: docs/runs-and-inputs.md).
# PIL holds RGB in 4 bytes a pixel while it decodes.
DEFAULT_MAX_PIXELS = 64_000_000
log = logging.getLogger(__name__)
MAX_PIXELS_ENV = "ATS_MAX_PIXELS"
BAND_BYTES = 64 << 20  # float32 bytes converted at once by resize_in_bands
_PIL_GUARD = threading.Lock()  # Image.MAX_IMAGE_PIXELS is process-wide

# The one PIL mode table: what an image of each mode is converted to before use. Models
# take gray (1 channel) or RGB (3), so alpha is flattened onto white (a transparent
# background would be a fourth channel the model never saw: :func:`to_model_pixels`) and
# palette, CMYK, YCbCr, ... become RGB; a
# mode not listed becomes RGB too. None: refused, since 16/32-bit samples have no one
# right 8-bit mapping (clip, or scale from which range?): the user converts them knowingly.
PIL_MODES: dict[str, str | None] = {
    "1": "L", "L": "L", "LA": "L", "La": "L",
    "P": "RGB", "PA": "RGB", "RGB": "RGB", "RGBA": "RGB", "RGBa": "RGB", "RGBX": "RGB", "CMYK": "RGB",
    "YCbCr": "RGB", "LAB": "RGB", "HSV": "RGB",
    "I": None, "I;16": None, "I;16B": None, "I;16L": None, "I;16N": None, "F": None,
}
_CHANNELS = {"L": 1, "RGB": 3}
# Formats whose extra frames are not more images: a camera's MPO JPEG holds the photo and
# a preview (or the second view of a stereo pair); the first frame is the photo.
SINGLE_IMAGE_FORMATS = frozenset({"MPO"})


def max_pixels_limit(max_pixels: int | None = None) -> int:
    """The pixel budget: ``max_pixels`` when given, else ``$ATS_MAX_PIXELS``, else
    ``DEFAULT_MAX_PIXELS``."""
    if max_pixels is not None:
        return int(max_pixels)
    text = os.environ.get(MAX_PIXELS_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_PIXELS
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{MAX_PIXELS_ENV}={text!r}: give a positive number of pixels, e.g. 400000000")
    return value


def over_budget(path: str | os.PathLike[str], what: str, pixels: int, limit: int) -> ImageReadError:
    """The refusal of a read larger than the pixel budget: names the file, the size, the
    limit and how to raise it."""
    return ImageReadError(path, f"{what}: {pixels:,} pixels to decode at once, over the limit of {limit:,} pixels; "
                          f"raise it with --max-pixels N or {MAX_PIXELS_ENV}=N if this machine has the memory "
                          "(a tiled pyramidal TIFF is read without such large decodes)")


def _open_unguarded(path: str | os.PathLike[str]) -> Image.Image:
    """``Image.open`` (the header only) without PIL's decompression-bomb guard, which
    the pixel budget replaces."""
    with _PIL_GUARD:
        saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            return Image.open(path)
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def open_pil(path: str | os.PathLike[str], max_pixels: int | None = None) -> Image.Image:
    """``Image.open`` with the pixel budget in place of PIL's decompression-bomb guard:
    only the header is read, and an image larger than the budget is refused by name
    before anything is decoded. Raises what ``Image.open`` raises for unreadable files."""
    limit = max_pixels_limit(max_pixels)
    im = _open_unguarded(path)
    if im.width * im.height > limit:
        im.close()
        raise over_budget(path, f"{im.width}x{im.height} (width x height)", im.width * im.height, limit)
    return im


def _target_mode(path: str | os.PathLike[str], mode: str) -> str:
    """:data:`PIL_MODES`' conversion for ``mode``; ImageReadError for a refused one."""
    target = PIL_MODES.get(mode, "RGB")
    if target is None:
        raise ImageReadError(path, f"{mode} (16/32-bit) images are not supported; convert to 8-bit")
    return target


def pil_channels(path: str | os.PathLike[str]) -> int | None:
    """The channels :func:`decode_pil` gives ``path`` (1 or 3), from the header alone;
    None when PIL cannot open it or its mode is refused."""
    try:
        with _open_unguarded(path) as im:
            return _CHANNELS[_target_mode(path, im.mode)]
    except (OSError, SyntaxError, ValueError):  # ImageReadError is a ValueError
        return None


def pil_size(path: str | os.PathLike[str], max_pixels: int | None = None) -> tuple[int, int] | None:
    """The (height, width) :func:`decode_pil` gives ``path``, from the header alone: a photo
    whose EXIF orientation turns it a quarter counts turned. None when PIL cannot open it or
    it is over the pixel budget. A PNG's EXIF is read where the PNG spec puts it, before the
    pixels: asking PIL for one it has not met there decodes the whole image to look after
    them, a full decode per file where a header read was meant."""
    try:
        with open_pil(path, max_pixels) as im:
            w, h = im.size
            exif = im.getexif() if im.format != "PNG" or "exif" in im.info else {}
            turned = exif.get(0x0112, 1) in (5, 6, 7, 8)  # the orientations that swap the sides
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):  # ImageReadError is a ValueError
        return None
    return (w, h) if turned else (h, w)


_SAID: set[str] = set()  # the conversions already logged in this process
_SAID_LOCK = threading.Lock()


def _say_once(kind: str, message: str) -> None:
    """Log ``message`` the first time this process makes a ``kind`` of conversion: a
    dataset of 10,000 RGBA scans gets one line, not 10,000."""
    with _SAID_LOCK:
        if kind in _SAID:
            return
        _SAID.add(kind)
    log.warning("ats: %s", message)


def _has_alpha(im: Image.Image) -> bool:
    return im.mode in ("RGBA", "RGBa", "LA", "La", "PA") or (im.mode in ("P", "L", "RGB") and "transparency" in im.info)


def to_model_pixels(im: Image.Image, path: str | os.PathLike[str], channels: int | None = None) -> np.ndarray:
    """The one place where an image's channels become a model's: ``im`` (loaded, upright) as
    uint8 [H, W, C], C = ``channels`` (1 or 3) or, when None, the file's own (gray stays 1,
    anything else 3). The same function serves training, prediction and visualize, so a
    model sees a file's pixels the same way in all three. Each conversion is logged once
    per process (it is not silent, and a cohort does not repeat it).

    The decisions, and why:

    - transparency (RGBA, LA, a palette or gray PNG with a transparent colour) is
      composited on white, not dropped. The colour stored under a transparent pixel is
      whatever the writing program left there, most often black: dropping alpha shows the
      model a black background no viewer shows (a cut-out scan on black reads as dense
      tissue or ink). White is the background of a brightfield slide and of a page; an
      opaque image is unchanged, and says nothing.
    - gray -> RGB (an RGB model given a gray image) copies the gray into the three planes:
      what a viewer shows, and it loses nothing.
    - RGB -> gray (a gray model given a colour image) takes the luma PIL's ``L`` mode gives
      (ITU-R 601: 0.299 R + 0.587 G + 0.114 B), so a colour file reads as the gray file a
      user would save from it; a colour image whose three planes are equal is read exactly.
    """
    native = _CHANNELS[_target_mode(path, im.mode)]  # gray stays gray; any other mode is colour
    if _has_alpha(im):
        rgba = np.asarray(im if im.mode == "RGBA" else im.convert("RGBA"))
        if (rgba[..., 3] < 255).any():
            _say_once("alpha", f"transparent pixels are composited on white (first: {path})")
        flat = np.empty(rgba.shape[:2] + (3,), np.uint8)
        for r0 in range(0, rgba.shape[0], 256):  # in bands: uint16 temporaries of a band only
            band = rgba[r0:r0 + 256].astype(np.uint16)
            alpha = band[..., 3:]
            flat[r0:r0 + 256] = (band[..., :3] * alpha + 255 * (255 - alpha) + 127) // 255
        del rgba
        im = Image.fromarray(flat)  # RGB; a gray source's three planes are equal, so its L below is exact
    want = channels or native
    if want == 3 and native == 1:
        _say_once("gray->rgb", f"gray images are given to this RGB model with the gray in each channel "
                               f"(first: {path})")
    elif want == 1 and native == 3:
        _say_once("rgb->gray", f"colour images are converted to gray (luma: 0.299 R + 0.587 G + 0.114 B) "
                               f"for this 1-channel model (first: {path})")
    arr = np.array(im if im.mode == ("L" if want == 1 else "RGB") else im.convert("L" if want == 1 else "RGB"))
    return arr[:, :, None] if arr.ndim == 2 else arr


def decode_pil(path: str | os.PathLike[str], max_pixels: int | None = None,
               channels: int | None = None) -> np.ndarray:
    """The one PIL decoder: ``path`` as a uint8 array [H, W, C] with C = ``channels`` or,
    when None, 1 (gray) or 3 (RGB), converted by :data:`PIL_MODES` and
    :func:`to_model_pixels`. An image of more than ``max_pixels`` pixels
    (:func:`max_pixels_limit`) or of a refused mode is refused from its header, before
    decoding; every failure is an :class:`ImageReadError` naming the file. A URL is fetched
    whole first (:func:`ats_cli.data.remote.fetch_bytes`), then decoded the same way."""
    from ats_cli.data.remote import fetch_bytes, is_url

    if is_url(path):
        import io

        url, data = path, fetch_bytes(path)
        try:
            return _decode(io.BytesIO(data), url, max_pixels, channels)
        except ImageReadError as e:
            raise ImageReadError(url, e.problem) from e.__cause__
    path = Path(path)
    if not path.exists():
        raise ImageReadError(path, "does not exist")
    if path.is_dir():
        raise ImageReadError(path, "is a directory, not an image file")
    return _decode(path, path, max_pixels, channels)


def _decode(source, path, max_pixels: int | None, channels: int | None) -> np.ndarray:
    """:func:`decode_pil` of ``source`` (a path or a file object), errors naming ``path``."""
    try:
        with open_pil(source, max_pixels) as im:
            _target_mode(path, im.mode)  # a refused mode is refused before decoding
            frames = getattr(im, "n_frames", 1)
            if frames > 1 and im.format not in SINGLE_IMAGE_FORMATS:
                raise ImageReadError(path, f"has {frames} frames (an animation or a multi-page file); ats reads one "
                                     "image per file: save the frame you mean as its own image")
            im.load()
            shown = ImageOps.exif_transpose(im)  # as a photo viewer shows it (module docstring)
            return to_model_pixels(shown, path, channels)  # a writable copy
    except ImageReadError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageReadError(path, f"cannot decode image ({type(e).__name__}: {e})") from e


def resize_in_bands(rows: Callable[[int, int], torch.Tensor], shape: tuple[int, int, int], size: tuple[int, int],
                    *, divide: float = 1.0, align: int = 1) -> torch.Tensor:
    """``F.interpolate(x.float() / divide, size, bilinear, antialias=True)`` of an image
    [C, H, W] whose uint8 rows ``rows(r0, r1)`` ([C, r1 - r0, W]) are read on demand, bit
    for bit, while holding only one band of rows in float32 (``BAND_BYTES``).

    PyTorch's antialiased resize is separable, width first: resizing the width of each
    band of rows (rows are independent) and then the height of the [C, H, w] result gives
    exactly its output. ``align``: read the rows in multiples of this (a TIFF's strip or
    tile height), so that no segment is decoded twice.
    """
    import torch
    import torch.nn.functional as F

    C, H, W = shape
    th, tw = int(size[0]), int(size[1])
    band = max(1, BAND_BYTES // (4 * max(C, 1) * max(W, 1)))
    read = max(align, band // align * align)
    wide = torch.empty((1, C, H, tw), dtype=torch.float32)  # the width-resized image, filled band by band
    for r0 in range(0, H, read):
        block = rows(r0, min(H, r0 + read))
        for s0 in range(0, block.shape[1], band):
            x = block[:, s0:s0 + band].float()
            if divide != 1.0:
                x = x / divide
            wide[0, :, r0 + s0:r0 + s0 + x.shape[1]] = F.interpolate(
                x[None], size=(x.shape[1], tw), mode="bilinear", align_corners=False, antialias=True)[0]
        del block
    return F.interpolate(wide, size=(th, tw), mode="bilinear", align_corners=False, antialias=True)[0]


def read_image(path: str | os.PathLike[str], channels: int | None = None, *,
               max_pixels: int | None = None) -> torch.Tensor:
    """Read ``path`` as a uint8 tensor [C, H, W].

    ``channels`` (1 or 3) is what the model expects: gray, colour and transparency are
    converted to it by :func:`to_model_pixels` (which says why, and logs each conversion
    once). An image of more than ``max_pixels`` pixels (:func:`max_pixels_limit`) is
    refused from its header, before decoding.
    """
    import torch

    arr = decode_pil(path, max_pixels, channels)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
