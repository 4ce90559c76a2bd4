"""`ats predict`: parse flags, check them, call :mod:`ats_cli.predict`, write the CSV and
print the results (:mod:`ats_cli.predict.report`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

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
    from ats_cli.data.magnification import announce_readings
    from ats_cli.io import check_writable
    from ats_cli.predict import AttentionSaver, PredictionInterrupted, load_predictor, resolve_inputs
    from ats_cli.predict.report import estimator_note, print_results, run_with_progress

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
                  f"{estimator_note(predictor.model)}samples {samples}, seed {seed}")
    if level is not None and mpp is not None:
        err.print("[red]error:[/] give --level or --mpp, not both")
        raise typer.Exit(2)
    opener = predictor.opener(reader=reader, level=level, mpp=mpp, tissue=tissue_setting(tissue_mask),
                              max_pixels=max_pixels)
    opener = announce_readings(opener, lambda line: err.print(escape(line), soft_wrap=True, highlight=False))
    saver = None if save_attention is None else AttentionSaver(save_attention, items, predictor, seed, samples)
    try:
        rows = run_with_progress(predictor, items, err, n_patches=n_patches, samples=samples,
                                  batch_size=batch_size, seed=seed, reader=opener, on_output=saver)
    except PredictionInterrupted as stop:
        _save_interrupted(stop, out, to_stdout, predictor.classes, err)
        raise typer.Exit(130) from None
    try:
        _write_csv(rows, predictor.classes, out, to_stdout)
    except OSError as e:
        err.print(f"[red]error:[/] cannot write {out}: {e}", soft_wrap=True)
        raise typer.Exit(1) from None
    print_results(console, err, rows, predictor.classes, out=out, to_stdout=to_stdout, saver=saver)
    if any(not r.ok for r in rows) or (saver is not None and saver.errors):
        raise typer.Exit(1)


def _write_csv(rows, classes: list[str], out: str | None, to_stdout: bool) -> None:
    """The predictions CSV to stdout (``--out -``), to ``out``, or nowhere (no ``--out``)."""
    from ats_cli.predict import predictions_csv_text, write_predictions_csv

    if to_stdout:
        sys.stdout.write(predictions_csv_text(rows, classes))
        sys.stdout.flush()
    elif out is not None:
        write_predictions_csv(out, rows, classes)


def _save_interrupted(stop, out: str | None, to_stdout: bool, classes: list[str], err: Console) -> None:
    """Ctrl-C: write the rows finished so far where the full CSV would have gone, and say so."""
    good = sum(r.ok for r in stop.rows)
    try:
        _write_csv(stop.rows, classes, out, to_stdout)
        where = "written to stdout" if to_stdout else "not saved (no --out)" if out is None else f"written to {out}"
    except OSError as e:
        where = f"not saved: cannot write {out}: {e.strerror or e}"
    err.print(f"[yellow]interrupted[/] after {len(stop.rows)} of {stop.total} input(s): the {good} predicted are "
              f"{escape(where)}", soft_wrap=True)
