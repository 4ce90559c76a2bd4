"""The `ats` command line: a thin Typer shell over the library.

Each sub-command lives in its own module and only parses arguments, calls the
library and prints; nothing of the method is implemented here.
"""

from __future__ import annotations

import os

import typer
from rich.console import Console, ConsoleDimensions

from ats_cli import __version__

PIPED_WIDTH = 1000  # columns of command output that goes to a file or a pipe


class OutputConsole(Console):
    """The rich Console every command prints with (``OutputConsole(stderr=True)`` for errors).

    On a terminal it is rich's Console. Piped or redirected to a file, rich would lay
    tables out for 80 columns (or the width of the terminal the command was started
    from) and cut or wrap their cells; here the width is then :data:`PIPED_WIDTH`, so a
    table keeps its natural width and a row stays one line. ``COLUMNS`` or ``width=``
    still decide when given. Decided at each print, not at creation, so module-level
    consoles follow where their stream goes (a test runner swaps sys.stdout)."""

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        if self._width is None and not os.environ.get("COLUMNS", "").isdigit() and not self.is_terminal:
            return ConsoleDimensions(PIPED_WIDTH, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


app = typer.Typer(
    name="ats",
    help="Classify megapixel and whole-slide images with attention sampling.",
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ats {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Classify megapixel and whole-slide images with attention sampling."""


# Each module registers its command(s) on `app` when imported.
from ats_cli.cli import fetch_mnist  # noqa: E402, F401  (registers make-dataset fetch-mnist)
from ats_cli.cli import from_folder as _from_folder  # noqa: E402
from ats_cli.cli import selfcheck as _selfcheck  # noqa: E402
from ats_cli.cli.make_dataset import make_dataset_app  # noqa: E402

app.add_typer(make_dataset_app, name="make-dataset")
from ats_cli.cli import benchmark as _benchmark  # noqa: E402
from ats_cli.cli import compare as _compare  # noqa: E402
from ats_cli.cli import doctor as _doctor  # noqa: E402
from ats_cli.cli import export as _export  # noqa: E402
from ats_cli.cli import info as _info  # noqa: E402
from ats_cli.cli import predict as _predict  # noqa: E402
from ats_cli.cli import prepare as _prepare  # noqa: E402, F401  (ats make-dataset prepare)
from ats_cli.cli import pretrain as _pretrain  # noqa: E402
from ats_cli.cli import train as _train  # noqa: E402
from ats_cli.cli import visualize as _visualize  # noqa: E402

_ = (_from_folder, _selfcheck, _train, _predict, _visualize, _doctor, _info, _benchmark, _compare, _pretrain,
     _export)
from ats_cli.cli.options import use_help_command  # noqa: E402

use_help_command(app, make_dataset_app)  # help reflowed to the terminal, no <bool> beside flags


def main() -> None:
    """The ``ats`` console script: the command, then :func:`exit_now` with its status."""
    try:
        app()
    except SystemExit as e:
        exit_now(e.code)
    exit_now(0)


def exit_now(code: int | str | None) -> None:
    """End the process with ``code`` (as :class:`SystemExit` reads it) without tearing the
    interpreter down.

    Why: once torch is loaded (and ``torch._dynamo``, which ``torch.optim`` imports at its
    first step), Python's finalisation -- clearing every module and collecting what they
    hold -- costs about a second of CPU at the end of every command, whatever it did
    (benchmarks/README.md, "A command's end").
    What an exit must do is still done, in the order Python does it: the ``atexit``
    handlers (logging's flush, multiprocessing's children, ``weakref.finalize`` such as a
    TemporaryDirectory's cleanup), then stdout and stderr flushed. Files are written through
    ``with`` blocks or flushed per record (atomic writes, part files), never left to a
    finaliser. First, as Python's own exit does, the threads that are not daemons are waited
    for (``threading._shutdown``: the read pools' idle workers end there); where this
    Python has no such function, its own exit is taken."""
    import atexit
    import sys
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None:
        sys.exit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the message on stderr, status 1
        print(code, file=sys.stderr)
        status = 1
    shutdown()
    atexit._run_exitfuncs()
    from ats_cli.io import end_process

    end_process(status)
