"""`ats make-dataset from-folder SRC OUT`: an ImageFolder-style tree as an ats dataset (a thin
shell over :func:`ats_cli.data.folder.dataset_from_folder`)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from ats_cli.cli import OutputConsole
from ats_cli.cli.make_dataset import fail, make_dataset_app
from ats_cli.data.folder import dataset_from_folder

console = OutputConsole()


class Mode(StrEnum):
    reference = "reference"
    copy = "copy"
    link = "link"


@make_dataset_app.command("from-folder")
def from_folder(
    src: Annotated[Path, typer.Argument(help="Folder with one sub-folder per class (SRC/<class>/<image>).")],
    out: Annotated[Path, typer.Argument(help="Output directory for train.csv, test.csv, (val.csv), dataset.json.")],
    test: Annotated[float, typer.Option("--test", help="Fraction of each class for the test split.")] = 0.2,
    val: Annotated[float, typer.Option("--val", help="Fraction of each class for a validation split (0: none).")]
    = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the stratified split.")] = 0,
    mode: Annotated[Mode, typer.Option(help="reference: CSVs point at the source files by absolute path; "
                                       "copy / link: copy or symlink them under OUT/images/.")] = Mode.reference,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing dataset.json in OUT.")] = False,
) -> None:
    """Turn an ImageFolder-style tree into the ats format (seeded, stratified split; no copying by default)."""
    try:
        dataset = dataset_from_folder(src, out, test_fraction=test, val_fraction=val, seed=seed,
                                      mode=mode.value, overwrite=force)
    except (ValueError, OSError) as err:  # DatasetError is a ValueError
        raise fail(err) from None
    counts = ", ".join(f"{name} {len(rows)}" for name, rows in dataset.splits.items())
    names = ", ".join(dataset.classes[:10]) + (", ..." if len(dataset.classes) > 10 else "")
    console.print(
        f"{len(dataset.classes)} classes ({names}); {counts}; written to {dataset.root / 'dataset.json'}",
        highlight=False,
    )

