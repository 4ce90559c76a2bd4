"""`ats info PATH`: which reader opens a file and what it sees (dimensions, levels, mpp, vendor)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ats_cli.cli import app


@app.command()
def info(
    paths: list[Path] = typer.Argument(..., help="Image or slide files."),
    reader: str = typer.Option("auto", help="Force a reader: auto, openslide, tifffile, pillow."),
) -> None:
    """Show the reader, dimensions, pyramid levels, microns per pixel and vendor of each file.

    Keeps going past unreadable files (each is reported with the problem) and exits 1 if any failed.
    """
    from ats_cli.data.images import ImageReadError
    from ats_cli.data.slides import open_image

    console, err = Console(), Console(stderr=True)
    failed = 0
    for path in paths:
        try:
            with open_image(path, reader=reader) as slide:
                i = slide.info()
        except (ImageReadError, ValueError) as e:
            err.print(f"[red]error[/]: {e}")
            failed += 1
            continue
        mpp = f"{i.mpp[1]:.4g} x {i.mpp[0]:.4g} µm (x, y)" if i.mpp else "not recorded"
        table = Table(title=str(path), show_header=True)
        for col in ("level", "height", "width", "downsample"):
            table.add_column(col, justify="right")
        for k, ((h, w), d) in enumerate(zip(i.levels, i.downsamples, strict=True)):
            table.add_row(str(k), f"{h:,}", f"{w:,}", f"{d:g}")
        console.print(f"reader: {i.reader}   vendor: {i.vendor}   channels: {i.channels}   mpp: {mpp}")
        console.print(table)
    if failed:
        raise typer.Exit(1)
