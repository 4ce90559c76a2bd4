"""`ats predict`: parse flags, check that they go together, and hand the request to
:mod:`ats_cli.predict.run` (one process), or :mod:`ats_cli.predict.launch` (--devices N)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
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
)


@app.command()
def predict(
    inputs: Annotated[list[str], typer.Argument(
        metavar="PATH", show_default=False,
        help="Image files, directories, glob patterns (quoted or not), dataset CSVs (path[,label] columns) or "
             "dataset directories (their test.csv).")],
    model: Annotated[str, typer.Option("--model", "-m", show_default=False,
                                       help="Model checkpoint (.pt), a run directory (its best.pt), a model directory "
                                            "from ats export --hub-ready, or hf-hub:ORG/NAME (from the Hugging "
                                            "Face Hub, through its cache).")],
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
    devices: Annotated[int | None, typer.Option(
        "--devices", min=1, show_default=False,
        help="Predict in N processes on this machine: one per GPU, or N CPU processes (starts torchrun for you, as "
             "ats train --devices; needs --out FILE) \\[default: 1].")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Predict every input again: --out, its part files and its record are removed first. "
                            "Without it an existing --out made by this model file with these settings and inputs is "
                            "resumed (its inputs are skipped) and any other is refused.")]
    = False,
    prefetch: Annotated[bool, typer.Option(
        "--prefetch/--no-prefetch",
        help="Open the next input (its low-res view) in a background thread while the current one is predicted.")]
    = True,
    threshold: Annotated[float | None, typer.Option(
        "--threshold", show_default=False,
        help="Multi-label models: predict each class whose probability reaches this (recorded in FILE.ats.json) "
             "\\[default: 0.5].")] = None,
) -> None:
    """Predict the class of images with a trained model.

    Unreadable, too-small or too-large images (and any whose prediction is not a finite
    number) are reported on stderr (by file name) and left out of the CSV; the others are
    still predicted, and the exit status is then 1. A model file that cannot be used, or
    an --out that cannot be written, exits with status 2 before any image is read. Ctrl-C
    writes the rows finished so far to --out, says so and exits with status 130.

    With --out FILE every finished input is also appended to FILE.part-R as it goes, so
    rerunning the same command resumes where a run stopped (or crashed); FILE.ats.json
    records the model (sha256), settings and inputs that made FILE, and a run of anything
    else is refused; one run at a time writes FILE (FILE.ats.lock). --devices N (or
    torchrun) shares the inputs among processes and merges one CSV (docs/predict-visualize.md).
    """
    from ats_cli import runtime
    from ats_cli.predict.launch import launch
    from ats_cli.predict.run import predict_cohort, predict_here
    from ats_cli.predict.session import Request

    to_stdout = out == "-"
    # with --out -, stdout carries the CSV only; everything else goes to stderr
    console = OutputConsole(stderr=to_stdout, highlight=False, soft_wrap=True)
    err = OutputConsole(stderr=True, highlight=False, soft_wrap=True)
    if level is not None and mpp is not None:
        err.print("[red]error:[/] give --level or --mpp, not both")
        raise typer.Exit(2)
    try:
        ctx = runtime.from_env()
    except ValueError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    several = ctx.enabled or (devices is not None and devices > 1)
    if several and (out is None or to_stdout):
        err.print("[red]error:[/] several processes need --out FILE.csv (each writes its part next to it, the first "
                  "merges them)")
        raise typer.Exit(2)
    if devices is not None and devices > 1 and ctx.enabled:
        err.print("[red]error:[/] --devices starts the processes itself; under torchrun leave it out")
        raise typer.Exit(2)
    req = Request(inputs=inputs, model=model, out=out, n_patches=n_patches, estimator=estimator, samples=samples,
                  batch_size=batch_size, device=device, seed=seed, recursive=recursive, reader=reader, level=level,
                  mpp=mpp, tissue_mask=tissue_mask, max_pixels=max_pixels, save_attention=save_attention,
                  overwrite=overwrite, prefetch=prefetch, threshold=threshold)
    if devices is not None and devices > 1:
        raise typer.Exit(launch(devices, req, err))
    if out is not None and not to_stdout:
        raise typer.Exit(predict_cohort(req, console, err))
    raise typer.Exit(predict_here(req, console, err))
