"""`ats predict`: parse flags, call :mod:`ats_cli.predict`, print a table and write the CSV."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ats_cli.cli import OutputConsole, app
from ats_cli.cli.options import (
    DEVICE_OPTION,
    SEED_OPTION,
    LevelOption,
    MaxPixelsOption,
    MppOption,
    NPatchesOption,
    ReaderOption,
    TissueOption,
    tissue_setting,
)

MAX_ROWS_SHOWN = 20  # rows of the terminal table; the CSV has them all
MAX_CONFUSION_CLASSES = 20  # wider confusion matrices do not fit a terminal


def _estimator_note(model: object) -> str:
    """'estimator threshold, ' for a model that samples without replacement, else ''."""
    if getattr(model, "estimator", None) is None or getattr(model, "replace", True):
        return ""
    name, active = model.estimator, model.active_estimator
    return f"estimator {name if name == active else f'{name} ({active})'}, "


@app.command()
def predict(
    inputs: Annotated[list[str], typer.Argument(
        metavar="PATH", show_default=False,
        help="Image files, directories, glob patterns (quoted or not), dataset CSVs (path[,label] columns) or "
             "dataset directories (their test.csv).")],
    model: Annotated[str, typer.Option("--model", "-m", show_default=False,
                                       help="Model checkpoint (.pt), or a run directory (its best.pt).")],
    out: Annotated[str | None, typer.Option(
        "--out", "-o", show_default=False,
        help="Write the predictions CSV here ('-' = stdout); without it only the table is shown.")] = None,
    n_patches: NPatchesOption = None,
    estimator: Annotated[str | None, typer.Option(
        "--estimator", show_default=False,
        help="auto | threshold | sequential: the unbiased estimator (same expectation, different noise; "
             "in prediction auto = threshold; ats_cli/core/sampling.py) \\[default: the model's; auto for "
             "models saved before the choice existed].")] = None,
    samples: Annotated[int, typer.Option(
        "--samples", min=1, help="Average this many independent samplings per image.")] = 1,
    batch_size: Annotated[int, typer.Option(
        "--batch-size", min=1,
        help="Images of equal size per forward pass. 1 keeps each file's result independent of the other "
             "inputs.")] = 1,
    device: str = DEVICE_OPTION,
    seed: int = SEED_OPTION,
    recursive: Annotated[bool, typer.Option("--recursive", "-r",
                                            help="Also take images from sub-directories.")] = False,
    reader: ReaderOption = None,
    level: LevelOption = None,
    mpp: MppOption = None,
    tissue_mask: TissueOption = None,
    max_pixels: MaxPixelsOption = None,
    save_attention: Annotated[Path | None, typer.Option(
        "--save-attention", metavar="DIR", show_default=False,
        help="Also write each input's attention and sampled patches as GeoJSON for QuPath (level-0 pixels) to "
             "DIR/<name>.geojson, as it is predicted; a name seen before gets -2, -3, ... (docs/slides.md).")] = None,
) -> None:
    """Predict the class of images with a trained model.

    Unreadable, too-small or too-large images (and any whose prediction is not a finite
    number) are reported on stderr (by file name) and left out of the CSV; the others are
    still predicted, and the exit status is then 1. A model file that cannot be used, or
    an --out that cannot be written, exits with status 2 before any image is read. Ctrl-C
    writes the rows finished so far to --out, says so and exits with status 130.
    """
    from ats_cli.checkpoint import CheckpointError
    from ats_cli.data.images import max_pixels_limit
    from ats_cli.io import check_writable
    from ats_cli.predict import (
        PredictionInterrupted,
        evaluate,
        load_predictor,
        predictions_csv_text,
        resolve_inputs,
        write_predictions_csv,
    )

    to_stdout = out == "-"
    # with --out -, stdout carries the CSV only; everything else goes to stderr
    console = OutputConsole(stderr=to_stdout, highlight=False, soft_wrap=True)
    err = OutputConsole(stderr=True, highlight=False, soft_wrap=True)
    try:
        max_pixels_limit(max_pixels)  # a bad ATS_MAX_PIXELS is a usage error, not one per image
        predictor = load_predictor(model, device, estimator=estimator)
    except (CheckpointError, ValueError, RuntimeError) as e:
        err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    if out is not None and not to_stdout:
        try:
            check_writable(out)
        except OSError as e:
            err.print(f"[red]error:[/] cannot write {escape(out)}: {escape(e.strerror or str(e))} (nothing was "
                      "predicted)", soft_wrap=True)
            raise typer.Exit(2) from None
    if save_attention is not None:
        from ats_cli.geojson import check_model

        try:
            check_model(predictor.model)
            check_writable(save_attention / "probe.geojson")
        except ValueError as e:
            err.print(f"[red]error:[/] --save-attention: {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(2) from None
        except OSError as e:
            err.print(f"[red]error:[/] cannot write to {escape(str(save_attention))}: {escape(e.strerror or str(e))} "
                      "(nothing was predicted)", soft_wrap=True)
            raise typer.Exit(2) from None

    items = resolve_inputs(inputs, recursive=recursive)
    n_ok_inputs = sum(item.error is None for item in items)
    console.print(f"model {predictor.path} ({len(predictor.classes)} classes, {predictor.device}); "
                  f"{n_ok_inputs} image(s); n_patches {n_patches or predictor.model.n_patches}, "
                  f"{_estimator_note(predictor.model)}samples {samples}, seed {seed}")
    if level is not None and mpp is not None:
        err.print("[red]error:[/] give --level or --mpp, not both")
        raise typer.Exit(2)
    opener = predictor.opener(reader=reader, level=level, mpp=mpp, tissue=tissue_setting(tissue_mask),
                              max_pixels=max_pixels)
    saver = None if save_attention is None else _AttentionSaver(save_attention, items, predictor, seed, samples)
    try:
        rows = _run_with_progress(predictor, items, err, n_patches=n_patches, samples=samples,
                                  batch_size=batch_size, seed=seed, reader=opener, on_output=saver)
    except PredictionInterrupted as stop:
        _save_interrupted(stop, out, to_stdout, predictor.classes, err)
        raise typer.Exit(130) from None
    good = [r for r in rows if r.ok]
    failed = [r for r in rows if not r.ok]

    if to_stdout:
        sys.stdout.write(predictions_csv_text(rows, predictor.classes))
        sys.stdout.flush()
    elif out is not None:
        try:
            write_predictions_csv(out, rows, predictor.classes)
        except OSError as e:
            err.print(f"[red]error:[/] cannot write {out}: {e}", soft_wrap=True)
            raise typer.Exit(1) from None

    if good:
        console.print(_table(good, len(good)))
    evaluation = evaluate(rows, predictor.classes)
    if evaluation is not None:
        console.print(f"[bold]accuracy {evaluation.accuracy:.2%}[/] ({evaluation.correct}/{evaluation.n} labelled "
                      "images)")
        if evaluation.unknown_labels:
            console.print(f"[yellow]note:[/] label(s) {', '.join(evaluation.unknown_labels)} are not classes of the "
                          "model; those images count as wrong")
        if len(evaluation.labels) <= MAX_CONFUSION_CLASSES:
            console.print(_confusion(evaluation))
        else:
            console.print(f"(confusion matrix not shown: {len(evaluation.labels)} classes)")
    summary = f"{len(good)} predicted, {len(failed)} failed"
    if out is not None and not to_stdout:
        summary += f"; predictions written to {out}"
    elif out is None and good:
        summary += "; not saved (give --out FILE.csv to save every row)"
    if saver is not None:
        summary += f"; {saver.written} attention file(s) in {save_attention}"
    console.print(summary)
    if failed:
        err.print(f"[red]{len(failed)} input(s) failed[/] (not in the CSV):")
        for r in failed:
            err.print(f"  {r.error}", soft_wrap=True, markup=False)
    if saver is not None and saver.errors:
        err.print(f"[red]{len(saver.errors)} attention file(s) not written[/] (predicted all the same):")
        for message in saver.errors:
            err.print(f"  {message}", soft_wrap=True, markup=False)
    if failed or (saver is not None and saver.errors):
        raise typer.Exit(1)


class _AttentionSaver:
    """``--save-attention DIR``: writes DIR/<name>.geojson for each input as it is
    predicted (:mod:`ats_cli.geojson`); names are fixed from the whole input list up
    front, so they do not depend on which inputs fail. Errors are collected, not raised."""

    def __init__(self, folder: Path, items, predictor, seed: int, samples: int):
        from ats_cli.geojson import unique_names

        self.folder, self.items, self.predictor = folder, items, predictor
        self.seed, self.samples = seed, samples
        self.names = unique_names([item.path for item in items])
        self.written = 0
        self.errors: list[str] = []
        self._weights: tuple[object, object] | None = None  # (output, its replayed weights): one per batch

    def __call__(self, index, row, opened, output, b) -> None:
        from ats_cli.geojson import (
            AttentionRecord,
            attention_feature_collection,
            parse_boxes,
            replay_weights,
            write_geojson,
        )

        item = self.items[index]
        target = self.folder / self.names[index]
        try:
            model = self.predictor.model
            if self._weights is None or self._weights[0] is not output:
                self._weights = (output, replay_weights(model, output, seed=self.seed, samplings=self.samples))
            record = AttentionRecord.from_output(model, opened, output, b, self._weights[1])
            boxes = parse_boxes(item.extra.get("boxes") or item.extra.get("digits"))
            collection = attention_feature_collection(
                record, self.predictor.classes, row.probs, image=item.path, model=self.predictor.path, seed=self.seed,
                samples=self.samples, label=item.label, boxes=boxes)
            write_geojson(target, collection)
            self.written += 1
        except Exception as e:  # a full disk, a bad value: this file is missing, the predictions go on
            self.errors.append(f"{target}: {e.strerror if isinstance(e, OSError) and e.strerror else e} "
                               f"(for {item.path})")


def _save_interrupted(stop, out: str | None, to_stdout: bool, classes: list[str], err: Console) -> None:
    """Ctrl-C: write the rows finished so far where the full CSV would have gone, and say so."""
    from ats_cli.predict import predictions_csv_text, write_predictions_csv

    good = sum(r.ok for r in stop.rows)
    where = "not saved (no --out)"
    try:
        if to_stdout:
            sys.stdout.write(predictions_csv_text(stop.rows, classes))
            sys.stdout.flush()
            where = "written to stdout"
        elif out is not None:
            write_predictions_csv(out, stop.rows, classes)
            where = f"written to {out}"
    except OSError as e:
        where = f"not saved: cannot write {out}: {e.strerror or e}"
    err.print(f"[yellow]interrupted[/] after {len(stop.rows)} of {stop.total} input(s): the {good} predicted are "
              f"{escape(where)}", soft_wrap=True)


def _run_with_progress(predictor, items, console: Console, **options):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("predicting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=len(items) < 2) as bar:
        task = bar.add_task("predict", total=len(items))
        return predictor.predict(items, progress=lambda done, total: bar.update(task, completed=done), **options)


def _short(path: Path, width: int = 60) -> str:
    text = str(path)
    return text if len(text) <= width else "..." + text[-(width - 3):]


def _table(rows, total: int) -> Table:
    with_labels = any(r.label is not None for r in rows)
    shown = rows[:MAX_ROWS_SHOWN]
    title = "Predictions" + (f" (first {len(shown)} of {total}; all in the CSV)" if total > len(shown) else "")
    table = Table(title=title, title_justify="left")
    table.add_column("path", overflow="fold")
    table.add_column("prediction", justify="right")
    table.add_column("probability", justify="right")
    if with_labels:
        table.add_column("label", justify="right")
    for r in shown:
        cells = [_short(r.path), r.prediction, f"{max(r.probs):.3f}"]
        if with_labels:
            mark = "" if r.label is None else ("[green]" if r.label == r.prediction else "[red]")
            cells.append(f"{mark}{r.label or '-'}")
        table.add_row(*cells)
    return table


def _confusion(ev) -> Table:
    table = Table(title="Confusion matrix (rows: label, columns: prediction)", title_justify="left")
    table.add_column("label \\ pred", justify="right", style="bold")
    for c in ev.classes:
        table.add_column(c, justify="right")
    table.add_column("recall", justify="right")
    for i, label in enumerate(ev.labels):
        counts = ev.matrix[i]
        n = sum(counts)
        cells = []
        for j, c in enumerate(ev.classes):
            v = counts[j]
            style = ("green" if c == label else "red") if v else "dim"
            cells.append(f"[{style}]{v}[/]")
        recall = counts[ev.classes.index(label)] / n if n and label in ev.classes else 0.0
        table.add_row(label, *cells, f"{recall:.0%}" if n else "-")
    return table
