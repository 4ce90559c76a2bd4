"""`ats visualize`: draw attention figures (a thin shell over :mod:`ats_cli.visualize`)."""

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
    tissue_setting,
)


@app.command()
def visualize(
    target: Annotated[str, typer.Argument(
        metavar="IMAGE|RUN_DIR", show_default=False,
        help="An image or a URL of one (with --model): its attention and sampled patches. A run directory (with "
             "--image): the attention at successive epochs.")],
    out: Annotated[Path, typer.Option("--out", "-o", show_default=False,
                                      help="Figure file (.png; .pdf and .svg work), or .geojson (IMAGE mode): the "
                                           "attention and sampled patches as QuPath objects in level-0 pixels.")],
    model: Annotated[str | None, typer.Option(
        "--model", "-m", show_default=False,
        help="IMAGE mode: model checkpoint (.pt), run directory (its best.pt), model directory from ats export "
             "--hub-ready, or hf-hub:ORG/NAME.")] = None,
    image: Annotated[Path | None, typer.Option(
        "--image", show_default=False, help="RUN_DIR mode: the image whose attention to follow.")] = None,
    preview: Annotated[Path | None, typer.Option(
        "--preview", show_default=False,
        help="With --out X.geojson: also a PNG of the file drawn over the image (the attention as a heat, the "
             "patches boxed and numbered), readable at any slide size.")] = None,
    epochs: Annotated[str, typer.Option(
        "--epochs", help="RUN_DIR mode: 'all' or a list like 1,5,10 (at most 8 panels, evenly spaced).")] = "all",
    n_patches: NPatchesOption = None,
    seed: int = SEED_OPTION,
    data: Annotated[Path | None, typer.Option(
        "--data", show_default=False,
        help="Dataset directory or CSV listing the image, for its label and digit boxes \\[default: look for "
             "train/val/test.csv next to and above the image].")] = None,
    device: str = DEVICE_OPTION,
    reader: ReaderOption = None,
    level: LevelOption = None,
    mpp: MppOption = None,
    tissue_mask: TissueOption = None,
    max_pixels: MaxPixelsOption = None,
) -> None:
    """Draw what the model attends to.

    [bold]ats visualize IMAGE --model MODEL --out fig.png[/]: the low-res view with the
    attention (log colour scale), boxes on the sampled patches, the patches underneath and
    the prediction in the title.

    [bold]ats visualize RUN_DIR --image IMAGE --out evolution.png[/]: the attention after
    successive epochs (RUN_DIR/epochs/epoch_NNN.pt) side by side, on one shared colour scale.

    [bold]ats visualize SLIDE --model MODEL --out slide.geojson[/]: the same sampling as
    GeoJSON that QuPath imports (File > Import objects from file): the patches and the
    attention cells as detections in level-0 pixels, with their attention, draw order and
    estimator weight as measurements (docs/slides.md). [bold]--preview slide.png[/] draws
    that file over the image, the model's attention as a heat layer.

    Exit status 2 for a bad model, run directory or option, or an --out that cannot be
    written (checked before any work); 1 for an unusable image; 130 for Ctrl-C (nothing
    is written).
    """
    from ats_cli.checkpoint import CheckpointError
    from ats_cli.data.dataset import is_store
    from ats_cli.data.images import ImageReadError, max_pixels_limit
    from ats_cli.io import check_writable
    from ats_cli.visualize import render_attention, render_evolution, write_attention_geojson

    console = OutputConsole(highlight=False, soft_wrap=True)
    err = OutputConsole(stderr=True, highlight=False, soft_wrap=True)

    def usage(message: str) -> typer.Exit:
        err.print(f"[red]error:[/] {escape(message)}", soft_wrap=True)
        return typer.Exit(2)

    if level is not None and mpp is not None:
        raise usage("give --level or --mpp, not both")
    try:
        max_pixels_limit(max_pixels)
    except ValueError as e:
        raise usage(str(e)) from None
    reading = {"reader": reader, "level": level, "mpp": mpp, "tissue": tissue_setting(tissue_mask),
               "max_pixels": max_pixels}
    from ats_cli.data.remote import input_path, is_url

    target = input_path(target)  # a URL stays a URL (ats_cli.data.remote): one that cannot be read says so
    for given in (target, image):
        if given is not None and not is_url(given) and not given.exists():
            raise usage(f"{given}: does not exist")
    # a run directory; an OME-Zarr store is an image
    evolution = not is_url(target) and target.is_dir() and not is_store(target)
    if evolution and image is None:
        raise usage(f"{target} is a directory: give --image IMAGE to draw its attention across epochs "
                    "(or give an image and --model for one figure)")
    if evolution and model is not None:
        raise usage("--model is for IMAGE mode; with a RUN_DIR the epochs' checkpoints are used")
    if not evolution and model is None:
        raise usage(f"give --model MODEL to draw {target}'s attention (or a run directory and --image)")
    geojson = out.suffix.lower() == ".geojson"
    if evolution and geojson:
        raise usage("--out .geojson is for IMAGE mode (one image and --model); the epochs figure is a picture")
    if preview is not None and not geojson:
        raise usage("--preview draws a GeoJSON file: give it with --out X.geojson")
    for path in (out, preview):
        try:
            if path is not None:
                check_writable(path)
        except OSError as e:
            raise usage(f"cannot write {path}: {e.strerror or e} (nothing was drawn)") from None
    try:
        if geojson:
            summary = write_attention_geojson(model, target, out, n_patches=n_patches, seed=seed, data=data,
                                              device=device, reading=reading, preview=preview)
        elif evolution:
            summary = render_evolution(target, image, out, epochs=epochs, data=data, device=device,
                                       reading=reading)
        else:
            summary = render_attention(model, target, out, n_patches=n_patches, seed=seed, data=data, device=device,
                                       reading=reading)
    except ImageReadError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(1) from None
    except (CheckpointError, ValueError, RuntimeError) as e:
        raise usage(str(e)) from None
    except OSError as e:  # reading or writing: name the file the system names
        err.print(f"[red]error:[/] {escape(str(e.filename or out))}: {escape(e.strerror or str(e))}", soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print(f"[yellow]interrupted[/]: nothing written to {escape(str(out))}", soft_wrap=True)
        raise typer.Exit(130) from None

    if getattr(summary, "reading", None):
        err.print(f"{escape(str(target))}: {escape(summary.reading)}", soft_wrap=True, highlight=False)
    if geojson:
        label = "" if summary.label is None else f", label {summary.label}"
        console.print(f"wrote {summary.out}: predicted {summary.prediction} (p = {summary.probability:.2f}){label}; "
                      f"{summary.n_patches} patches and {summary.n_cells} attention cells in level-0 pixels (patches "
                      f"read at level {summary.level}, downsample {summary.downsample:g})")
        if summary.preview is not None:
            console.print(f"wrote {summary.preview} ({summary.preview_px[0]}x{summary.preview_px[1]} px): the file "
                          "drawn over the image")
        return
    what = (f"epochs {', '.join(map(str, summary.epochs))}" if evolution
            else f"predicted {summary.prediction} (p = {summary.probability:.2f})")
    if summary.label is not None:
        what += f", label {summary.label}"
    if summary.n_boxes:
        what += f", {summary.n_boxes} boxes marked"
    console.print(f"wrote {summary.out} ({summary.size_px[0]}x{summary.size_px[1]} px): {what}")
