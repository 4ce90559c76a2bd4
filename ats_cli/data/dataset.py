"""The one on-disk dataset format, for generated and user data alike.

A dataset is a directory holding

* ``train.csv`` and ``test.csv`` (optionally ``val.csv``): columns ``path,label``,
  where ``path`` is relative to the directory, absolute, or a URL
  (:mod:`ats_cli.data.remote`) and ``label`` is a class *name*, or for a multi-label
  dataset several ``;``-separated (``3;7``, empty for none; :mod:`ats_cli.multilabel`);
  any further columns are kept verbatim as "extra" columns;
* ``dataset.json``: ``{"classes": [...]}`` (class names in label-index order), optional
  ``recipe`` (the name of the recipe ``ats train`` starts from: :mod:`ats_cli.recipes`),
  optional ``hints`` (facts of the images: ``channels``, ``image_size``, ``mpp``; older
  datasets also ``scale``, ``patch_size``, ..., still read), optional ``splits`` (the split
  names to read; defaults to whichever of train/val/test CSVs exist), optional ``task``
  (``"multilabel"``: several classes per image; inferred when any label holds ``;``) and,
  for generated data, a ``generator`` block with the generator's parameters and seed.

Why CSV + JSON: users can produce it with a spreadsheet or three lines of pandas, it
diffs well, and a dataset can reference images anywhere (absolute paths) without
copying gigabytes. Why validate everything up front: a typo in row 40,000 should fail in
one second at load time with the row named, not an hour into training.

Everything is written atomically (:mod:`ats_cli.io`), so a crash never leaves a
half-written CSV or JSON behind.

This module also says what a dataset's files may be, the two questions a manifest's
rows raise before any pixel is read, answered once for every command: which files are
inputs and which backend reads each (the suffix table), and what physical scale a file
may claim. Standard library only at import: ``ats --help`` and the CLI's option parsing
reach it.

**Which files are inputs.** ``ats predict DIR`` (which files in a directory are images),
``ats make-dataset from-folder`` (which files become rows), and
:func:`ats_cli.data.slides.open_image` (which reader opens a file, for ``ats info``,
``ats visualize``, ``ats predict`` and the training data loader) all decide from
:data:`BACKENDS`, so that a file one command accepts is one the others accept and read the
same way. Every suffix PIL can decode is listed (WebP, GIF and PPM/PGM too): a file listed
here is one a command picks up from a directory, and a format missing from one command's
list but not another's was a dataset that trained but could not be predicted by directory.

**What a physical scale may be.** A file's microns per pixel (mpp) decides how much is
allocated: a slide read at the model's 0.5 µm/px is resampled by ``its mpp / 0.5``, so a
512-pixel image whose tags say 1000 µm/px becomes a million pixels a side. Metadata is
whatever a writer put there, so a value is checked here before it is used, and refused by
name with the value and where it came from (the tag, the file, the flag). The plausible
range is :data:`MIN_MPP`-:data:`MAX_MPP` µm/px. Light microscopy samples from about 0.05
µm/px (100x oil immersion on a camera) to a few µm/px (a 1.25x overview); super-resolution
images reach a few hundredths; 100 µm/px draws a 25 mm slide in 250 pixels, a thumbnail.
Outside that range the value is not a microscope's: nanometre electron microscopy (not
what these models read) or, far more often, a print resolution (a photo tool's 72 dpi is
352.8 µm/px, 300 dpi 84.7). Resampling by such a value would not give wrong-but-usable
pixels: it would allocate without bound or shrink the image to one pixel, so it is refused
rather than used. The same bound keeps ``--mpp`` and ``--patch-um`` honest where the
configuration is settled (:func:`ats_cli.config.check_mpp_flag`,
:func:`ats_cli.config.patch_pixels`).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ats_cli.data.remote import is_url, url_suffix
from ats_cli.io import atomic_write_text
from ats_cli.multilabel import SEPARATOR, multi_hot, split_label

__all__ = ["DATASET_JSON", "KNOWN_SPLITS", "Dataset", "DatasetError", "Problem", "CsvRow", "CsvTable", "Record",
           "load_dataset", "read_csv", "write_dataset", "BACKENDS", "INPUT_SUFFIXES", "LAZY_BACKENDS", "OPENSLIDE",
           "OMEZARR", "PILLOW", "TIFFFILE", "VIRTUAL", "VIRTUAL_SUFFIX", "backend", "find_inputs", "input_exists",
           "is_input_file", "is_lazy", "is_store", "MIN_MPP", "MAX_MPP", "RANGE_TEXT", "mpp_problem"]

DATASET_JSON = "dataset.json"
KNOWN_SPLITS = ("train", "val", "test")
REQUIRED_SPLITS = ("train", "test")
FORMAT_NAME = "ats-dataset"
FORMAT_VERSION = 1
MAX_SHOWN = 10  # problems spelled out in an error message; the rest are counted


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a dataset: where (file and line; 0 = the file as a whole) and what."""

    file: str
    line: int
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.message}"


class DatasetError(ValueError):
    """A dataset directory that cannot be used, with every problem found.

    Raised once per load with all problems collected (``.problems``), so a user fixes a
    CSV in one pass instead of one error per run. The message lists the first few as
    ``file:line: problem`` (line numbers count the header as line 1, as editors do).
    """

    def __init__(self, root: str | os.PathLike[str], problems: Sequence[Problem]):
        self.root = Path(root)
        self.problems = list(problems)
        shown = "\n".join(f"  {p}" for p in self.problems[:MAX_SHOWN])
        more = len(self.problems) - MAX_SHOWN
        tail = f"\n  ... and {more} more" if more > 0 else ""
        noun = "problem" if len(self.problems) == 1 else "problems"
        if len(self.problems) == 1 and self.problems[0].file == str(self.root) and not self.problems[0].line:
            super().__init__(str(self.problems[0]))  # the folder itself is wrong: one line says so
            return
        super().__init__(f"dataset {self.root}: {len(self.problems)} {noun}:\n{shown}{tail}")


@dataclass(frozen=True)
class Record:
    """One image of a split.

    ``path`` is absolute (or a URL); ``label`` is the index into ``Dataset.classes``; ``extra`` holds
    the CSV's other columns as strings (e.g. the generator's ``digits`` boxes); ``line`` is
    the CSV line, kept so later errors (an unreadable image) can point back to the row.
    In a multi-label dataset ``label`` is -1, ``label_name`` the classes ``;``-joined in
    class order and ``multi_hot`` their 0/1 vector over the classes (None otherwise).
    """

    path: Path | str  # a URL stays the URL string (ats_cli.data.remote)
    label: int
    label_name: str
    extra: Mapping[str, str] = field(default_factory=dict)
    line: int = 0
    multi_hot: tuple[float, ...] | None = None

    @property
    def target(self) -> int | tuple[float, ...]:
        """What training compares the logits with: the class index, or the multi-hot vector."""
        return self.label if self.multi_hot is None else self.multi_hot


@dataclass(frozen=True)
class Dataset:
    """A validated dataset: class names, records per split, hints and the raw ``dataset.json``."""

    root: Path
    classes: list[str]
    splits: dict[str, list[Record]]
    hints: dict[str, Any]
    meta: dict[str, Any]
    multilabel: bool = False  # several classes per image (ats_cli.multilabel)

    @property
    def recipe(self) -> str:
        """The recipe dataset.json names (ats_cli.recipes.dataset_recipe reads it, a relative
        path as the directory's); "" for none."""
        return str(self.meta.get("recipe") or "")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __getitem__(self, split: str) -> list[Record]:
        try:
            return self.splits[split]
        except KeyError:
            raise KeyError(f"dataset {self.root} has no split {split!r} (it has {sorted(self.splits)})") from None


# ---------------------------------------------------------------------------- writing


def _csv_text(rows: Sequence[Mapping[str, Any]], split: str) -> str:
    columns = ["path", "label"]
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(key)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n", extrasaction="raise")
    writer.writeheader()
    for i, row in enumerate(rows):
        if "path" not in row or "label" not in row:
            raise ValueError(f"{split}.csv row {i + 1}: every row needs 'path' and 'label', got {sorted(row)}")
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


def write_dataset(
    root: str | os.PathLike[str],
    classes: Sequence[str],
    splits: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    hints: Mapping[str, Any] | None = None,
    generator: Mapping[str, Any] | None = None,
    description: str | None = None,
    task: str | None = None,
    recipe: str | None = None,
) -> Path:
    """Write the CSVs and ``dataset.json`` of a dataset into ``root``; return the JSON's path.

    ``splits`` maps a split name (train/val/test) to its rows; each row is a mapping with
    ``path`` (relative to ``root`` or absolute) and ``label`` (a class name), plus any
    extra columns (written in first-seen order). ``recipe``: the recipe ``ats train`` uses
    for this data when given none (a generator knows what its images need). The CSVs are written first and
    ``dataset.json`` last, so its presence means the dataset is complete. Split CSVs from
    an earlier write that this one does not name are left alone but no longer listed.
    """
    root = Path(root)
    unknown = [s for s in splits if s not in KNOWN_SPLITS]
    if unknown:
        raise ValueError(f"unknown split name(s) {unknown}; use {list(KNOWN_SPLITS)}")
    if len(set(classes)) != len(classes):
        raise ValueError(f"class names must be unique, got {list(classes)}")
    root.mkdir(parents=True, exist_ok=True)
    ordered = [s for s in KNOWN_SPLITS if s in splits]
    for split in ordered:
        atomic_write_text(root / f"{split}.csv", _csv_text(splits[split], split))
    meta: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION}
    if description:
        meta["description"] = description
    if task is not None:
        meta["task"] = task
    meta["classes"] = [str(c) for c in classes]
    meta["splits"] = ordered
    if recipe:
        meta["recipe"] = recipe
    meta["hints"] = dict(hints or {})
    if generator is not None:
        meta["generator"] = dict(generator)
    path = root / DATASET_JSON
    atomic_write_text(path, json.dumps(meta, indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------- loading


def _read_meta(root: Path, problems: list[Problem]) -> dict[str, Any] | None:
    path = root / DATASET_JSON
    if not path.is_file():
        problems.append(Problem(DATASET_JSON, 0, "missing (it must list the class names: {\"classes\": [...]})"))
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        line = getattr(err, "lineno", 0)
        problems.append(Problem(DATASET_JSON, line, f"not valid JSON ({err})"))
        return None
    if not isinstance(meta, dict):
        problems.append(Problem(DATASET_JSON, 0, "must hold a JSON object"))
        return None
    classes = meta.get("classes")
    if not isinstance(classes, list) or not classes or not all(isinstance(c, (str, int)) for c in classes):
        problems.append(Problem(DATASET_JSON, 0, "'classes' must be a non-empty list of class names"))
        return None
    names = [str(c) for c in classes]
    dupes = sorted({c for c in names if names.count(c) > 1})
    if dupes:
        problems.append(Problem(DATASET_JSON, 0, f"duplicate class names {dupes}"))
    hints = meta.get("hints", {})
    if not isinstance(hints, dict):
        problems.append(Problem(DATASET_JSON, 0, "'hints' must be a JSON object"))
    if not isinstance(meta.get("recipe", ""), str):
        problems.append(Problem(DATASET_JSON, 0, "'recipe' must be a recipe's name (a string: ats train --recipes)"))
    meta["classes"] = names
    return meta


def _split_names(root: Path, meta: Mapping[str, Any], problems: list[Problem]) -> list[str]:
    listed = meta.get("splits")
    if listed is None:
        names = [s for s in KNOWN_SPLITS if (root / f"{s}.csv").is_file()]
        names += [s for s in REQUIRED_SPLITS if s not in names]
        return [s for s in KNOWN_SPLITS if s in names]
    if not isinstance(listed, list) or any(s not in KNOWN_SPLITS for s in listed):
        problems.append(Problem(DATASET_JSON, 0, f"'splits' must be a list drawn from {list(KNOWN_SPLITS)}"))
        return []
    missing = [s for s in REQUIRED_SPLITS if s not in listed]
    if missing:
        problems.append(Problem(DATASET_JSON, 0, f"'splits' must include {missing}"))
    return list(listed)


def check_dataset_root(root: Path) -> None:
    """Refuse in one line a ``root`` that cannot be a dataset folder, saying what it is and
    the next step: it does not exist (not "not a directory", which sends a user looking for
    a file in its place), it is a file, or it is a folder of class folders with no
    ``dataset.json``, the layout a new user has first, which ``ats make-dataset
    from-folder`` turns into a dataset."""
    if not root.exists():
        raise DatasetError(root, [Problem(str(root), 0, "does not exist")])
    if not root.is_dir():
        raise DatasetError(root, [Problem(str(root), 0, f"is a file, not a dataset folder (a folder with "
                                                        f"{DATASET_JSON}, train.csv and test.csv)")])
    if (root / DATASET_JSON).exists() or any((root / f"{s}.csv").exists() for s in KNOWN_SPLITS):
        return  # a dataset with a piece missing: the loader lists what
    classes = _class_folders(root)
    if classes:
        shown = ", ".join(classes[:3]) + (", ..." if len(classes) > 3 else "")
        raise DatasetError(root, [Problem(str(root), 0, f"has class folders ({shown}) but no {DATASET_JSON}: run "
                                                        f"`ats make-dataset from-folder {root} DATA` first, then "
                                                        "use DATA")])


def _class_folders(root: Path, look: int = 200) -> list[str]:
    """The sub-folders of ``root`` that hold image files directly, looking at no more than
    ``look`` entries of each (a folder of 100k slides is not listed whole for a hint)."""
    found = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            with os.scandir(sub) as entries:
                if any((e.is_file() or is_store(e.path)) and backend(e.name) is not None
                       for e in itertools.islice(entries, look)):
                    found.append(sub.name)
        except OSError:
            continue
    return found


def load_dataset(root: str | os.PathLike[str], *, check_files: bool = True) -> Dataset:
    """Read and validate the dataset in ``root``.

    Checks, across all splits at once: ``dataset.json`` is present and names the classes;
    each split CSV exists, has ``path`` and ``label`` columns and at least one row; every
    row's file exists (unless ``check_files`` is false), its label is a known class name
    and its path appears only once in the whole dataset (a file in both train and test
    would leak). Raises one :class:`DatasetError` listing every problem found.
    """
    root = Path(root).expanduser().resolve()
    problems: list[Problem] = []
    check_dataset_root(root)
    meta = _read_meta(root, problems)
    if meta is None:
        raise DatasetError(root, problems)
    classes: list[str] = meta["classes"]
    index = {name: i for i, name in enumerate(classes)}
    seen: dict[Path, str] = {}
    splits: dict[str, list[Record]] = {}
    tables: dict[str, CsvTable] = {}
    for split in _split_names(root, meta, problems):
        name = f"{split}.csv"
        if not (root / name).is_file():
            problems.append(Problem(name, 0, "missing"))
            continue
        tables[split] = read_csv(root / name, name=name)
    multilabel = meta.get("task") == "multilabel" or any(
        SEPARATOR in row.label for table in tables.values() for row in table.rows)
    for split, table in tables.items():
        name = f"{split}.csv"
        records: list[Record] = []
        for row in table.rows:
            if row.problem is not None:
                problems.append(row.problem)
                continue
            if row.path in seen:
                problems.append(Problem(name, row.line, f"duplicate path {row.raw_path!r} (first at {seen[row.path]})"))
            else:
                seen[row.path] = f"{name}:{row.line}"
            names = split_label(row.label) if multilabel else [row.label]
            unknown = [n for n in names if n not in index]
            if unknown:
                problems.append(Problem(name, row.line, f"unknown label {unknown[0]!r} (classes: {_short(classes)})"))
                continue
            if check_files and not input_exists(row.path):
                problems.append(Problem(name, row.line, f"{row.raw_path!r} is a directory, not an image file"
                                        if row.path.is_dir() else f"missing file {row.raw_path!r}"))
                continue
            if multilabel:
                chosen = sorted({index[n] for n in names})
                records.append(Record(row.path, -1, SEPARATOR.join(classes[i] for i in chosen), row.extra, row.line,
                                      multi_hot(chosen, len(classes))))
            else:
                records.append(Record(row.path, index[row.label], row.label, row.extra, row.line))
        if table.error is not None:  # it also explains why there are no (more) rows
            problems.append(table.error)
        elif not table.rows:
            problems.append(Problem(name, 0, "empty split: no rows after the header"))
        splits[split] = records
    if problems:
        raise DatasetError(root, problems)
    hints = dict(meta.get("hints") or {})
    return Dataset(root=root, classes=classes, splits=splits, hints=hints, meta=meta, multilabel=multilabel)


@dataclass(frozen=True)
class CsvRow:
    """One data row of a dataset CSV, as :func:`read_csv` parsed it.

    ``path`` is absolute and normalised (a relative ``path`` cell is relative to the CSV's
    directory); ``raw_path`` is the cell as written (for messages); ``label`` is the
    stripped ``label`` cell ("" when absent); ``extra`` holds the other columns. ``line``
    is where the row ends (header = line 1). A row that cannot be used has ``problem``
    set, naming its line, and nothing else.
    """

    line: int
    path: Path | str = Path()  # a URL cell stays the URL string (ats_cli.data.remote)
    raw_path: str = ""
    label: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)
    problem: Problem | None = None


@dataclass(frozen=True)
class CsvTable:
    """What :func:`read_csv` read: the rows in file order, and ``error``, the problem that
    stopped it (a missing column, invalid CSV, not UTF-8) after the rows before it."""

    rows: list[CsvRow]
    error: Problem | None = None
    columns: list[str] = field(default_factory=list)  # the header's (a cell of a column it lacks reads "")


def read_csv(path: str | os.PathLike[str], *, required: Sequence[str] = ("path", "label"),
             name: str | None = None) -> CsvTable:
    """Parse a dataset CSV (``path,label[,more]``) or ``ats predict``'s CSV input (where
    only ``path`` is ``required``): the one CSV reader, so both accept and refuse the same
    rows with the same messages. Never raises for the file's content or an unreadable
    file: every problem is a :class:`Problem` naming ``name`` (default: the path) and the
    line, so that callers can report them all at once.

    Row problems: a quote never closed (it swallows the lines after it into one field,
    so it is named by the line it opens on rather than reported as a missing file), more
    fields than the header, an empty path.
    """
    path = Path(path)
    name = str(path) if name is None else name
    rows: list[CsvRow] = []
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            try:
                header = reader.fieldnames or []
                absent = [c for c in required if c not in header]
                if absent:
                    return CsvTable(rows, Problem(name, 1, f"header {header} lacks column(s) {absent}"))
                start = reader.line_num + 1  # the line the next row starts on
                for row in reader:
                    rows.append(_csv_row(row, name, start, reader.line_num, len(header), path.parent))
                    start = reader.line_num + 1
            except csv.Error as e:  # a NUL byte, an over-long field
                return CsvTable(rows, Problem(name, reader.line_num, f"not valid CSV ({e})"), list(header))
    except UnicodeDecodeError as e:
        return CsvTable(rows, Problem(name, 0, f"not UTF-8 text ({e})"))
    except OSError as e:
        return CsvTable(rows, Problem(name, 0, f"cannot be read ({e.strerror or e})"))
    return CsvTable(rows, columns=list(header))


def _csv_row(row: Mapping[str | None, Any], name: str, start: int, end: int, n_columns: int, base: Path) -> CsvRow:
    raw_path = (row.get("path") or "").strip()
    label = (row.get("label") or "").strip()
    if "\n" in raw_path or "\n" in label:  # a quote left open swallows the lines after it
        return CsvRow(start, problem=Problem(name, start, "a quote opened on this line is never closed (the field "
                                             f"runs on to line {end}); close or remove it"))
    if None in row:  # more fields than the header has
        return CsvRow(end, problem=Problem(name, end, f"{n_columns + len(row[None])} fields, the header has "
                                           f"{n_columns}"))
    if not raw_path:
        return CsvRow(end, problem=Problem(name, end, "empty path"))
    if is_url(raw_path):  # a URL is kept as written (ats_cli.data.remote)
        file = raw_path
    else:
        file = Path(raw_path).expanduser()
        file = Path(os.path.normpath(file if file.is_absolute() else base / file))
    extra = {k: v for k, v in row.items() if k not in ("path", "label") and k is not None}
    return CsvRow(end, file, raw_path, label, extra)


def _short(items: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


# ---------------------------------------------------- which files are inputs, read by what

PILLOW, TIFFFILE, OPENSLIDE, VIRTUAL, OMEZARR = "pillow", "tifffile", "openslide", "virtual", "omezarr"
# read tile by tile (or chunk by chunk, or rendered region by region), never whole
LAZY_BACKENDS = (TIFFFILE, OPENSLIDE, VIRTUAL, OMEZARR)
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
    # an OME-Zarr store (a directory; .ome.zarr ends in .zarr): ats_cli.data.omezarr
    ".zarr": OMEZARR,
})
INPUT_SUFFIXES = (*BACKENDS, VIRTUAL_SUFFIX)


def backend(path: str | os.PathLike[str]) -> str | None:
    """The backend :data:`BACKENDS` gives ``path``'s suffix (case-insensitive); None for a
    suffix it does not list."""
    if is_url(path):  # the suffix of the URL's path, without a signed URL's query
        suffix = url_suffix(path)
        return VIRTUAL if path.lower().split("?")[0].endswith(VIRTUAL_SUFFIX) else BACKENDS.get(suffix)
    if str(path).lower().endswith(VIRTUAL_SUFFIX):
        return VIRTUAL
    return BACKENDS.get(Path(path).suffix.lower())


def is_input_file(path: str | os.PathLike[str]) -> bool:
    """Whether a file found in a directory is an input: a listed suffix, not hidden."""
    return backend(path) is not None and not Path(path).name.startswith(".")


def is_store(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an OME-Zarr store: a directory named ``*.zarr``. Such a
    directory is one input, never a folder of inputs: the commands that list a folder
    take it whole and do not walk into its chunks."""
    return not is_url(path) and backend(path) == OMEZARR and Path(path).is_dir()


def input_exists(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is there to be read as an input: a file, or an OME-Zarr store. A
    URL is taken as there: asking the server for each row would cost a dataset of
    100,000 URLs as many requests at every load; one that is not there is named, in one
    line, when it is read (:mod:`ats_cli.data.remote`)."""
    return is_url(path) or Path(path).is_file() or is_store(path)


def find_inputs(folder: str | os.PathLike[str], recursive: bool = True) -> list[Path]:
    """The inputs in ``folder`` (below it too when ``recursive``), sorted: files with a
    listed suffix, and OME-Zarr stores taken whole (never walked into: a store of a whole
    slide holds tens of thousands of chunk files, none of them an input). Hidden files
    and what is not a regular file (a FIFO) are left out; links to folders are not
    followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        stores = [d for d in dirnames if is_input_file(d) and backend(d) == OMEZARR]
        found += [here / d for d in stores]
        found += [here / f for f in filenames if is_input_file(f) and backend(f) != OMEZARR and (here / f).is_file()]
        dirnames[:] = sorted(d for d in dirnames if d not in stores) if recursive else []
    return sorted(found, key=str)


def is_lazy(path: str | os.PathLike[str], reader: str | None = None, level: int | None = None,
            mpp: float | None = None) -> bool:
    """Whether ``path`` is read through the lazy slide readers (a lazy backend: TIFFs and
    slide formats, or any file when a reader, level or mpp is asked for) rather than
    decoded whole. Here, beside the suffix table it reads: the preparer and the settling of
    the configuration ask it too, without reading any file."""
    return reader not in (None, "auto") or level is not None or mpp is not None or backend(path) in LAZY_BACKENDS


# ---------------------------------------------------------- what a physical scale may be

MIN_MPP = 0.01
MAX_MPP = 100.0
RANGE_TEXT = f"{MIN_MPP:g}-{MAX_MPP:g} µm/px"


def mpp_problem(value: float) -> str | None:
    """Why ``value`` µm/px cannot be a microscope's scale (None when it can): the text
    to put after the value and its source in a one-line error."""
    if not (math.isfinite(value) and MIN_MPP <= value <= MAX_MPP):
        return f"outside the plausible {RANGE_TEXT} of a microscope image"
    return None
