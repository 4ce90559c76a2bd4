"""Magnification: models that know their microns.

A pathologist thinks in microns, not pixels: a 64-pixel patch of a 40x scan (0.25 µm/px)
covers a quarter of the tissue the same patch covers on a 20x scan (0.5 µm/px). A model
trained on one and shown the other sees cells twice the size it learned, and answers
something else. So a model records the physical scale of its pixels, and every slide is
read at that scale:

* **Training** records the microns per pixel (mpp) the patches were read at in the
  model's spec (``input.mpp``): ``--mpp`` when given (every training slide is then read
  at that scale, :meth:`~ats_cli.data.slides.SlideReader.match_mpp`), else the training
  slides' own mpp at ``--level`` when all of them record one and agree within
  :data:`~ats_cli.data.slides.MPP_TOLERANCE`. When they disagree, or some record none,
  the model records none (and the log says why): predict then reads slides as it always
  did, by level.
* ``--patch-um`` / ``--low-res-um`` give the patch side and the low-res view's pixel in
  microns instead of ``--patch-size`` (pixels) and ``--scale`` (a ratio): at the mpp
  above they are ``patch_size = round(patch_um / mpp)`` and ``scale = mpp / low_res_um``.
  The spec stores pixels and the mpp, so the microns follow from it; giving both forms of
  one setting is accepted only when they agree (a resumed run's config.json holds both).
* **Predict / visualize**: a slide that records its mpp is read from the coarsest level
  at or below the model's mpp and resampled by the remaining factor
  (:func:`~ats_cli.data.slides.choose_level`), patches and low-res view alike, so a patch
  covers the same tissue on a 40x and a 20x scan. Resampling is per patch (each reads its
  footprint, at most factor² times its pixels, and is resized to the patch size) and the
  view comes from the smallest pyramid level large enough, as before: memory stays
  bounded by the view and the patches. A slide without mpp (or a PNG) is read at the
  model's level as it is, and the one-line reading note says so. ``--mpp`` overrides the
  model's mpp; ``--level`` reads that level as it is.

:func:`describe_reading` is that one-line note (``ats predict`` and ``ats visualize`` print
it); :func:`file_mpp` reads a file's microns per pixel. Training's part, the rule above and
the conversion of microns into pixels, is settled with the rest of the configuration
(:mod:`ats_cli.settle`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ats_cli.data.slides import SlideReader

__all__ = ["describe_reading", "announce_readings", "file_mpp"]


def _um(v: float) -> str:
    return f"{v:.3g} µm/px"


def describe_reading(slide: SlideReader, target: float | None) -> str:
    """How ``slide`` is read, one line: its level, that level's mpp and the resampling
    (``target``: the mpp asked for, the model's or ``--mpp``; None: none to match)."""
    mpps = slide.level_mpps
    level = f"level {slide.level}"
    if mpps is None:
        if target is None:
            return f"{level} read as it is (the file records no microns per pixel)"
        return (f"{level} read as it is: the file records no microns per pixel, so it cannot be matched to the "
                f"model's {_um(target)}")
    here = f"{level} ({_um(mpps[slide.level])})"
    f = slide.factor
    if target is None:
        return f"{here} read as it is (no microns per pixel to match)"
    if f == 1.0:
        return f"{here} read as it is for {_um(target)}"
    if f > 1:
        return f"{here} downsampled {f:.3g}x to {_um(target)}"
    return f"{here} upsampled {1 / f:.3g}x to {_um(target)} (the file has nothing finer)"


def announce_readings(opener: Callable[..., Any], say: Callable[[str], None]) -> Callable[..., Any]:
    """``opener`` that also says how a slide was read (:func:`describe_reading`), on one
    line naming the file, the first time each way of reading occurs: one line for a folder
    of slides from one scanner, another for the one that differs."""
    seen: set[str] = set()

    def read(path: Any, *args: Any, **kwargs: Any) -> Any:  # ats_cli.data.inputs.OpenedImage
        opened = opener(path, *args, **kwargs)
        note = getattr(opened, "reading", None)
        if note and note not in seen:
            seen.add(note)
            say(f"{path}: {note}")
        return opened

    return read


def file_mpp(path: str | Path, *, reader: str | None = None, level: int | None = None,
             max_pixels: int | None = None) -> float | None:
    """Microns per pixel of ``level`` (0 by default) of the file at ``path`` (its header
    only), or None when it records none, is not read lazily, or cannot be opened (the
    training loader names unreadable files when it reaches them). Raises
    :class:`~ats_cli.data.slides.SlideReadError` when the recorded value is out of the
    plausible range (:mod:`ats_cli.data.scale_bounds`): a model trained at it would
    record a scale that resamples every slide it reads by hundreds."""
    from ats_cli.data.formats import is_lazy
    from ats_cli.data.slides import open_image

    if not is_lazy(path, reader, level, None):
        return None
    try:
        slide = open_image(path, reader=reader or "auto", max_pixels=max_pixels)
    except Exception:  # noqa: BLE001 - reported by name when training reads the file
        return None
    with slide:
        mpps = slide.plausible_mpps()  # a scale no microscope has is refused by name (scale_bounds)
        lv = level or 0
        return None if mpps is None or lv >= len(mpps) else mpps[lv]
