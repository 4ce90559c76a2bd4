"""What a physical scale may be: the plausible microns per pixel, and patch sides in microns.

A file's microns per pixel (mpp) decides how much is allocated: a slide read at the
model's 0.5 µm/px is resampled by ``its mpp / 0.5``, so a 512-pixel image whose tags say
1000 µm/px becomes a million pixels a side. Metadata is whatever a writer put there, so
a value is checked here before it is used, and refused by name with the value and where
it came from (the tag, the file, the flag).

The plausible range is :data:`MIN_MPP`-:data:`MAX_MPP` µm/px. Light microscopy samples
from about 0.05 µm/px (100x oil immersion on a camera) to a few µm/px (a 1.25x overview);
super-resolution images reach a few hundredths; 100 µm/px draws a 25 mm slide in 250
pixels, a thumbnail. Outside that range the value is not a microscope's: nanometre
electron microscopy (not what these models read) or, far more often, a print resolution
(a photo tool's 72 dpi is 352.8 µm/px, 300 dpi 84.7). Resampling by such a value would
not give wrong-but-usable pixels: it would allocate without bound or shrink the image to
one pixel, so it is refused rather than used.

The same bound keeps ``--patch-um`` honest: a patch side must come to at least one pixel
at the model's mpp, and a patch must fit in the pixel budget (one patch is decoded at
once, :func:`ats_cli.data.images.max_pixels_limit`).

Standard library only at import: the CLI's option parsing imports it.
"""

from __future__ import annotations

import math

__all__ = ["MIN_MPP", "MAX_MPP", "RANGE_TEXT", "check_mpp_flag", "mpp_problem", "patch_pixels"]

MIN_MPP = 0.01
MAX_MPP = 100.0
RANGE_TEXT = f"{MIN_MPP:g}-{MAX_MPP:g} µm/px"


def mpp_problem(value: float) -> str | None:
    """Why ``value`` µm/px cannot be a microscope's scale (None when it can): the text
    to put after the value and its source in a one-line error."""
    if not (math.isfinite(value) and MIN_MPP <= value <= MAX_MPP):
        return f"outside the plausible {RANGE_TEXT} of a microscope image"
    return None


def check_mpp_flag(value: float, flag: str = "--mpp") -> None:
    """Refuse ``flag`` ``value`` (0: off, accepted) outside the plausible range with a one-line
    :class:`ats_cli.config.ConfigError` naming the flag and the value."""
    if value and (problem := mpp_problem(value)):
        from ats_cli.config import ConfigError

        raise ConfigError(f"{flag} {value:g} µm/px is {problem} (0 = off)")


def patch_pixels(patch_um: float, mpp: float, max_pixels: int | None = None) -> int:
    """The patch side in pixels that ``--patch-um`` ``patch_um`` is at ``mpp`` µm/px.
    Raises :class:`ats_cli.config.ConfigError` (one line, naming the flag, the value and
    the pixels) when that is less than one pixel, or a patch of more pixels than the
    pixel budget (``max_pixels``, default :func:`ats_cli.data.images.max_pixels_limit`)."""
    from ats_cli.config import ConfigError
    from ats_cli.data.images import max_pixels_limit

    limit = max_pixels_limit(max_pixels)
    side = patch_um / mpp
    if not side >= 0.5:  # it rounds to no pixel at all
        raise ConfigError(f"--patch-um {patch_um:g} is {side:.3g} pixels at {mpp:.4g} µm/px, less than one pixel: "
                          "give a larger --patch-um (or --patch-size in pixels)")
    size = round(side)
    if size * size > limit:
        raise ConfigError(f"--patch-um {patch_um:g} is {size:,} pixels at {mpp:.4g} µm/px, a patch of "
                          f"{size * size:,} pixels, over the limit of {limit:,} pixels decoded at once: give a "
                          "smaller --patch-um (or --patch-size in pixels)")
    return size
