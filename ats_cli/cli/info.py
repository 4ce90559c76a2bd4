"""`ats info PATH`: which reader opens a file and what it sees (dimensions, levels, mpp,
vendor), and the --scale, --patch-size and --n-patches `ats train` would settle for images
of its size (a folder: of its images' typical size, ats_cli.config.sizes_for)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ats_cli.cli import OutputConsole, app
from ats_cli.cli.options import MaxPixelsOption, config_option


@app.command()
def info(
    paths: list[str] = typer.Argument(..., help="Image or slide files, OME-Zarr stores, or folders of them (class "
                                      "folders too), or URLs (https://, s3://, ...: the [remote] extra)."),
    reader: str = config_option("reader", "auto", check=True),
    max_pixels: MaxPixelsOption = None,
) -> None:
    """Show the reader, dimensions, pyramid levels, microns per pixel and vendor of each file,
    and the --scale, --patch-size and --n-patches ats train would settle for it. A folder: a
    line for its images (sizes, the typical long side) and the settings for all of them.

    Keeps going past unreadable files (each is reported on one line, by name, with the
    problem) and exits 1 at the end, with the count, if any failed; Ctrl-C stops with 130.
    """
    from ats_cli.data.images import max_pixels_limit

    console = OutputConsole(highlight=False)
    err = OutputConsole(stderr=True, highlight=False, soft_wrap=True)
    try:
        max_pixels_limit(max_pixels)  # a bad ATS_MAX_PIXELS is a usage error, not one per file
    except ValueError as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    from ats_cli.data.dataset import is_store
    from ats_cli.data.remote import input_path

    failed = done = 0
    try:
        for path in map(input_path, paths):  # a URL stays a URL (ats_cli.data.remote)
            folder = isinstance(path, Path) and path.is_dir() and not is_store(path)
            failed += not (_show_folder(path, console, err) if folder else
                           _show(path, reader, max_pixels, console, err))
            done += 1
    except KeyboardInterrupt:
        err.print(f"[yellow]interrupted[/] after {done} of {len(paths)} file(s)")
        raise typer.Exit(130) from None
    if failed:
        err.print(f"[red]{failed} of {len(paths)} file(s) failed[/]")
        raise typer.Exit(1)


def _show(path: Path | str, reader: str, max_pixels: int | None, console: Console, err: Console) -> bool:
    """Print one file's table; False (after one error line naming it) if it cannot be read."""
    if isinstance(path, Path) and not path.exists():  # before the readers, whose word for it is "file not found"
        err.print(f"[red]error:[/] {escape(str(path))}: does not exist")
        return False
    try:
        i = _image_info(path, max_pixels) if _pillow(path, reader) else _slide_info(path, reader, max_pixels)
    except Exception as e:  # any reader, any failure: report it by name and go on to the next file
        text = str(e).strip()
        text = text.splitlines()[0] if text else type(e).__name__
        if str(path) not in text:
            text = f"{path}: {type(e).__name__}: {text}"
        err.print(f"[red]error:[/] {escape(text)}")
        return False
    mpp = f"{i.mpp[1]:.4g} x {i.mpp[0]:.4g} µm (x, y)" if i.mpp else "not recorded"
    if i.scale_unknown:  # a tool's 72 dpi is no scale (ats_cli.data.tiff_meta.not_a_microscope_scale)
        mpp = f"scale unknown, read as it is: {i.scale_unknown}"
    table = Table(show_header=True)  # the path on a line of its own: a title would wrap at the table's width
    for col in ("level", "height", "width", "downsample"):
        table.add_column(col, justify="right")
    for k, ((h, w), d) in enumerate(zip(i.levels, i.downsamples, strict=True)):
        table.add_row(str(k), f"{h:,}", f"{w:,}", f"{d:g}")
    console.print(f"[bold]{escape(str(path))}[/]")
    console.print(f"reader: {i.reader}   vendor: {i.vendor}   channels: {i.channels}   mpp: {mpp}")
    console.print(table)
    _suggest(max(i.levels[0]), console)
    return True


def _suggest(long_side: int, console: Console) -> None:
    """The sizes ``ats train`` settles for images of this long side, when neither a flag nor
    the dataset's hints give them (one rule: :func:`ats_cli.config.sizes_for`)."""
    from ats_cli.config import sizes_for

    sizes = sizes_for(long_side)
    flags = " ".join(f"--{k.replace('_', '-')} {v:g}" for k, (v, _) in sizes.items())
    console.print(f"ats train would settle, without these flags or dataset.json hints: {flags}")
    for key, (value, why) in sizes.items():
        console.print(f"  {key} {value:g}: {escape(why)}")


def _show_folder(folder: Path, console: Console, err: Console) -> bool:
    """A folder's images (recursively, as ``make-dataset from-folder`` finds them): how many,
    their sizes from the headers, and the settings for their typical long side."""
    from ats_cli.data.dataset import OMEZARR, VIRTUAL, backend, find_inputs
    from ats_cli.data.images import pil_size

    files = find_inputs(folder)
    shapes = [s for s in (_opened_size(p) if backend(p) in (OMEZARR, VIRTUAL) else pil_size(p) for p in files) if s]
    if not shapes:
        err.print(f"[red]error:[/] {escape(str(folder))}: no image whose size can be read (of {len(files)} file(s))")
        return False
    sides = sorted(max(s) for s in shapes)
    distinct = len(set(shapes))
    console.print(f"[bold]{escape(str(folder))}[/]")
    console.print(f"{len(shapes)} image(s) in {distinct} size(s), long side {sides[0]}-{sides[-1]} px, typically "
                  f"{sides[len(sides) // 2]} px" + (f" ({len(files) - len(shapes)} unreadable)"
                                                   if len(files) > len(shapes) else ""))
    _suggest(sides[len(sides) // 2], console)
    return True


def _opened_size(path: Path) -> tuple[int, int] | None:
    """An OME-Zarr store's or a virtual slide's level-0 (H, W), which PIL cannot read, from
    its reader (metadata only); None when it cannot be opened."""
    from ats_cli.data.slides import open_image

    try:
        with open_image(path) as slide:
            return slide.dimensions
    except Exception:  # noqa: BLE001 - counted as unreadable, as an image pil_size cannot read
        return None


def _pillow(path: Path | str, reader: str) -> bool:
    """Whether the pillow reader opens ``path`` (as :func:`ats_cli.data.slides.open_image`
    chooses: by suffix, and an unknown suffix is an image)."""
    from ats_cli.data.dataset import PILLOW, backend
    from ats_cli.data.remote import is_url

    return (is_url(path) or path.is_file()) and (reader == PILLOW
                                                 or (reader == "auto" and backend(path) in (PILLOW, None)))


def _image_info(path: Path | str, max_pixels: int | None) -> SimpleNamespace:
    """What the pillow reader's ``info()`` says of ``path``, from the same decode
    (:func:`ats_cli.data.images.decode_pil`: a damaged or refused image fails here as it
    does there), without importing the slide readers, which import torch: ``ats info`` on a
    PNG took 7 s, all but 1 of them torch's import."""
    from ats_cli.data.images import decode_pil

    arr = decode_pil(path, max_pixels)
    h, w, c = arr.shape
    return SimpleNamespace(reader="pillow", vendor="image", channels=c, mpp=None, levels=((h, w),), downsamples=(1.0,),
                           scale_unknown="")


def _slide_info(path: Path | str, reader: str, max_pixels: int | None) -> Any:
    from ats_cli.data.slides import open_image

    with open_image(path, reader=reader, max_pixels=max_pixels) as slide:
        return slide.info()
