"""A dataset row's regions: where its objects are and their classes, the supervision
``ats pretrain`` learns from.

One structure for every source: a list of ``[class index, top, left, height, width]``
boxes in level-0 pixels. Boxes, not polygons, because what stage 1 asks of a region is
"is it whole inside this square patch, or does it touch it" (:func:`box_fractions` on
boxes) and stage 1b "which cells' patches hold it whole": both questions about the extent
of the object, which its bounding box answers exactly for the first (a polygon inside a
square patch iff its bounding box is) and conservatively for the second.

Sources, chosen by the column named with ``--regions``: a cell holding a JSON list of
``[class, top, left, height, width]`` (the Megapixel MNIST generator's ``digits`` column).
"""

from __future__ import annotations

from collections.abc import Sequence

from ats_cli.pretrain import PretrainError

Region = list[int]  # [class index, top, left, height, width], level-0 pixels


def row_regions(extra: dict[str, str], column: str, classes: Sequence[str], where: str) -> list[Region]:
    """The row's regions from its ``column`` cell; raises :class:`PretrainError` naming
    ``where`` (file:line) when the cell is missing, unreadable or names a class the dataset
    does not have."""
    from ats_cli.geojson import parse_boxes

    boxes = parse_boxes(extra.get(column))
    if not boxes or any(name not in classes for name, *_ in boxes):
        raise PretrainError(f"{where}: no usable {column!r} column of regions of the dataset's classes (a JSON list "
                            "of [class, top, left, height, width], as ats make-dataset megapixel-mnist writes)")
    return [[list(classes).index(name), *box] for name, *box in boxes]
