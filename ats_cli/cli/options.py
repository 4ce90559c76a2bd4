"""Command-line options shared by several commands, defined once."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["ReaderOption", "LevelOption", "MppOption", "TissueOption", "MaxPixelsOption"]

# How an input is read (ats predict, ats visualize). Unset = what the model was trained
# with (saved in its checkpoint), else the default in brackets.
ReaderOption = Annotated[str | None, typer.Option(
    "--reader", show_default=False,
    help="Force a reader: auto, openslide, tifffile, pillow \\[default: the model's training setting, else auto: "
         "TIFFs and slide formats are read lazily, other images whole].")]
LevelOption = Annotated[int | None, typer.Option(
    "--level", min=0, show_default=False,
    help="Slides: pyramid level patches are read from \\[default: the model's training setting, else 0].")]
MppOption = Annotated[float | None, typer.Option(
    "--mpp", min=0.0, show_default=False,
    help="Slides: read patches from the level closest to this many microns per pixel \\[default: the model's "
         "training setting].")]
TissueOption = Annotated[bool | None, typer.Option(
    "--tissue-mask/--no-tissue-mask", show_default=False,
    help="Sample only tissue (Otsu on saturation) \\[default: the model's training setting, else on for slides "
         "and TIFFs, off for other images].")]
MaxPixelsOption = Annotated[int | None, typer.Option(
    "--max-pixels", min=1, show_default=False,
    help="The most pixels decoded at once from one input: a whole PNG/JPEG, the slide level the low-res view is "
         "made from, one TIFF strip or tile; larger inputs are refused by name, before decoding \\[default: "
         "ATS_MAX_PIXELS, else 64000000 (8000 x 8000), which keeps memory under about 1.5 GB].")]
