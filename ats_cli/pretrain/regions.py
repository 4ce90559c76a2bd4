"""A dataset row's regions: where its objects are and their classes, the supervision
``ats pretrain`` learns from.

One structure for every source: a list of ``[class index, top, left, height, width]``
boxes in level-0 pixels. Boxes, not polygons, because of the two questions stage 1 and 1b
ask of a region: "is it whole inside this square patch" -- exactly when its bounding box
is -- and "does it touch the patch at all" -- where a box answers yes for a patch that
only meets the box's empty corner of an irregular region: such a patch is then left out
as ambiguous, never labelled wrongly. So boxes cost a few "none" patches next to concave
outlines and never a wrong label, and they are one structure for digits and tumour nests.

Sources, chosen by the CSV column named with ``--regions`` and read by :func:`row_regions`:

* a JSON list of ``[class, top, left, height, width]`` in the cell (the Megapixel MNIST
  generator's ``digits`` column, synthetic slides' ``boxes``); ``[]``: the image holds
  no object, every patch is "none";
* a path to a QuPath GeoJSON annotation file (:mod:`ats_cli.pretrain.annotations`),
  relative to the dataset directory or absolute.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ats_cli.pretrain import PretrainError

Region = list[int]  # [class index, top, left, height, width], level-0 pixels
GEOJSON_SUFFIXES = (".geojson", ".json")


def row_regions(extra: dict[str, str], column: str, classes: Sequence[str], where: str,
                base: str | Path | None = None) -> list[Region]:
    """The row's regions from its ``column`` cell (module docstring): a JSON list, or the
    path of a GeoJSON file (relative to ``base``). Raises :class:`PretrainError` naming
    ``where`` (file:line) or the annotation file when the cell is missing or unreadable or
    names a class the dataset does not have."""
    cell = (extra.get(column) or "").strip()
    if cell.lower().endswith(GEOJSON_SUFFIXES):
        from ats_cli.pretrain.annotations import read_annotations

        path = Path(cell).expanduser()
        return read_annotations(path if path.is_absolute() or base is None else Path(base) / path, classes)
    boxes = _json_boxes(cell)
    if boxes is None or any(name not in classes for name, *_ in boxes):
        raise PretrainError(f"{where}: no usable {column!r} column of regions of the dataset's classes (a JSON list "
                            "of [class, top, left, height, width], as ats make-dataset megapixel-mnist writes, or "
                            "a QuPath .geojson file)")
    return [[list(classes).index(name), *box] for name, *box in boxes]


def _json_boxes(cell: str) -> list[tuple[str, int, int, int, int]] | None:
    """``[[class, top, left, h, w], ...]`` of a cell; None when absent or malformed."""
    if not cell:
        return None
    try:
        return [(str(c), int(r), int(k), int(h), int(w)) for c, r, k, h, w in json.loads(cell)]
    except (ValueError, TypeError, OverflowError):  # OverflowError: int(Infinity)
        return None
