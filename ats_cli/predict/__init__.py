"""Predicting the class of image files with a trained model.

The modules, in the order ``ats predict`` uses them:

* :mod:`.predictor`: :func:`load_predictor` loads and checks the model first, so a wrong
  ``--model`` fails before any image is touched;
* :mod:`.inputs`: :func:`resolve_inputs` turns command-line arguments (files,
  directories, glob patterns, dataset CSVs, dataset directories) into one ordered list of
  images, with labels when a CSV provides them;
* :mod:`.predictor` again: :meth:`Predictor.predict` opens each image with
  :func:`ats_cli.data.inputs.open_input` (the ONE place a file becomes a low-res view, a
  patch source and a tissue mask, for training too), batches images of equal size,
  averages ``samples`` independent samplings and turns a failure into a row with an
  ``error`` (naming the file) instead of an exception;
* :mod:`.output`: :func:`write_predictions_csv` writes the rows, and
  :class:`AttentionSaver` the attention as GeoJSON (``--save-attention``);
* :mod:`.cohort`: ``--out FILE`` keeps every finished input in a part file per process,
  resumes from them and merges one CSV (``--devices N``, torchrun);
* :mod:`.provenance`: what made ``FILE`` (``FILE.ats.json``: model digest, settings,
  inputs), checked before anything in it counts as done, and its one-writer lock;
* :mod:`.metrics`: :func:`evaluate`, accuracy and a confusion matrix when labels are known;
* :mod:`.report`: what ``ats predict`` prints on the terminal (not imported here: the
  library needs none of it);
* :mod:`.session`, :mod:`.run` and :mod:`.launch`: the ``ats predict`` command itself
  (its checks before any image is read; one process, or one rank of several, to the
  terminal or to ``--out FILE``; ``--devices N``), so that the CLI only parses flags.

Everything a caller needs is importable from ``ats_cli.predict`` itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ats_cli.data.inputs import OpenedImage, open_input
from ats_cli.predict.inputs import InputItem, read_inputs_csv, resolve_inputs
from ats_cli.predict.metrics import Evaluation, evaluate
from ats_cli.predict.output import AttentionSaver, predictions_csv_text, write_predictions_csv
from ats_cli.predict.predictor import (
    PredictionInterrupted,
    PredictionRow,
    Predictor,
    load_predictor,
    resolve_model_path,
)

__all__ = [
    "AttentionSaver",
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
    "predictions_csv_text",
    "read_inputs_csv",
    "resolve_inputs",
    "resolve_model_path",
    "write_predictions_csv",
]


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
