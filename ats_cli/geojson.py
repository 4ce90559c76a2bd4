"""The names other modules import from here, where they now live: the GeoJSON file in
:mod:`ats_cli.render.geojson`, the model check in :mod:`ats_cli.visualize`. Importing
them from there keeps this module's only job to let older imports work."""

from __future__ import annotations

from ats_cli.render.geojson import (
    CELL_MASS,
    MAX_CELLS,
    cell_boxes,
    feature_collection,
    geojson_text,
    parse_boxes,
    patch_boxes,
    select_cells,
    unique_names,
    write_geojson,
)
from ats_cli.render.records import AttentionRecord, LevelFrame, level_frame


def check_model(model) -> None:
    """:func:`ats_cli.visualize.check_model`."""
    from ats_cli.models import check_model as check

    check(model)


__all__ = ["CELL_MASS", "MAX_CELLS", "AttentionRecord", "LevelFrame", "cell_boxes", "check_model",
           "feature_collection", "geojson_text", "level_frame", "parse_boxes", "patch_boxes", "select_cells",
           "unique_names", "write_geojson"]
