"""`ats make-dataset prepare DATA`: decode a dataset's ordinary images once, ahead of
training (a thin shell over :mod:`ats_cli.data.prepared`; ``ats train`` does the same
by itself unless ``--no-prepare``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ats_cli.cli import OutputConsole
from ats_cli.cli.make_dataset import make_dataset_app

console = OutputConsole()
err_console = OutputConsole(stderr=True)


@make_dataset_app.command("prepare")
def prepare_dataset(
    data: Annotated[Path, typer.Argument(help="Dataset directory (train.csv, test.csv, dataset.json).")],
    scale: Annotated[float, typer.Option(help="Scale of the low-res view, as ats train --scale; 0: the dataset's "
                                         "recipe's (or hint), else the default.")] = 0.0,
    channels: Annotated[int, typer.Option(help="Channels the model reads (1 or 3); 0: the dataset's hint, else 1.")]
    = 0,
    workers: Annotated[int, typer.Option(help="Processes (0: the CPU count); the entries do not depend on it.")] = 0,
) -> None:
    """Prepare the PNG/JPEG/... images of DATA for training: each decoded once, its low-res
    view stored and its pixels kept in compressed tiles, in DATA/.ats-prepared (or
    $ATS_PREPARED). Rerun to resume; a changed file is prepared again. TIFFs and slides are
    read patch by patch already and are left alone."""
    import os

    from ats_cli.config import ConfigError, TrainConfig, settle, usable_hints
    from ats_cli.data.dataset import DatasetError, load_dataset
    from ats_cli.data.facts import DataFacts
    from ats_cli.data.prepared import PreparedStore, prepare, store_folder
    from ats_cli.recipes import dataset_values

    def fail(message: str) -> typer.Exit:
        err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
        return typer.Exit(code=1)

    try:
        dataset = load_dataset(data)
    except DatasetError as e:
        raise fail(str(e)) from None
    # the view's scale as ats train settles it: --scale, else the recipe dataset.json names,
    # else its hint (an older dataset), else the default
    try:
        recipe = dataset_values(dataset.root)
    except ConfigError as e:
        raise fail(str(e)) from None
    cfg = TrainConfig(**{**recipe, **({"scale": scale} if scale else {})})
    cfg = settle(cfg, DataFacts(hints=usable_hints(dataset.hints)))[0].config
    channels = channels or int(dataset.hints.get("channels", 1))
    folder, why = store_folder(dataset.root)
    if folder is None:
        raise fail(why)
    store = PreparedStore(folder, dataset.root, channels=channels, scale=cfg.scale)
    sources = [r.path for records in dataset.splits.values() for r in records]
    columns = (TextColumn("prepare"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    try:
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("prepare", total=None)
            report = prepare(store, sources, workers=workers or os.cpu_count() or 1,
                             progress=lambda done, total: bar.update(task, completed=done, total=total),
                             log=lambda line: console.print(line, highlight=False))
    except OSError as e:
        raise fail(f"{folder}: cannot write the prepared images ({e.strerror or e}); set ATS_PREPARED=DIR") from None
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]: prepared images are kept; rerun the same command to resume")
        raise typer.Exit(code=130) from None
    console.print(report.line() + f" (channels {channels}, scale {cfg.scale:g}; {why})", highlight=False)
    for source, problem in report.failed[:10]:
        err_console.print(f"[yellow]not prepared:[/] {source}: {problem}", highlight=False, soft_wrap=True)
    if report.no_room:
        raise fail(f"{folder}: stopped with {report.no_room} images left, the disk is nearly full; free space or "
                   "set ATS_PREPARED=DIR on another disk")
