"""What a TIFF read by tifffile holds, decided from its header: pixel size, which samples
are colour, whether its codec is available, and Aperio's YCbCr JPEG 2000 tiles.

Real files differ from what one writer produces: OME-XML gives pixel sizes in any length
unit, libvips records resolution per centimetre and Aperio in its description; a
fluorescence image has 4-6 intensity channels or 16-bit samples that would read as a
plausible gray or RGB image if only the first plane or three samples were taken. So the
reader (``ats_cli.data.slides.TiffReader``) asks here first and refuses, by name, what it
would otherwise read wrongly.

Imports numpy and the standard library only (tifffile inside functions): ``ats --help``
must stay light.
"""

from __future__ import annotations

import math
import re

import numpy as np

__all__ = ["APERIO_JP2K_YCBCR", "PRINT_DENSITIES", "aperio_ycbcr_to_rgb", "codec_message", "codec_problem",
           "colour_samples", "level_pages", "not_a_microscope_scale", "tiff_mpp", "tiff_mpp_source"]

# OME UnitsLength values in micrometres. "pixel" and "reference frame" are not lengths.
_MICRONS = {"m": 1e6, "dm": 1e5, "cm": 1e4, "mm": 1e3, "µm": 1.0, "μm": 1.0, "um": 1.0, "nm": 1e-3, "pm": 1e-6,
            "Å": 1e-4, "in": 25_400.0, "thou": 25.4}
_PER_UNIT = {2: 25_400.0, 3: 10_000.0}  # ResolutionUnit INCH, CENTIMETER -> um per unit; NONE has no size
_ALPHA = {1, 2}  # ExtraSamples ASSOCALPHA, UNASSALPHA
_COLOURS = {1: 1, 2: 3, 6: 3}  # Photometric MINISBLACK, RGB, YCBCR -> colour samples
_CODEC_NAMES = {5: "LZW", 6: "old-style JPEG", 7: "JPEG", 8: "Deflate", 32946: "Deflate", 33003: "JPEG 2000",
                33004: "JPEG 2000", 33005: "JPEG 2000", 34712: "JPEG 2000", 34887: "LERC", 34925: "LZMA",
                34927: "WebP", 50000: "Zstandard", 50001: "WebP", 50002: "JPEG XL", 52546: "JPEG XL"}
APERIO_JP2K_YCBCR = 33003
# Pixels per inch that image tools write when nobody measured anything (72: libvips, GIMP,
# Photoshop, PNG's pHYs default; 96: Windows; 300, 600: print), and the common screen and
# scanner settings between: a microscope's pixel is 0.1-10 µm, 2,500-250,000 per inch, and
# a file that says 72 or 300 dpi was written by a tool that did not know its scale.
PRINT_DENSITIES = (72, 96, 100, 120, 144, 150, 200, 240, 300, 400, 600, 720, 1200)
DENSITY_TOLERANCE = 0.01  # libvips stores 72 dpi as 28.34 px/cm (71.98 dpi): rounding, not a measurement


def level_pages(tif) -> tuple[object, list]:
    """(the first series, the keyframe of each of its levels, level 0 first).

    tifffile links a reduced page as the next level of a plain (generic) TIFF only when it
    is 2, 3 or 4 times smaller; writers also leave gaps (a 1/64 overview under a large
    level 0, levels 1/4 and 1/32 only), which would leave the reader with level 0 alone
    and a low-res view over the pixel budget. So a later series whose page is marked
    reduced-resolution, with level 0's samples, and whose both sides are level 0's over
    one downsample (within a pixel of rounding) is a level too.
    """
    series = tif.series[0]
    pages = [lv.keyframe for lv in series.levels]
    if series.kind != "generic":
        return series, pages
    h0, w0 = pages[0].imagelength, pages[0].imagewidth
    for other in tif.series[1:]:
        page, last = other.keyframe, pages[-1]
        h, w = page.imagelength, page.imagewidth
        if not (page.is_reduced and h < last.imagelength and w < last.imagewidth
                and (page.samplesperpixel, page.dtype) == (pages[0].samplesperpixel, pages[0].dtype)):
            continue
        d = (h0 / h + w0 / w) / 2
        if abs(h0 / d - h) <= 1 and abs(w0 / d - w) <= 1:
            pages.append(page)
    return series, pages


def _positive(v: float) -> float | None:
    return v if math.isfinite(v) and v > 0 else None


def _ome_mpp(xml: str) -> tuple[float, float] | None:
    """(y, x) microns per pixel of the first OME Image: PhysicalSizeY/X in their units
    (micrometres when no unit is given, as the schema says)."""
    from xml.etree import ElementTree

    try:
        pixels = ElementTree.fromstring(xml).find("{*}Image/{*}Pixels")
    except ElementTree.ParseError:
        return None
    if pixels is None:
        return None
    sizes = []
    for axis in ("Y", "X"):
        value, unit = pixels.get(f"PhysicalSize{axis}"), pixels.get(f"PhysicalSize{axis}Unit", "µm")
        if value is None or unit not in _MICRONS:
            return None
        try:
            size = _positive(float(value) * _MICRONS[unit])
        except ValueError:
            return None
        if size is None:
            return None
        sizes.append(size)
    return sizes[0], sizes[1]


def not_a_microscope_scale(mpp: tuple[float, float], source: str, per_inch: float | None = None) -> str | None:
    """Why the pixel size ``mpp`` ((y, x) µm) that a file records in ``source`` is not the
    scale the image was taken at, so that it reads as "scale unknown"; None when it can be
    a microscope's. The one place this is decided, for every reader.

    A file's resolution tags hold whatever its writer put there, and most tools write a
    screen or print density when nobody measured anything: libvips, given a PNG, saves
    72 dpi (28.34 px/cm), which is 352.8 µm/px. Taken as a scale it would have a 0.5 µm/px
    model's patches resampled 700-fold, or the file refused, when the user only wants it
    read as it is (or at the scale they state with --mpp). So tags (``per_inch``: their
    pixels per inch, whatever the unit) at one of :data:`PRINT_DENSITIES` say nothing of
    the scale, nor does any value outside the plausible range of
    :func:`ats_cli.data.dataset.mpp_problem` (from tags, OME-XML, a vendor's property).
    A scanner's own scale, e.g. 40,000 px/cm = 0.25 µm/px, is kept.
    """
    from ats_cli.data.dataset import mpp_problem

    if per_inch is not None:
        dpi = next((d for d in PRINT_DENSITIES if abs(per_inch / d - 1) <= DENSITY_TOLERANCE), None)
        if dpi is not None:
            said = "" if f"{dpi} pixels per inch" in source else f" ({dpi} dpi)"
            return f"{source}{said}, are a screen or print density (a tool's default), not a microscope's scale"
    value = (mpp[0] + mpp[1]) / 2
    if problem := mpp_problem(value):
        return f"{source}: {value:.4g} µm/px, {problem}"
    return None


def tiff_mpp(tif, page) -> tuple[float, float] | None:
    """(y, x) microns per pixel of ``page`` (level 0) of ``tif`` as recorded:
    :func:`tiff_mpp_source` without the source."""
    return tiff_mpp_source(tif, page)[0]


def tiff_mpp_source(tif, page) -> tuple[tuple[float, float] | None, str, float | None]:
    """((y, x) microns per pixel of ``page`` (level 0) of ``tif``, where it was read, the
    resolution tags' pixels per inch when read from them): from the OME-XML, else an Aperio
    description's ``MPP =``, else the resolution tags (per inch or centimetre; libvips
    writes per centimetre). Per axis, since x and y may differ. None when the file records
    no pixel size. As recorded: :func:`not_a_microscope_scale` decides whether it is a
    scale, and the source is named for the line that says why not."""
    if tif.is_ome and (mpp := _ome_mpp(tif.ome_metadata or "")):
        return mpp, "OME-XML PhysicalSizeX/Y", None
    if tif.is_svs:
        found = re.search(r"\|\s*MPP\s*=\s*([0-9.eE+-]+)", page.description or "")
        try:
            mpp = _positive(float(found.group(1))) if found else None
        except ValueError:
            mpp = None
        return ((mpp, mpp) if mpp else None), "the Aperio description's MPP", None
    unit, xr, yr = (page.tags.get(name) for name in ("ResolutionUnit", "XResolution", "YResolution"))
    per_unit = _PER_UNIT.get(int(unit.value) if unit else 0)  # no unit written: no physical size assumed
    if not (per_unit and xr and yr):
        return None, "", None
    try:
        y, x = (_positive(per_unit * tag.value[1] / tag.value[0]) for tag in (yr, xr))
        per = xr.value[0] / xr.value[1]
    except (ZeroDivisionError, TypeError, IndexError):
        return None, "", None
    name = "inch" if per_unit == _PER_UNIT[2] else "centimetre"
    return (((y, x) if y and x else None), f"the TIFF resolution tags, {per:.6g} pixels per {name}",
            per * _PER_UNIT[2] / per_unit)


def colour_samples(series, page) -> tuple[int, str | None]:
    """(colour samples to keep per pixel, 1 or 3; the problem when the image is not an
    8-bit gray or RGB image). Alpha, or one unnamed extra sample after RGB (RGBX), is
    dropped. More channels, whether as samples or as OME planes, and samples wider than
    8 bits are refused: taking the first plane or three samples, or one 16-to-8-bit
    scaling (a 12-bit camera fills 0-4095 of 0-65535), would hand the model a plausible
    image that is not the one in the file, so the user chooses the channels and range."""
    from tifffile import PHOTOMETRIC

    photometric, samples = int(page.photometric), int(page.samplesperpixel)
    colours = _COLOURS.get(photometric)
    if colours is None:
        return 0, (f"photometric {PHOTOMETRIC(photometric).name} images are not supported; "
                   "ats reads gray (MINISBLACK) or RGB TIFFs")
    if photometric == 6 and page.compression not in (6, 7):  # only a JPEG decoder turns YCbCr into RGB
        return 0, f"YCbCr samples under {page.compression.name} compression are not supported; convert it to RGB"
    if page.planarconfig != 1 and samples > 1:
        return 0, "planar (separate) sample layout is not supported"
    extra = [int(e) for e in page.extrasamples][: samples - colours]
    extra += [0] * (samples - colours - len(extra))  # extra samples the file does not describe: unnamed
    alpha = sum(e in _ALPHA for e in extra) + (colours == 3 and extra == [0])  # RGBX: padding
    channels = samples - alpha
    planes = [(a, n) for a, n in zip(series.axes, series.shape, strict=True) if a not in "YXS" and n > 1]
    bits = "" if page.dtype == np.uint8 else f"{page.bitspersample}-bit samples ({page.dtype})"
    if channels == colours and not planes:
        if not bits:
            return colours, None
        return 0, (f"{bits} are not supported: ats reads 8-bit images, and there is no one right 8-bit scaling "
                   "(a 12-bit camera fills 0-4095 of 0-65535); convert it to 8-bit with the display range you want")
    others = [(a, n) for a, n in planes if a != "C"]
    if others:
        what = ", ".join(f"{n} along {a}" for a, n in others)
        return 0, (f"holds several images ({what}; axes {series.axes}); ats reads one gray or RGB image per file: "
                   "save the one you want on its own")
    total = channels * math.prod(n for _, n in planes)
    name = PHOTOMETRIC(photometric).name
    where = f"axes {series.axes}" if planes else f"{samples} samples per pixel, photometric {name}"
    of = f" of {bits}" if bits else ""
    return 0, (f"has {total} channels ({where}){of}; ats reads 8-bit gray (1 channel) or RGB (3): export the "
               "channels you want as an 8-bit gray or RGB TIFF")


def codec_problem(page) -> str | None:
    """Why ``page``'s segments cannot be decoded here (tifffile has no decoder for its
    compression, e.g. imagecodecs is missing), else None; from the header alone."""
    from tifffile import TIFF

    if page.compression == 1:
        return None
    try:
        TIFF.DECOMPRESSORS[page.compression]
    except KeyError as e:
        return codec_message(page, str(e.args[0] if e.args else e))
    return None


def codec_message(page, why: str) -> str:
    from tifffile import COMPRESSION

    code = int(page.compression)
    try:
        name = _CODEC_NAMES.get(code) or COMPRESSION(code).name
    except ValueError:
        name = f"compression {code}"
    kind = "tiles" if page.is_tiled else "strips"
    return (f"its {name} {kind} (TIFF compression {code}) cannot be decoded here ({why}); "
            f"install imagecodecs with {name} support (pip install -U imagecodecs)")


def aperio_ycbcr_to_rgb(segment: np.ndarray, codestream: bytes) -> np.ndarray:
    """RGB of a decoded Aperio 33003 tile, whose J2K codestream holds Y, Cb and Cr with no
    colour transform (OpenSlide converts them, as here, for every 33003 tile). OpenJPEG
    (through imagecodecs) already converts a codestream whose chroma is subsampled, as
    Aperio's usually is (4:2:2), so only a full-resolution-chroma one is converted here;
    the subsampling is read from the SIZ marker, which follows the start of codestream
    (the second component's horizontal step is byte 46)."""
    siz = codestream[:4] == b"\xff\x4f\xff\x51" and len(codestream) > 46
    if (siz and codestream[46] > 1) or segment.shape[-1] != 3:
        return segment
    ycc = segment.astype(np.float32)
    y, cb, cr = ycc[..., 0], ycc[..., 1] - 128.0, ycc[..., 2] - 128.0
    rgb = np.stack([y + 1.402 * cr, y - 0.344136 * cb - 0.714136 * cr, y + 1.772 * cb], axis=-1)
    return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)
