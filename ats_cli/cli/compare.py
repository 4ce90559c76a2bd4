"""`ats compare`: train the chosen methods on one dataset, then their accuracy against cost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from ats_cli.cli import OutputConsole, app
from ats_cli.cli.options import config_option

# the settings every method shares, as `ats train` flags (feature_train: a key, so --set)
SHARED = {"epochs": "--epochs", "seed": "--seed", "batch_size": "--batch-size", "feature_net": "--feature-net",
          "feature_weights": "--feature-weights", "device": "--device"}


@app.command()
def compare(
    data: Path = typer.Argument(..., help="Dataset directory (train.csv, test.csv, optional val.csv, dataset.json).",
                                show_default=False),
    out: Path = typer.Option(..., "--out", "-o", help="Where the comparison goes: compare.csv, compare.png, "
                             "compare.json and one run directory (and .log) per method.", show_default=False),
    methods: str = typer.Option("ats,deepmil,ips", help="Comma-separated methods, any ats train --method accepts."),
    epochs: int = config_option("epochs", None, min=1),
    seed: int = config_option("seed", None),
    batch_size: int = config_option("batch_size", None, min=0),
    feature_net: str = config_option("feature_net", None),
    feature_weights: str = config_option("feature_weights", None),
    feature_train: str = config_option("feature_train", None, check=True),
    device: str = config_option("device", None),
    recipe: str = typer.Option(None, "--recipe", metavar="NAME", show_default=False,
                               help="Every method starts from this recipe's settings (as ats train --recipe)."),
    config: Path = typer.Option(None, "--config", help="TOML file of training keys, for every method."),
    set_: list[str] = typer.Option(None, "--set", metavar="KEY=VALUE", show_default=False,
                                   help="A training key for every method (as ats train --set); repeat for more."),
    overwrite: bool = typer.Option(False, "--overwrite", show_default=False,
                                   help="Train again a method that finished in --out with other data or settings "
                                        "(its old run is moved aside). Without it that is refused."),
) -> None:
    """Train each method on DATA with the same encoder, seed, epochs and batch size (each
    method's own defaults otherwise), each in a process of its own, and set their accuracy
    against their cost: the wall time (data preparation and feature extraction included),
    the peak memory (RSS; GPU peak on CUDA) and the test accuracy of best.pt after every
    epoch. Writes OUT/compare.csv and OUT/compare.png and prints a table. A method that
    fails gets a row saying why, and the others still run. Run again, it skips the methods
    that finished with the same data and settings. How it measures: docs/benchmark.md."""
    from ats_cli.cli.train import resolve_train_config
    from ats_cli.compare import CompareError, parse_methods, run_compare
    from ats_cli.config import ConfigError
    from ats_cli.data.dataset import DatasetError, check_dataset_root
    from ats_cli.runtime import stop_signals_interrupt

    console = OutputConsole()
    err = OutputConsole(stderr=True, highlight=False, soft_wrap=True)
    given = {"epochs": epochs, "seed": seed, "batch_size": batch_size, "feature_net": feature_net,
             "feature_weights": feature_weights, "device": device}
    try:
        names = parse_methods(methods)
        check_dataset_root(data.expanduser())
        sets = list(set_ or [])
        if feature_train is not None:
            sets.append(f"feature_train={feature_train}")
        configs: dict[str, dict[str, Any]] = {}
        for m in names:  # every method's settings resolved now: a bad key is one line before anything runs
            cfg = resolve_train_config(data, out / m, config, recipe, None, sets, {**given, "method": m}).to_dict()
            configs[m] = {k: v for k, v in cfg.items() if k not in ("data", "out")}
    except (CompareError, ConfigError, DatasetError, ValueError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    train_args = [a for k, flag in SHARED.items() if given[k] is not None for a in (flag, str(given[k]))]
    if recipe is not None:
        train_args += ["--recipe", recipe]
    if config is not None:
        train_args += ["--config", str(config)]
    train_args += [a for item in sets for a in ("--set", item)]

    def epoch_line(method: str, row: dict[str, Any]) -> None:
        val = f"val {row['val_acc']:.3f}, " if row.get("val_acc") is not None else ""
        err.print(f"  {method} epoch {row['epoch']}: best.pt (epoch {row['best_epoch']}) {val}"
                  f"test {row['test_acc']:.3f}; {row['wall_s']:.1f} s")

    try:
        with stop_signals_interrupt():  # SIGTERM (a scheduler's stop) stops the method running as Ctrl-C does
            results = run_compare(data, out, names, configs, train_args=train_args, overwrite=overwrite,
                                  say=err.print, on_epoch=epoch_line)
    except (CompareError, DatasetError, OSError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted; what finished is in {out}; the same command continues (the "
                      "interrupted method is trained again from its start)")
        raise typer.Exit(130) from None
    console.print(results_table(results, out))
    for r in results:
        if r.status != "done":
            console.print(f"[yellow]{r.method}:[/] {escape(r.error)}", soft_wrap=True)
    console.print(f"{out / 'compare.csv'}, {out / 'compare.png'}", highlight=False, soft_wrap=True)
    if any(r.status != "done" for r in results):
        raise typer.Exit(1)


def results_table(results: list[Any], out: Path) -> Table:
    """One row per method: its cost (whole wall time, peak RSS, GPU peak) and best.pt."""
    from ats_cli.compare import fmt

    table = Table(title=f"ats compare | {out}")
    cols = ("method", "status", "epochs", "wall time (s)", "peak RSS (MB)", "GPU peak (MB)", "best epoch",
            "val acc", "test acc", "encoder", "batch")
    for col in cols:
        table.add_column(col, justify="left" if col in ("method", "status", "encoder") else "right")
    for r in results:
        best = r.best or {}
        status = "done" if r.status == "done" else f"[red]{r.status}"
        if r.skipped:
            status += " (before)"
        encoder = f"{r.feature_net} ({r.feature_train})" if r.feature_net else "-"
        table.add_row(r.method, status, str(len(r.epochs)), fmt(r.wall_s, ".1f"), fmt(r.peak_mb, ".0f"),
                      fmt(r.gpu_peak_mb, ".0f"), str(best.get("best_epoch", "-")), fmt(best.get("val_acc")),
                      fmt(best.get("test_acc")), escape(encoder), str(r.batch_size or "-"))
    return table
