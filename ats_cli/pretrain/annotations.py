"""Regions from QuPath's annotation export: one GeoJSON file per slide.

QuPath's *Export objects as GeoJSON* writes a FeatureCollection (or, from older versions,
a bare list of Features); each Feature has a ``geometry`` (``Polygon``: a list of rings,
the first the outline, the others holes; ``MultiPolygon``: a list of those) in level-0
pixel coordinates, x = column and y = row, and its class in
``properties.classification.name``. Each classified area becomes one region: the bounding
box of its outlines, ``[class index, top, left, height, width]``, the structure
:mod:`ats_cli.pretrain.regions` defines (it says why boxes). Holes do not change a box.

Unclassified features are skipped (QuPath exports the tissue outline and other helper
annotations alongside the labelled ones); a classified feature that is not an area (a
point, a line) cannot say which patches hold it whole, and is refused, as is a class the
dataset does not have: one line naming the file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from ats_cli.pretrain import PretrainError

AREAS = ("Polygon", "MultiPolygon")


def read_annotations(path: str | os.PathLike[str], classes: Sequence[str]) -> list[list[int]]:
    """The regions of QuPath GeoJSON file ``path``; raises :class:`PretrainError` naming it
    when it is missing, not GeoJSON, or names a class not in ``classes``."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PretrainError(f"{path}: annotation file not found") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PretrainError(f"{path}: not a GeoJSON file ({str(e).splitlines()[0]})") from None
    features = _features(doc)
    if features is None:
        raise PretrainError(f"{path}: not a GeoJSON FeatureCollection or list of Features")
    regions = []
    for k, feature in enumerate(features, 1):
        name = _class_name(feature)
        if name is None:
            continue
        if name not in classes:
            raise PretrainError(f"{path}: feature {k} has class {name!r}, not one of the dataset's "
                                f"({', '.join(map(str, classes))})")
        geometry = feature.get("geometry") or {}
        try:
            box = _bounding_box(geometry)
        except _NotFinite as e:
            raise PretrainError(f"{path}: feature {k} ({name!r}) has a coordinate {e}: a region is a finite area "
                                "in pixels") from None
        if box is None:
            raise PretrainError(f"{path}: feature {k} ({name!r}) is a {geometry.get('type')!r}, not a Polygon or "
                                "MultiPolygon with coordinates: a region must be an area")
        regions.append([list(classes).index(name), *box])
    return regions


def _features(doc) -> list[dict] | None:
    if isinstance(doc, dict) and doc.get("type") == "FeatureCollection" and isinstance(doc.get("features"), list):
        doc = doc["features"]
    elif isinstance(doc, dict) and doc.get("type") == "Feature":
        doc = [doc]
    if not isinstance(doc, list) or not all(isinstance(f, dict) and f.get("type") == "Feature" for f in doc):
        return None
    return doc


def _class_name(feature: dict) -> str | None:
    """``properties.classification.name``; None when the feature is unclassified."""
    classification = (feature.get("properties") or {}).get("classification")
    if isinstance(classification, dict):
        name = classification.get("name")
        return str(name) if name is not None else None
    return None


class _NotFinite(ValueError):
    """A coordinate that is NaN or infinite (Python's json reads ``NaN`` and ``Infinity``)."""


def _bounding_box(geometry: dict) -> list[int] | None:
    """[top, left, height, width] in whole pixels covering the geometry's outlines (the
    first ring of each polygon); None when it is not an area with coordinates;
    :class:`_NotFinite` for a NaN or infinite coordinate, which has no pixel (it made
    ``math.floor`` raise a bare ValueError or OverflowError)."""
    kind, coords = geometry.get("type"), geometry.get("coordinates")
    if kind not in AREAS or not isinstance(coords, list):
        return None
    polygons = [coords] if kind == "Polygon" else coords
    try:
        points = [(float(x), float(y)) for polygon in polygons for x, y, *_ in polygon[0]]
    except (TypeError, ValueError, IndexError):
        return None
    if not points:
        return None
    bad = next((v for p in points for v in p if not math.isfinite(v)), None)
    if bad is not None:
        raise _NotFinite(str(bad))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    top, left = math.floor(min(ys)), math.floor(min(xs))
    return [top, left, max(1, math.ceil(max(ys)) - top), max(1, math.ceil(max(xs)) - left)]
