"""Command-line arguments -> the ordered list of images to predict.

:func:`resolve_inputs` turns what ``ats predict`` is given (files, directories, glob
patterns, dataset CSVs, dataset directories) into :class:`InputItem` s, with labels when a
CSV provides them. It only finds paths; opening a file is
:func:`ats_cli.data.inputs.open_input`'s job, at prediction time.
"""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ats_cli.data.dataset import DATASET_JSON, CsvRow, find_inputs, is_input_file, is_store, read_csv
from ats_cli.data.remote import is_url
from ats_cli.multilabel import split_label

__all__ = ["InputItem", "read_inputs_csv", "resolve_inputs"]

_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class InputItem:
    """One image to predict. ``label`` (a class name, a multi-label set, "" for an empty
    cell) comes from a dataset CSV; ``extra``
    holds that CSV row's other columns (e.g. the ``digits`` boxes); ``error`` is set when
    the argument could not even be turned into an image path (it then becomes a failed row)."""

    path: Path | str  # a URL stays the URL string (ats_cli.data.remote)
    label: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None


def resolve_inputs(specs: Iterable[str | os.PathLike[str]], *, recursive: bool = False) -> list[InputItem]:
    """Command-line arguments -> images, in argument order, each file once.

    * an existing file: a ``.csv`` is a dataset CSV (``path`` column, optional ``label``;
      relative paths are relative to the CSV's directory); anything else is an image;
    * a directory holding ``dataset.json`` and ``test.csv``: that dataset's test split;
    * an OME-Zarr store (a ``.zarr`` directory): one image;
    * a URL (``https://``, ``s3://``, ...: :mod:`ats_cli.data.remote`): one image, fetched
      when it is predicted (a CSV's rows may be URLs too);
    * any other directory: the image files and stores in it (the suffixes of
      :data:`ats_cli.data.dataset.BACKENDS`, sorted by name, hidden files skipped),
      including sub-directories when ``recursive`` (never the inside of a store);
    * a pattern with ``* ? [`` that is not an existing path: expanded here (``**``
      included), for shells that do not; matched directories and CSVs are treated as
      above, other matches only if they are image files.

    Problems (a missing path, an empty directory, a pattern that matches nothing, a bad
    CSV, a FIFO or device) become items with ``error`` set rather than exceptions, so that
    one typo does not stop the other inputs. A file reached twice is kept at its first
    position, and predicted once: a CSV row that repeats a file with the same label adds
    nothing (the prediction is the file's), and one that repeats it with another label is
    a failed row naming both lines (:func:`read_inputs_csv`): which label the metrics
    should score is the user's to say, and taking the first silently hid the conflict.
    """
    items: list[InputItem] = []
    seen: set[str] = set()

    def add(item: InputItem) -> None:
        key = item.path if is_url(item.path) else os.path.normcase(os.path.abspath(item.path))
        if item.error is None and key in seen:
            return
        seen.add(key)
        items.append(item)

    for spec in specs:
        text = os.fspath(spec)
        if is_url(text):  # read when predicted; one that cannot be fetched is a failed row naming it
            add(InputItem(text))
            continue
        path = Path(text).expanduser()
        if path.exists():
            for item in _expand(path, recursive=recursive, explicit=True):
                add(item)
        elif any(ch in text for ch in _GLOB_CHARS):
            matches = sorted(glob.glob(os.path.expanduser(text), recursive=True))
            found = [item for m in matches for item in _expand(Path(m), recursive=recursive, explicit=False)]
            if not found:
                add(InputItem(path, error=f"{text}: the pattern matches no image files"))
            for item in found:
                add(item)
        else:
            add(InputItem(path, error=f"{path}: does not exist"))
    return items


def _not_regular(path: Path) -> str | None:
    """Why ``path`` (which exists) is neither a directory nor a regular file, or None. A FIFO
    named ``x.png`` made predict wait forever for a writer (opening one blocks), a device
    reads without end: they are refused by what they are, from ``stat`` (which never blocks)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # the reader names the problem
    if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
        return None
    kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
    return f"{path}: {kind}, not an image file; ats reads regular files only"


def _expand(path: Path, *, recursive: bool, explicit: bool) -> list[InputItem]:
    if (why := _not_regular(path)) is not None:
        return [InputItem(path, error=why)] if explicit or is_input_file(path) or path.suffix.lower() == ".csv" else []
    if path.is_dir() and not is_store(path):
        if (path / DATASET_JSON).is_file() and (path / "test.csv").is_file():
            return read_inputs_csv(path / "test.csv")
        images = find_inputs(path, recursive)
        if not images and explicit:
            hint = "" if recursive else " (sub-directories are searched with --recursive)"
            return [InputItem(path, error=f"{path}: a directory with no image files{hint}")]
        return [InputItem(p) for p in images]
    if path.suffix.lower() == ".csv":
        return read_inputs_csv(path)
    if explicit or is_input_file(path):
        return [InputItem(path)]
    return []


def read_inputs_csv(path: str | os.PathLike[str]) -> list[InputItem]:
    """The rows of a dataset CSV (the ats dataset format, or any CSV with a ``path``
    column) as input items, read by the dataset loader's parser
    (:func:`ats_cli.data.dataset.read_csv`); ``label`` is the cell when the column exists
    (an empty cell is "": the empty set of a multi-label model, no label for a single-label
    one, :mod:`ats_cli.predict.metrics`), None without the column; every other column goes
    to ``extra``. Relative paths are
    relative to the CSV's directory, as in the dataset format. A row that cannot be used
    is a failed item naming the CSV and line; a CSV that cannot be read (no ``path``
    column, not CSV, not UTF-8) is one failed item naming it."""
    path = Path(path)
    table = read_csv(path, required=("path",))
    if table.error is not None:
        return [InputItem(path, error=str(table.error))]
    if not table.rows:
        return [InputItem(path, error=f"{path}: the CSV has no rows")]
    labelled = "label" in table.columns
    items = []
    first: dict[str, CsvRow] = {}  # a file's first row (its label)
    for row in table.rows:
        if row.problem is not None:
            items.append(InputItem(path, error=str(row.problem)))
            continue
        if not is_url(row.path) and (why := _not_regular(row.path)) is not None:
            items.append(InputItem(row.path, error=f"{path}:{row.line}: {why}"))
            continue
        key = row.path if is_url(row.path) else os.path.normcase(os.path.abspath(row.path))
        seen = first.setdefault(key, row)
        if seen is not row and labelled and sorted(split_label(seen.label)) != sorted(split_label(row.label)):
            items.append(InputItem(path, error=f"{path}:{row.line}: {row.raw_path} is listed again with label "
                                   f"{row.label!r}, line {seen.line} gives it {seen.label!r}; one file has one "
                                   "label: remove or correct one of the rows"))
            continue
        items.append(InputItem(row.path, label=row.label if labelled else None, extra=row.extra))
    return items
