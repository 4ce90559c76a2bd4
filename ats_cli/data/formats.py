"""Which files are inputs, and which backend reads each: the one suffix table.

``ats predict DIR`` (which files in a directory are images), ``ats make-dataset
from-folder`` (which files become rows), and :func:`ats_cli.data.slides.open_image`
(which reader opens a file, for ``ats info``, ``ats visualize``, ``ats predict`` and the
training data loader) all decide from :data:`BACKENDS`, so that a file one command
accepts is one the others accept and read the same way.

Every suffix PIL can decode is listed (WebP, GIF and PPM/PGM too): a file listed here is
one a command picks up from a directory, and a format missing from one command's list
but not another's was a dataset that trained but could not be predicted by directory.

Imports nothing beyond the standard library (``ats --help`` reaches it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

__all__ = ["BACKENDS", "INPUT_SUFFIXES", "LAZY_BACKENDS", "OPENSLIDE", "PILLOW", "TIFFFILE", "VIRTUAL",
           "VIRTUAL_SUFFIX", "backend", "is_input_file", "is_lazy"]

PILLOW, TIFFFILE, OPENSLIDE, VIRTUAL = "pillow", "tifffile", "openslide", "virtual"
LAZY_BACKENDS = (TIFFFILE, OPENSLIDE, VIRTUAL)  # read tile by tile (or rendered region by region), never whole
# a virtual slide (ats_cli.data.virtual_slides): a JSON spec rendered on demand; the double
# suffix keeps other JSON files (dataset.json) from being taken for slides
VIRTUAL_SUFFIX = ".vslide.json"

BACKENDS: Mapping[str, str] = MappingProxyType({
    # decoded whole by PIL, under the pixel budget (ats_cli.data.images)
    **dict.fromkeys((".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm"), PILLOW),
    # read lazily by tifffile, or by OpenSlide when it recognises a vendor TIFF in the file
    # (Aperio, Philips, Ventana); OME-TIFF (.ome.tif) ends in .tif
    **dict.fromkeys((".tif", ".tiff", ".btf"), TIFFFILE),
    # whole-slide formats only OpenSlide reads
    **dict.fromkeys((".svs", ".ndpi", ".mrxs", ".scn", ".vms", ".vmu", ".bif", ".svslide", ".dcm"), OPENSLIDE),
})
INPUT_SUFFIXES = (*BACKENDS, VIRTUAL_SUFFIX)


def backend(path: str | os.PathLike[str]) -> str | None:
    """The backend :data:`BACKENDS` gives ``path``'s suffix (case-insensitive); None for a
    suffix it does not list."""
    if str(path).lower().endswith(VIRTUAL_SUFFIX):
        return VIRTUAL
    return BACKENDS.get(Path(path).suffix.lower())


def is_input_file(path: str | os.PathLike[str]) -> bool:
    """Whether a file found in a directory is an input: a listed suffix, not hidden."""
    return backend(path) is not None and not Path(path).name.startswith(".")


def is_lazy(path: str | os.PathLike[str], reader: str | None = None, level: int | None = None,
            mpp: float | None = None) -> bool:
    """Whether ``path`` is read through the lazy slide readers (a lazy backend: TIFFs and
    slide formats, or any file when a reader, level or mpp is asked for) rather than
    decoded whole. Here, with the suffix table it reads, rather than in
    :mod:`ats_cli.data.inputs`: the magnification module asks it too, and inputs imports
    that module, so neither needs the other for it."""
    return reader not in (None, "auto") or level is not None or mpp is not None or backend(path) in LAZY_BACKENDS
