"""What prediction leaves on disk: the predictions CSV and, with ``--save-attention``,
one GeoJSON file of attention and sampled patches per input (:mod:`ats_cli.render.geojson`)."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from pathlib import Path

from ats_cli.core.model import ATSOutput
from ats_cli.data.inputs import OpenedImage
from ats_cli.io import atomic_write_text
from ats_cli.predict.inputs import InputItem
from ats_cli.predict.predictor import PredictionRow, Predictor
from ats_cli.render.geojson import feature_collection, parse_boxes, unique_names, write_geojson
from ats_cli.render.records import AttentionRecord

__all__ = ["AttentionSaver", "prediction_columns", "predictions_csv_text", "write_predictions_csv"]


def prediction_columns(classes: Sequence[str]) -> list[str]:
    """The predictions CSV's columns before the optional ``label``: written by
    :func:`predictions_csv_text`, read back by :mod:`ats_cli.predict.cohort` to resume."""
    return ["path", "prediction", *(f"prob_{c}" for c in classes)]


def predictions_csv_text(rows: Sequence[PredictionRow], classes: Sequence[str]) -> str:
    """The CSV of the successful rows: ``path,prediction,prob_<class>...`` and, when any
    row has a label, a final ``label`` column. Failed rows are left out on purpose: every
    row of the file then has numbers a spreadsheet or pandas can use as they are; the
    failures are reported separately (``ats predict`` lists them on stderr)."""
    with_labels = any(r.label is not None for r in rows if r.ok)
    header = prediction_columns(classes) + (["label"] if with_labels else [])
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for r in rows:
        if not r.ok:
            continue
        assert r.probs is not None
        writer.writerow([str(r.path), r.prediction, *(f"{p:.6f}" for p in r.probs)]
                        + ([r.label or ""] if with_labels else []))
    return buffer.getvalue()


def write_predictions_csv(path: str | os.PathLike[str], rows: Sequence[PredictionRow],
                          classes: Sequence[str]) -> Path:
    """Write :func:`predictions_csv_text` atomically (a crash never leaves half a CSV),
    creating the parent directory; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, predictions_csv_text(rows, classes))
    return path


class AttentionSaver:
    """``--save-attention DIR``: writes DIR/<name>.geojson for each input as it is
    predicted (pass it as :meth:`Predictor.predict`'s ``on_output``); names are fixed from
    the whole input list up front, so they do not depend on which inputs fail. Errors are
    collected in ``errors``, not raised: a missing attention file must not cost the
    predictions."""

    def __init__(self, folder: Path, items: Sequence[InputItem], predictor: Predictor, seed: int, samples: int):
        self.folder, self.items, self.predictor = folder, items, predictor
        self.seed, self.samples = seed, samples
        self.names = unique_names([item.path for item in items])
        self.written = 0
        self.errors: list[str] = []

    def __call__(self, index: int, row: PredictionRow, opened: OpenedImage, output: ATSOutput, b: int) -> None:
        item = self.items[index]
        target = self.folder / self.names[index]
        try:
            record = AttentionRecord.from_output(self.predictor.model, opened, output, b)
            boxes = parse_boxes(item.extra.get("boxes") or item.extra.get("digits"))
            collection = feature_collection(
                record, self.predictor.classes, row.probs, image=item.path, model=self.predictor.path, seed=self.seed,
                samples=self.samples, label=item.label, boxes=boxes, prediction=row.prediction)
            write_geojson(target, collection)
            self.written += 1
        except Exception as e:  # a full disk, a bad value: this file is missing, the predictions go on
            self.errors.append(f"{target}: {e.strerror if isinstance(e, OSError) and e.strerror else e} "
                               f"(for {item.path})")
