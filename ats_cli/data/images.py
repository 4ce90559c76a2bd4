"""Reading ordinary image files (PNG, JPEG, TIFF) into uint8 tensors, with errors that
name the file.

Images stay uint8 on the host: a 1500x1500 grayscale image is 2.25 MB as uint8 and 9 MB
as float32, and only the low-res view and the sampled patches are ever converted.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

__all__ = ["ImageReadError", "read_image", "IMAGE_SUFFIXES"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
_MODES = {1: "L", 3: "RGB"}


class ImageReadError(ValueError):
    """An image file that cannot be used; the message names the file and the problem."""

    def __init__(self, path: str | os.PathLike[str], problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def read_image(path: str | os.PathLike[str], channels: int | None = None) -> torch.Tensor:
    """Read ``path`` as a uint8 tensor [C, H, W].

    ``channels`` (1 or 3) is what the model expects. Grayscale and RGB are converted
    into each other on purpose only when the conversion loses nothing a user would miss
    (gray -> RGB replicates; RGB whose three planes are equal -> gray); a colour image
    given to a grayscale model is an error rather than a silent conversion, since the
    model never saw colour. Alpha is dropped.
    """
    path = Path(path)
    if not path.exists():
        raise ImageReadError(path, "file not found")
    try:
        with Image.open(path) as im:
            im.load()
            mode = im.mode
            if mode in ("I;16", "I;16B", "I;16L", "I"):
                raise ImageReadError(path, f"{mode} (16/32-bit) images are not supported; convert to 8-bit")
            if mode in ("1", "LA"):
                im = im.convert("L")
            elif mode != "L" and mode != "RGB":  # RGBA, P, CMYK, YCbCr, ...
                im = im.convert("RGB")
            arr = np.array(im)  # a writable copy owned by the tensor
    except ImageReadError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageReadError(path, f"{e} (very large images need the whole-slide readers)") from e
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageReadError(path, f"cannot decode image ({type(e).__name__}: {e})") from e
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if channels is not None and arr.shape[2] != channels:
        if channels == 3 and arr.shape[2] == 1:
            arr = np.repeat(arr, 3, axis=2)
        elif channels == 1 and arr.shape[2] == 3 and (arr[..., 0] == arr[..., 1]).all() and (
            arr[..., 1] == arr[..., 2]
        ).all():
            arr = arr[..., :1]
        else:
            raise ImageReadError(path, f"has {arr.shape[2]} channels, the model expects {channels}")
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
