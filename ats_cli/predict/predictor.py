"""The model side of prediction: load a checkpoint, then turn images into rows.

:func:`load_predictor` loads and checks the model first, so a wrong ``--model`` fails
before any image is touched. :meth:`Predictor.predict` batches images of equal size,
averages ``samples`` independent samplings and never lets one bad file stop the others:
a failure becomes a :class:`PredictionRow` with an ``error`` (naming the file) instead of
an exception. Files are opened by :func:`ats_cli.data.inputs.open_input`, the ONE place a
file becomes (low-res view, patch source, tissue mask), for ordinary images and slides
alike; training's data loader uses it too.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ats_cli.baselines_tilemil import attach_feature_store
from ats_cli.checkpoint import CheckpointError, load_model
from ats_cli.core.model import ATSModel, ATSOutput
from ats_cli.core.sampling import ESTIMATORS
from ats_cli.data.images import ImageReadError
from ats_cli.data.inputs import OpenedImage, batch_sources, batch_support, batch_views, open_input
from ats_cli.inference import predict_probs
from ats_cli.io import first_line
from ats_cli.multilabel import DEFAULT_THRESHOLD, decide, is_multilabel
from ats_cli.predict.inputs import InputItem
from ats_cli.runtime import resolve_device

__all__ = ["PredictionInterrupted", "PredictionRow", "Predictor", "load_predictor", "resolve_model_path"]



@dataclass(frozen=True)
class PredictionRow:
    """The outcome for one input: ``prediction`` (a class name) and ``probs`` (one per
    class, in the model's class order, summing to 1), or ``error`` (naming the file). A
    multi-label model's ``prediction`` is the set of classes whose probability (one sigmoid
    each) reaches the predictor's threshold, ``;``-joined ("" for none)."""

    path: Path
    label: str | None = None
    prediction: str | None = None
    probs: tuple[float, ...] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def load_predictor(model: str | os.PathLike[str], device: str = "auto", *, estimator: str | None = None,
                   threshold: float | None = None) -> Predictor:
    """Load a checkpoint (or a run directory's best.pt) for prediction on ``device``
    ('auto' = CUDA if present); ``estimator`` replaces the model's (see
    :mod:`ats_cli.core.sampling`). Raises :class:`CheckpointError` naming the file for a
    missing, foreign or corrupt model, and ValueError for an unusable device or an
    estimator the model cannot use. ``threshold``: a multi-label model's decision threshold
    (default 0.5; refused for a single-label model, which has none)."""
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
    attach_feature_store(net, ckpt["spec"], path)  # tile-mil: its tiles' features, read back where stored
    saved = ckpt["spec"]["input"]
    options = {k: saved.get(k) for k in ("reader", "level", "mpp", "tissue", "resample")}
    return Predictor(model=net, classes=classes, channels=channels, device=dev, path=path, input_options=options,
                     threshold=decision_threshold(net, threshold, path))


def decision_threshold(model: torch.nn.Module, threshold: float | None, path: Path) -> float | None:
    """The threshold in force: ``threshold`` or 0.5 for a multi-label model, None for a
    single-label one (which decides by the largest probability). ValueError naming the
    flag for a threshold outside (0, 1) or one given to a single-label model."""
    if not is_multilabel(model):
        if threshold is not None:
            raise ValueError(f"--threshold {threshold:g}: {path} predicts one label per image (the most probable "
                             "class); a threshold applies to multi-label models")
        return None
    if threshold is None:
        return DEFAULT_THRESHOLD
    if not 0 < threshold < 1:
        raise ValueError(f"--threshold must be between 0 and 1 (exclusive), got {threshold:g}")
    return float(threshold)


def resolve_model_path(path: str | os.PathLike[str]) -> Path:
    """``path`` itself; for a run directory its ``best.pt`` (else ``last.pt``), so
    ``--model runs/mnist`` works; for ``hf-hub:ORG/NAME`` its directory in the Hugging Face
    cache (fetched when it can be); a directory in the Hub's form (``ats export
    --hub-ready``) as it is (:func:`ats_cli.hub.locate`). Raises :class:`CheckpointError`
    naming the path."""
    from ats_cli.hub import locate

    return locate(path)


@dataclass
class Predictor:
    """A loaded model and what prediction needs to know about it."""

    model: ATSModel
    classes: list[str]
    channels: int
    device: torch.device
    path: Path
    input_options: Mapping[str, object] = field(default_factory=dict)  # how training read its inputs
    threshold: float | None = None  # multi-label models: a class is predicted from this probability on

    def decide(self, probs: Sequence[float]) -> str:
        """The prediction for one input's probabilities: the most probable class, or for a
        multi-label model the classes at or above :attr:`threshold`."""
        if self.threshold is not None:
            return decide(probs, self.classes, self.threshold)
        return self.classes[max(range(len(probs)), key=probs.__getitem__)]

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
        if level is not None or mpp is not None:  # --mpp always resamples (ats_cli.data.inputs)
            opts["level"], opts["mpp"] = level, mpp
            opts["resample"] = True
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
        on_row: Callable[[int, PredictionRow], None] | None = None,
        prefetch: bool = True,
    ) -> list[PredictionRow]:
        """One row per item, in the items' order; failures are rows with ``error`` set.

        Images are stacked into batches of up to ``batch_size``: of any sizes for a model
        that takes views of different sizes, padded (one level: each image then gets what it
        gets alone, :meth:`ats_cli.core.model.ATSModel.forward`), else of equal size. The sampling
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
        ``on_row(index, row)`` is called for every row, failed ones included, as it is
        finished (``ats predict --out`` appends it to its part file, for resuming).

        ``prefetch`` (default on): while an image is predicted, the next one is opened (its
        low-res view and tissue mask read) in a background thread, one image ahead at most;
        the results are the same either way.
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
            if on_row:
                on_row(index, row)
            if progress:
                progress(done, len(items))

        def run(batch: list[tuple[int, OpenedImage]]) -> None:
            try:
                probs, output = self._probs([img for _, img in batch], n_patches, samples, seed,
                                            paths=[items[index].path for index, _ in batch])
            except Exception as e:  # a patch that cannot be read, a model error: this input fails, not the run
                if len(batch) > 1:  # find out which image it was: retry one by one
                    for one in batch:
                        run([one])
                    return
                index, _ = batch[0]
                finish(index, _failed(items[index], f"{items[index].path}: prediction failed ({first_line(e)})"))
                return
            for b, ((index, opened), p) in enumerate(zip(batch, probs.tolist(), strict=True)):
                if not all(math.isfinite(v) for v in p):
                    finish(index, _failed(items[index], f"{items[index].path}: the model's output is not finite "
                                                        f"(probabilities {', '.join(f'{v:g}' for v in p)}); no "
                                                        "prediction"))
                    continue
                row = PredictionRow(path=items[index].path, label=items[index].label,
                                    prediction=self.decide(p), probs=tuple(p))
                if on_output is not None:
                    on_output(index, row, opened, output, b)
                finish(index, row)

        def open_one(item: InputItem) -> OpenedImage:
            return read(item.path, channels=self.channels, scale=self.model.scale, patch_size=self.model.patch_size)

        mixed = getattr(self.model, "takes_mixed_views", False)
        opened_images = _read_ahead(items, open_one, prefetch)
        try:
            for index, item in enumerate(items):
                if item.error is not None:
                    finish(index, _failed(item, item.error))
                    continue
                try:
                    opened = opened_images.get(index)
                except Exception as e:  # whatever a reader raises: this file fails, the others go on
                    text = first_line(e, limit=None)
                    if not isinstance(e, (ImageReadError, OSError, ValueError)):
                        text = f"{type(e).__name__}: {text}"
                    finish(index, _failed(item, text if str(item.path) in text else f"{item.path}: {text}"))
                    continue
                key = () if mixed else (tuple(opened.low.shape), tuple(opened.source.size))
                group = pending.setdefault(key, [])
                group.append((index, opened))
                if len(group) >= batch_size:
                    run(pending.pop(key))
            for key in list(pending):
                run(pending.pop(key))
        except KeyboardInterrupt:
            raise PredictionInterrupted([row for row in rows if row is not None], len(items)) from None
        finally:
            opened_images.close()
            self.flush_features()
        return [row for row in rows if row is not None]

    def feature_keys(self, paths: Sequence[str | os.PathLike[str]] | None, sources: object
                     ) -> list[str | None] | None:
        """The content keys of the files at ``paths``, read as ``sources`` (a batch's), for the
        model's feature store (:func:`ats_cli.baselines_tilemil.attach_feature_store`), as
        training keys them (:func:`ats_cli.data.features.image_keys`); None without a store."""
        store = getattr(self.model, "feature_store", None)
        if store is None or paths is None:
            return None
        lazy = not isinstance(sources, torch.Tensor)
        return [store.keys_of.key(p, sources[k] if lazy else None) for k, p in enumerate(paths)]

    def flush_features(self) -> None:
        """Write what the model's feature store holds unwritten (a segment of the tiles encoded)."""
        store = getattr(self.model, "feature_store", None)
        if store is not None:
            store.flush()

    def _probs(self, images: list[OpenedImage], n_patches: int | None, samples: int, seed: int,
               paths: Sequence[str | os.PathLike[str]] | None = None) -> tuple[torch.Tensor, ATSOutput]:
        low, view_sizes = batch_views([img.low for img in images])  # different sizes: padded, sizes kept
        low = low.to(self.device)
        sources = batch_sources([img.source for img in images])
        masks = batch_support([img.support for img in images], low.shape[-2:])
        generator = torch.Generator(device=self.device).manual_seed(seed)
        probs, output = predict_probs(self.model, low, sources, n_patches=n_patches, samples=samples,
                                      generator=generator, support_mask=masks, view_sizes=view_sizes,
                                      feature_keys=self.feature_keys(paths, sources))
        return probs.cpu(), output


class PredictionInterrupted(KeyboardInterrupt):
    """Ctrl-C during :meth:`Predictor.predict`: ``rows`` are the inputs finished before it
    (in input order), ``total`` how many there were. A KeyboardInterrupt, so a caller that
    does not handle it stops as on any Ctrl-C."""

    def __init__(self, rows: list[PredictionRow], total: int):
        super().__init__(f"interrupted after {len(rows)} of {total} input(s)")
        self.rows, self.total = rows, total


class _read_ahead:  # noqa: N801 (used like a function)
    """``get(i)`` opens ``items[i]`` (raising what the reader raised); with ``prefetch``,
    ``items[i+1]``'s opening is started in a background thread as ``get(i)`` returns, so it
    overlaps the prediction of image i. One image ahead at most: a slide's low-res view is
    small, but a cohort's would not be. Items with an ``error`` are never opened."""

    def __init__(self, items: Sequence[InputItem], open_one: Callable[[InputItem], OpenedImage], prefetch: bool):
        self.items, self.open_one = items, open_one
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ats-prefetch") if prefetch else None
        self.ahead: tuple[int, Future] | None = None

    def get(self, index: int) -> OpenedImage:
        future = None
        if self.ahead is not None and self.ahead[0] == index:
            future = self.ahead[1]
        self.ahead = None
        if self.pool is not None:
            nxt = next((j for j in range(index + 1, len(self.items)) if self.items[j].error is None), None)
            if future is None:  # the first image, or the caller skipped one: start it now
                future = self.pool.submit(self.open_one, self.items[index])
            if nxt is not None:
                self.ahead = (nxt, self.pool.submit(self.open_one, self.items[nxt]))
        return future.result() if future is not None else self.open_one(self.items[index])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def _failed(item: InputItem, message: str) -> PredictionRow:
    return PredictionRow(path=item.path, label=item.label, error=message)
