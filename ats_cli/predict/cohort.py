"""Many inputs, several processes, interruptions: what ``ats predict --out FILE`` keeps on
disk while it runs, and how it resumes.

Each process (rank r of N, :mod:`ats_cli.runtime`; one process is rank 0 of 1)
predicts its share of the inputs that are not done yet (:func:`share`: every N-th, so
slow slides spread over the ranks) and appends one JSON line per input to its **part
file** ``FILE.part-r`` as soon as the input is finished, flushed (:class:`PartWriter`): a
crash loses at most the input being predicted, and a truncated last line is ignored.
When all ranks are done, rank 0 :func:`merge` s the existing CSV and every part file into
``FILE`` (atomically, in input order) and removes the part files.

Rerunning the same command resumes (:func:`plan`): the inputs found in ``FILE`` or in a
part file are not predicted again, failed ones are tried again. What is found must belong
to this run: a CSV whose class columns are not this model's, a part file written with
another model or other settings, rows for files that are not among the inputs, or a
``FILE`` whose record (``FILE.ats.json``, :mod:`ats_cli.predict.provenance`: model
digest, settings, input list) is not this run's are refused (:class:`CohortError`, one
line naming the file) rather than counted as done or replaced by a CSV with fewer rows.
``overwrite`` starts over: it removes ``FILE``, its part files and its record first, so
that nothing of the old run is left to be resumed if the new one is killed.

Part files are JSON lines (never pickles): a first line with the run's model and settings
(:func:`ats_cli.predict.provenance.settings`), then
``{"i": input index, "path", "prediction", "probs", "label"}`` or ``{..., "error"}``.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ats_cli.data.remote import input_path, is_url
from ats_cli.predict.inputs import InputItem
from ats_cli.predict.output import prediction_columns, write_predictions_csv
from ats_cli.predict.predictor import PredictionRow
from ats_cli.predict.provenance import read_record, record_differences, record_path

__all__ = ["CohortError", "PartWriter", "Plan", "input_key", "merge", "part_path", "part_paths", "plan", "share",
           "start_over"]

PART_FORMAT = "ats-predict-part/1"


class CohortError(ValueError):
    """An existing output that this run must not resume or replace; one line naming the file."""


def input_key(path: str | os.PathLike[str]) -> str:
    """Inputs are matched by absolute, normalised path (as :func:`resolve_inputs` de-duplicates);
    a URL by itself."""
    return path if is_url(path) else os.path.normcase(os.path.abspath(os.fspath(path)))


def part_path(out: str | os.PathLike[str], rank: int) -> Path:
    out = Path(out)
    return out.with_name(f"{out.name}.part-{rank}")


def part_paths(out: str | os.PathLike[str]) -> list[Path]:
    """Every part file next to ``out``, whatever number of processes wrote them."""
    out = Path(out)
    found = glob.glob(os.path.join(glob.escape(str(out.parent)), glob.escape(out.name) + ".part-*"))
    return sorted((Path(p) for p in found if p.rsplit("-", 1)[-1].isdigit()),
                  key=lambda p: int(str(p).rsplit("-", 1)[-1]))


def share(indices: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s inputs: every ``world_size``-th of ``indices`` from position ``rank``
    (round-robin, so that a run of large slides in the list is spread over the ranks)."""
    return list(indices[rank::world_size])


class Plan:
    """What :func:`plan` found: ``done`` (input keys already predicted) out of ``total``."""

    def __init__(self, done: set[str], total: int, sources: list[str]):
        self.done, self.total, self.sources = done, total, sources

    def todo(self, items: Sequence[InputItem]) -> list[int]:
        """Indices of the inputs still to predict, in input order."""
        return [i for i, item in enumerate(items) if item.error is not None or input_key(item.path) not in self.done]


def plan(out: str | os.PathLike[str], items: Sequence[InputItem], classes: Sequence[str],
         settings: Mapping[str, Any], *, overwrite: bool = False, record: Mapping[str, Any] | None = None) -> Plan:
    """Which inputs are done already, from ``out`` and its part files; with ``overwrite``,
    none (``out``, its part files and its record are removed).

    Raises :class:`CohortError` for an output that belongs to another run (see the module
    docstring), checked against ``record`` (:func:`ats_cli.predict.provenance.record`)
    when given. Call it in one process (rank 0, holding ``out``'s lock) before any rank
    starts writing."""
    out = Path(out)
    if overwrite:
        start_over(out)
        return Plan(set(), len(items), [])
    wanted = {input_key(item.path) for item in items}
    done: set[str] = set()
    sources: list[str] = []
    found: list[tuple[Path, list[PredictionRow]]] = []
    if out.exists():
        found.append((out, read_predictions_csv(out, classes)))
    parts = part_paths(out)
    for part in parts:
        found.append((part, read_part(part, classes, settings)))
    for path, rows in found:
        stray = [r.path for r in rows if r.ok and input_key(r.path) not in wanted]  # failures are not kept
        if stray:
            raise CohortError(f"{path}: holds {len(stray)} prediction(s) for files that are not among these inputs "
                              f"(e.g. {stray[0]}); give --overwrite to replace it, or another --out")
        ok = {input_key(r.path) for r in rows if r.ok}
        if ok:
            sources.append(str(path))
        done |= ok
    if record is not None:
        csv_rows = len(found[0][1]) if found and found[0][0] == out else 0
        _check_record(out, record, csv_rows, bool(parts))
    return Plan(done, len(items), sources)


def _check_record(out: Path, ours: Mapping[str, Any], csv_rows: int, has_parts: bool) -> None:
    """Refuse rows that this run's record does not vouch for: a CSV with rows and no
    record, or a record (of rows in the CSV or in part files) that is not this run's."""
    try:
        theirs = read_record(out)
    except ValueError as e:
        raise CohortError(f"{e}; give --overwrite to start over, or another --out") from None
    if theirs is None:
        if csv_rows:  # part files without a record were checked by their own first line
            raise CohortError(f"{out}: holds {csv_rows} prediction(s) but no record of the model and settings that "
                              f"made them ({record_path(out).name} is missing); give --overwrite to replace it, or "
                              "another --out")
        return
    differences = record_differences(theirs, ours)
    if differences and (csv_rows or has_parts):
        raise CohortError(f"{out}: was predicted with {differences} ({record_path(out).name}); give --overwrite to "
                          "replace it, or another --out")


def start_over(out: str | os.PathLike[str]) -> None:
    """Remove ``out``, its part files and then its record: a run killed half-way through
    leaves either nothing, or parts and a record that still name the old run (refused)."""
    out = Path(out)
    out.unlink(missing_ok=True)
    for part in part_paths(out):
        part.unlink(missing_ok=True)
    record_path(out).unlink(missing_ok=True)


def read_predictions_csv(path: Path, classes: Sequence[str]) -> list[PredictionRow]:
    """The rows of a predictions CSV written by ``ats predict`` for a model with ``classes``."""
    expected = prediction_columns(classes)
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None:
                return []
            if header[:len(expected)] != expected or header[len(expected):] not in ([], ["label"]):
                raise CohortError(f"{path}: exists and is not this model's predictions CSV (columns "
                                  f"{','.join(header)[:80]}); give --overwrite to replace it, or another --out")
            rows = []
            for line in reader:
                if len(line) < len(expected):
                    continue  # not a row ats wrote; it is predicted again
                try:
                    probs = tuple(float(v) for v in line[2:len(expected)])
                except ValueError:
                    continue
                label = line[len(expected)] if len(line) > len(expected) and line[len(expected)] else None
                rows.append(PredictionRow(path=input_path(line[0]), label=label, prediction=line[1], probs=probs))
            return rows
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise CohortError(f"{path}: cannot read it to resume ({getattr(e, 'strerror', None) or e}); give "
                          "--overwrite to replace it, or another --out") from None


def read_part(path: Path, classes: Sequence[str], settings: Mapping[str, Any] | None = None) -> list[PredictionRow]:
    """A part file's rows, the latest record of each input last. A line that is not
    complete JSON (the last one, after a crash) is ignored. With ``settings``, a part file
    written with others (or another model's classes) raises :class:`CohortError`."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise CohortError(f"{path}: cannot read it to resume ({e.strerror or e})") from None
    lines = text.split("\n")
    if not lines or not lines[0].strip():
        return []
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or head.get("format") != PART_FORMAT:
        raise CohortError(f"{path}: not a part file of ats predict; remove it or give --overwrite")
    same_settings = settings is None or head.get("settings") == json.loads(json.dumps(dict(settings)))
    if list(head.get("classes", [])) != list(classes) or not same_settings:
        differences = _differences(head, classes, settings)
        raise CohortError(f"{path}: was written with another model or other settings ({differences}); rerun with "
                          "those, or give --overwrite to start over, or another --out")
    rows = []
    for line in lines[1:]:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # the truncated last line of an interrupted run, or an empty one
        if not isinstance(rec, dict) or "path" not in rec:
            continue
        if rec.get("error") is not None:
            rows.append(PredictionRow(path=input_path(rec["path"]), label=rec.get("label"), error=str(rec["error"])))
        elif isinstance(rec.get("probs"), list) and len(rec["probs"]) == len(classes):
            rows.append(PredictionRow(path=input_path(rec["path"]), label=rec.get("label"),
                                      prediction=rec["prediction"], probs=tuple(float(p) for p in rec["probs"])))
    return rows


def _differences(head: Mapping[str, Any], classes: Sequence[str], settings: Mapping[str, Any] | None) -> str:
    ours = {"classes": list(classes), "settings": json.loads(json.dumps(dict(settings or head.get("settings") or {})))}
    return record_differences({"settings": {}, **head}, ours)


class PartWriter:
    """Appends this rank's rows to its part file, one flushed JSON line per input."""

    def __init__(self, path: Path, classes: Sequence[str], settings: Mapping[str, Any], model: str | None = None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(path, "a+b")  # noqa: SIM115 (closed in close())
        try:
            self._start(classes, settings, model)
        except BaseException:
            with contextlib.suppress(OSError):  # a full disk refuses the buffered bytes again
                self.fh.close()
            raise

    def _start(self, classes: Sequence[str], settings: Mapping[str, Any], model: str | None) -> None:
        self.fh.seek(0, os.SEEK_END)
        size = self.fh.tell()
        if size:  # a previous run's file: cut a truncated last line, so the next one starts clean
            self.fh.seek(0)
            data = self.fh.read()
            keep = data.rfind(b"\n") + 1
            if keep < size:
                self.fh.truncate(keep)
            size = keep
            self.fh.seek(0, os.SEEK_END)
        if size == 0:
            self._write({"format": PART_FORMAT, "model": model, "classes": list(classes), "settings": dict(settings)})

    def _write(self, record: Mapping[str, Any]) -> None:
        self.fh.write(json.dumps(record, allow_nan=False).encode("utf-8") + b"\n")
        self.fh.flush()

    def write(self, index: int, row: PredictionRow) -> None:
        record: dict[str, Any] = {"i": index, "path": str(row.path), "label": row.label}
        if row.ok:
            record.update(prediction=row.prediction, probs=list(row.probs or ()))
        else:
            record["error"] = row.error
        self._write(record)

    def close(self) -> None:
        try:
            os.fsync(self.fh.fileno())
        finally:
            self.fh.close()


def merge(out: str | os.PathLike[str], items: Sequence[InputItem], classes: Sequence[str],
          *, overwrite: bool = False, remove_parts: bool = True) -> list[PredictionRow]:
    """Write ``out`` from itself (unless ``overwrite``) and every part file, in input
    order, atomically; then remove the part files. Returns one row per input found
    (failures included, for the report); an input's successful row wins over a failure, a
    later record over an earlier one. The paths and labels are the inputs' own (as this
    run spells them)."""
    out = Path(out)
    parts = part_paths(out)
    found: dict[str, PredictionRow] = {}

    def add(rows: Iterable[PredictionRow]) -> None:
        for r in rows:
            key = input_key(r.path)
            if r.ok or key not in found or not found[key].ok:
                found[key] = r

    if out.exists() and not overwrite:
        add(read_predictions_csv(out, classes))
    for part in parts:
        add(read_part(part, classes))
    merged: list[PredictionRow] = []
    for item in items:
        if item.error is not None:
            merged.append(PredictionRow(path=item.path, label=item.label, error=item.error))
            continue
        row = found.get(input_key(item.path))
        if row is not None:
            merged.append(replace(row, path=item.path, label=item.label))
    write_predictions_csv(out, merged, classes)
    if remove_parts:
        for part in parts:
            part.unlink(missing_ok=True)
    return merged
