"""Predicting the class of image files with a trained model.

The pieces, in the order ``ats predict`` uses them:

* :func:`load_predictor` loads and checks the model first, so a wrong ``--model`` fails
  before any image is touched;
* :func:`resolve_inputs` turns command-line arguments (files, directories, glob
  patterns, dataset CSVs, dataset directories) into one ordered list of images, with
  labels when a CSV provides them;
* :func:`ats_cli.data.inputs.open_input` is the ONE place a file becomes (low-res
  view, patch source, tissue mask), for ordinary images and slides alike; training's
  data loader uses it too;
* :meth:`Predictor.predict` batches images of equal size, averages ``samples``
  independent samplings and never lets one bad file stop the others: a failure becomes
  a row with an ``error`` (naming the file) instead of an exception;
* :func:`write_predictions_csv` and :func:`evaluate` turn the rows into the CSV and,
  when labels are known, accuracy and a confusion matrix.
"""

from __future__ import annotations

import csv
import functools
import glob
import io
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ats_cli.checkpoint import CheckpointError, load_model
from ats_cli.core.model import ATSModel, ATSOutput
from ats_cli.core.sampling import ESTIMATORS
from ats_cli.data.dataset import DATASET_JSON, read_csv
from ats_cli.data.formats import is_input_file
from ats_cli.data.images import ImageReadError
from ats_cli.data.inputs import OpenedImage, batch_sources, batch_support, open_input
from ats_cli.inference import predict_probs
from ats_cli.io import atomic_write_text
from ats_cli.runtime import resolve_device

__all__ = [
    "Evaluation",
    "InputItem",
    "OpenedImage",
    "PredictionInterrupted",
    "PredictionRow",
    "Predictor",
    "evaluate",
    "load_predictor",
    "open_input",
    "predict_paths",
    "resolve_inputs",
    "resolve_model_path",
    "write_predictions_csv",
]

CHECKPOINT_NAMES = ("best.pt", "last.pt")  # what a run directory given as --model stands for, in order
_GLOB_CHARS = "*?["


# ---------------------------------------------------------------------------- the model


def resolve_model_path(path: str | os.PathLike[str]) -> Path:
    """``path`` itself, or for a run directory its ``best.pt`` (else ``last.pt``), so
    ``--model runs/mnist`` works. Raises :class:`CheckpointError` naming the path."""
    path = Path(path).expanduser()
    if path.is_dir():
        for name in CHECKPOINT_NAMES:
            if (path / name).is_file():
                return path / name
        raise CheckpointError(f"{path}: a directory without {' or '.join(CHECKPOINT_NAMES)}; give a model file")
    return path


@dataclass
class Predictor:
    """A loaded model and what prediction needs to know about it."""

    model: ATSModel
    classes: list[str]
    channels: int
    device: torch.device
    path: Path
    input_options: Mapping[str, object] = field(default_factory=dict)  # how training read its inputs

    def opener(self, *, reader: str | None = None, level: int | None = None, mpp: float | None = None,
               tissue: bool | str | None = None, max_pixels: int | None = None) -> Callable[..., OpenedImage]:
        """:func:`open_input` with the reading options training used (saved in the model:
        reader, level or mpp, tissue mask), each overridden by the caller's when given;
        a given level replaces a saved mpp and vice versa; ``tissue="auto"``: open_input's
        rule by file type, whatever the model was trained with. ``max_pixels``: the pixel
        budget (:mod:`ats_cli.data.slides`; default ``ATS_MAX_PIXELS``, else 64 M)."""
        opts = dict(self.input_options)
        if max_pixels is not None:
            opts["max_pixels"] = max_pixels
        if level is not None or mpp is not None:
            opts["level"], opts["mpp"] = level, mpp
        if reader is not None:
            opts["reader"] = reader
        if tissue is not None:
            opts["tissue"] = None if tissue == "auto" else tissue
        return functools.partial(open_input, **opts)

    def predict(
        self,
        items: Sequence[InputItem],
        *,
        n_patches: int | None = None,
        samples: int = 1,
        batch_size: int = 1,
        seed: int = 0,
        reader: Callable[..., OpenedImage] | None = None,
        progress: Callable[[int, int], None] | None = None,
        on_output: Callable[[int, PredictionRow, OpenedImage, ATSOutput, int], None] | None = None,
    ) -> list[PredictionRow]:
        """One row per item, in the items' order; failures are rows with ``error`` set.

        Images of equal size are stacked into batches of up to ``batch_size`` (different
        sizes cannot share a tensor, so they are batched separately). The sampling
        generator is re-seeded with ``seed`` at the start of every batch: the output is a
        function of (model, inputs, seed, n_patches, samples, batch_size), and with
        ``batch_size=1`` (the default) a file's probabilities do not depend on which other
        files were predicted with it. ``reader`` replaces :func:`open_input` (e.g. a
        whole-slide reader); ``progress(done, total)`` is called as items finish.

        A model output that is not finite (NaN, inf) is an error row for that image, never
        a prediction. Ctrl-C raises :class:`PredictionInterrupted` holding the rows done.

        ``on_output(index, row, opened, output, b)`` is called for each successful row, as
        it is predicted, with the model output of its batch's last sampling (row ``b``),
        e.g. to save the attention (``ats predict --save-attention``); it must not raise.
        """
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        if n_patches is not None and n_patches < 1:
            raise ValueError(f"n_patches must be >= 1, got {n_patches}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        read = reader or self.opener()
        rows: list[PredictionRow | None] = [None] * len(items)
        pending: dict[tuple, list[tuple[int, OpenedImage]]] = {}
        done = 0

        def finish(index: int, row: PredictionRow) -> None:
            nonlocal done
            rows[index] = row
            done += 1
            if progress:
                progress(done, len(items))

        def run(batch: list[tuple[int, OpenedImage]]) -> None:
            try:
                probs, output = self._probs([img for _, img in batch], n_patches, samples, seed)
            except Exception as e:  # a patch that cannot be read, a model error: this input fails, not the run
                if len(batch) > 1:  # find out which image it was: retry one by one
                    for one in batch:
                        run([one])
                    return
                index, _ = batch[0]
                finish(index, _failed(items[index], f"{items[index].path}: prediction failed ({_first_line(e)})"))
                return
            for b, ((index, opened), p) in enumerate(zip(batch, probs.tolist(), strict=True)):
                if not all(math.isfinite(v) for v in p):
                    finish(index, _failed(items[index], f"{items[index].path}: the model's output is not finite "
                                                        f"(probabilities {', '.join(f'{v:g}' for v in p)}); no "
                                                        "prediction"))
                    continue
                row = PredictionRow(path=items[index].path, label=items[index].label,
                                    prediction=self.classes[max(range(len(p)), key=p.__getitem__)], probs=tuple(p))
                if on_output is not None:
                    on_output(index, row, opened, output, b)
                finish(index, row)

        try:
            for index, item in enumerate(items):
                if item.error is not None:
                    finish(index, _failed(item, item.error))
                    continue
                try:
                    opened = read(item.path, channels=self.channels, scale=self.model.scale,
                                  patch_size=self.model.patch_size)
                except Exception as e:  # whatever a reader raises: this file fails, the others go on
                    text = _first_line(e)
                    if not isinstance(e, (ImageReadError, OSError, ValueError)):
                        text = f"{type(e).__name__}: {text}"
                    finish(index, _failed(item, text if str(item.path) in text else f"{item.path}: {text}"))
                    continue
                key = (tuple(opened.low.shape), tuple(opened.source.size))
                group = pending.setdefault(key, [])
                group.append((index, opened))
                if len(group) >= batch_size:
                    run(pending.pop(key))
            for key in list(pending):
                run(pending.pop(key))
        except KeyboardInterrupt:
            raise PredictionInterrupted([row for row in rows if row is not None], len(items)) from None
        return [row for row in rows if row is not None]

    def _probs(self, images: list[OpenedImage], n_patches: int | None, samples: int, seed: int
               ) -> tuple[torch.Tensor, ATSOutput]:
        low = torch.stack([img.low for img in images]).to(self.device)
        sources = batch_sources([img.source for img in images])
        masks = batch_support([img.support for img in images], low.shape[-2:])  # a batch shares one view size
        generator = torch.Generator(device=self.device).manual_seed(seed)
        probs, output = predict_probs(self.model, low, sources, n_patches=n_patches, samples=samples,
                                      generator=generator, support_mask=masks)
        return probs.cpu(), output


class PredictionInterrupted(KeyboardInterrupt):
    """Ctrl-C during :meth:`Predictor.predict`: ``rows`` are the inputs finished before it
    (in input order), ``total`` how many there were. A KeyboardInterrupt, so a caller that
    does not handle it stops as on any Ctrl-C."""

    def __init__(self, rows: list[PredictionRow], total: int):
        super().__init__(f"interrupted after {len(rows)} of {total} input(s)")
        self.rows, self.total = rows, total


def load_predictor(model: str | os.PathLike[str], device: str = "auto", *, estimator: str | None = None
                   ) -> Predictor:
    """Load a checkpoint (or a run directory's best.pt) for prediction on ``device``
    ('auto' = CUDA if present); ``estimator`` replaces the model's (see
    :mod:`ats_cli.core.sampling`). Raises :class:`CheckpointError` naming the file for a
    missing, foreign or corrupt model, and ValueError for an unusable device or an
    estimator the model cannot use."""
    dev = resolve_device(device)
    path = resolve_model_path(model)
    net, ckpt = load_model(path, dev)
    if estimator is not None:
        if not hasattr(net, "estimator"):
            raise ValueError(f"{path}: a model trained with --method {ckpt['spec'].get('method')} does not sample "
                             "patches, so it has no estimator to choose")
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r}; choose from {', '.join(ESTIMATORS)}")
        net.estimator = estimator
    classes = [str(c) for c in ckpt.get("classes", [])]
    n_out = net.classifier.out_features
    if len(classes) != n_out:
        raise CheckpointError(f"{path}: lists {len(classes)} class names for a model with {n_out} outputs")
    channels = int(ckpt["spec"]["channels"])
    saved = ckpt["spec"]["input"]  # for models saved without it: ats_cli.legacy
    options = {k: saved.get(k) for k in ("reader", "level", "mpp", "tissue")}
    return Predictor(model=net, classes=classes, channels=channels, device=dev, path=path, input_options=options)


# ---------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class InputItem:
    """One image to predict. ``label`` (a class name) comes from a dataset CSV; ``extra``
    holds that CSV row's other columns (e.g. the ``digits`` boxes); ``error`` is set when
    the argument could not even be turned into an image path (it then becomes a failed row)."""

    path: Path
    label: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None


def resolve_inputs(specs: Iterable[str | os.PathLike[str]], *, recursive: bool = False) -> list[InputItem]:
    """Command-line arguments -> images, in argument order, each file once.

    * an existing file: a ``.csv`` is a dataset CSV (``path`` column, optional ``label``;
      relative paths are relative to the CSV's directory); anything else is an image;
    * a directory holding ``dataset.json`` and ``test.csv``: that dataset's test split;
    * any other directory: the image files in it (the suffixes of
      :data:`ats_cli.data.formats.BACKENDS`, sorted by name, hidden files skipped),
      including sub-directories when ``recursive``;
    * a pattern with ``* ? [`` that is not an existing path: expanded here (``**``
      included), for shells that do not; matched directories and CSVs are treated as
      above, other matches only if they are image files.

    Problems (a missing path, an empty directory, a pattern that matches nothing, a bad
    CSV) become items with ``error`` set rather than exceptions, so that one typo does
    not stop the other inputs. A file reached twice is kept at its first position.
    """
    items: list[InputItem] = []
    seen: set[str] = set()

    def add(item: InputItem) -> None:
        key = os.path.normcase(os.path.abspath(item.path))
        if item.error is None and key in seen:
            return
        seen.add(key)
        items.append(item)

    for spec in specs:
        text = os.fspath(spec)
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
            add(InputItem(path, error=f"{path}: no such file or directory"))
    return items


def _expand(path: Path, *, recursive: bool, explicit: bool) -> list[InputItem]:
    if path.is_dir():
        if (path / DATASET_JSON).is_file() and (path / "test.csv").is_file():
            return read_inputs_csv(path / "test.csv")
        files = path.rglob("*") if recursive else path.iterdir()
        images = sorted((p for p in files if p.is_file() and is_input_file(p)), key=lambda p: str(p))
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
    (:func:`ats_cli.data.dataset.read_csv`); ``label`` is kept when the column exists and
    the cell is not empty, every other column goes to ``extra``. Relative paths are
    relative to the CSV's directory, as in the dataset format. A row that cannot be used
    is a failed item naming the CSV and line; a CSV that cannot be read (no ``path``
    column, not CSV, not UTF-8) is one failed item naming it."""
    path = Path(path)
    table = read_csv(path, required=("path",))
    if table.error is not None:
        return [InputItem(path, error=str(table.error))]
    if not table.rows:
        return [InputItem(path, error=f"{path}: the CSV has no rows")]
    return [InputItem(path, error=str(row.problem)) if row.problem is not None
            else InputItem(row.path, label=row.label or None, extra=row.extra) for row in table.rows]


# ---------------------------------------------------------------------------- reading


# ---------------------------------------------------------------------------- results


@dataclass(frozen=True)
class PredictionRow:
    """The outcome for one input: ``prediction`` (a class name) and ``probs`` (one per
    class, in the model's class order, summing to 1), or ``error`` (naming the file)."""

    path: Path
    label: str | None = None
    prediction: str | None = None
    probs: tuple[float, ...] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _failed(item: InputItem, message: str) -> PredictionRow:
    return PredictionRow(path=item.path, label=item.label, error=message)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def predictions_csv_text(rows: Sequence[PredictionRow], classes: Sequence[str]) -> str:
    """The CSV of the successful rows: ``path,prediction,prob_<class>...`` and, when any
    row has a label, a final ``label`` column. Failed rows are left out on purpose: every
    row of the file then has numbers a spreadsheet or pandas can use as they are; the
    failures are reported separately (``ats predict`` lists them on stderr)."""
    with_labels = any(r.label is not None for r in rows if r.ok)
    header = ["path", "prediction", *(f"prob_{c}" for c in classes)] + (["label"] if with_labels else [])
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


@dataclass(frozen=True)
class Evaluation:
    """Accuracy over the predicted rows that have a label, and the confusion matrix
    ``matrix[i][j]`` = images of label ``labels[i]`` predicted as ``classes[j]``.
    ``labels`` is the model's classes followed by any label the model does not know
    (those rows can never be right, and hiding them would overstate accuracy)."""

    n: int
    correct: int
    labels: list[str]
    classes: list[str]
    matrix: list[list[int]]

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else float("nan")

    @property
    def unknown_labels(self) -> list[str]:
        return self.labels[len(self.classes):]


def evaluate(rows: Sequence[PredictionRow], classes: Sequence[str]) -> Evaluation | None:
    """Accuracy and confusion matrix of the labelled, successful rows; None if there are none."""
    scored = [r for r in rows if r.ok and r.label is not None]
    if not scored:
        return None
    classes = [str(c) for c in classes]
    labels = classes + sorted({r.label for r in scored if r.label not in classes})
    li = {name: i for i, name in enumerate(labels)}
    ci = {name: i for i, name in enumerate(classes)}
    matrix = [[0] * len(classes) for _ in labels]
    for r in scored:
        matrix[li[r.label]][ci[r.prediction]] += 1
    correct = sum(r.label == r.prediction for r in scored)
    return Evaluation(n=len(scored), correct=correct, labels=labels, classes=classes, matrix=matrix)


def predict_paths(
    model: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]],
    *,
    device: str = "auto",
    recursive: bool = False,
    **options,
) -> list[PredictionRow]:
    """Library one-liner: load ``model``, resolve ``inputs`` as the command line does and
    predict them (``options``: n_patches, samples, batch_size, seed, reader, progress)."""
    predictor = load_predictor(model, device)
    return predictor.predict(resolve_inputs(inputs, recursive=recursive), **options)
