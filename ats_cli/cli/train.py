"""`ats train`: parse flags, resolve the configuration, run the library's training loop."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ats_cli.cli import OutputConsole, app
from ats_cli.cli.options import config_flags, config_help
from ats_cli.config import RUN_PANEL

LOG_EVERY_S = 60.0


class _LogLines:
    """Progress as plain lines when the output is not a terminal (nohup, a batch job's log):
    rich draws its bar only on a terminal, and a CPU epoch can run for an hour, so without
    these a log shows nothing between two epoch lines. One line per ``LOG_EVERY_S``."""

    def __init__(self, print_) -> None:
        self.print, self.epoch = print_, None
        self.start = self.last = 0.0
        self.first = 0

    def __call__(self, step: int, total: int, info: dict) -> None:
        now = time.monotonic()
        if info["epoch"] != self.epoch:  # timed from the epoch's first step (data workers are up)
            self.epoch, self.first, self.start, self.last = info["epoch"], step, now, now
            return
        if now - self.last < LOG_EVERY_S or step >= total:  # the epoch line follows the last step
            return
        self.last = now
        left = (total - step) * (now - self.start) / (step - self.first)
        self.print(f"epoch {info['epoch']}: step {step}/{total}, loss {info['loss']:.3f} acc {info['acc']:.3f}, "
                   f"about {left:.0f} s left in the epoch")


def _list_recipes(value: bool) -> None:
    """``--recipes``: the shipped recipes, one line each, then exit."""
    if not value:
        return
    from ats_cli.recipes import packaged_recipes

    console = OutputConsole()
    recipes = packaged_recipes()
    width = max(len(r.name) for r in recipes)
    for r in recipes:
        console.print(f"{r.name:<{width}}  {r.description}", highlight=False, soft_wrap=True)
    raise typer.Exit()


def set_values(items: list[str] | None) -> dict[str, Any]:
    """``--set KEY=VALUE ...`` as TrainConfig keys: each VALUE read as a TOML value (``0.15``,
    ``true``, ``"on"``), else as the text it is (``--set pooling=counts``). Raises
    ConfigError in one line for an item without ``=``, an unknown key or one the command
    has an option of its own for (data, --out, --recipe)."""
    import tomllib
    from dataclasses import fields

    from ats_cli.config import ConfigError, TrainConfig

    known = {f.name for f in fields(TrainConfig)} - {"data", "out", "recipe"}
    out: dict[str, Any] = {}
    for item in items or ():
        key, eq, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in known:
            what = "not KEY=VALUE" if not eq else f"unknown key {key!r}"
            raise ConfigError(f"--set {item}: {what}; the keys: docs/configuration.md")
        try:
            out[key] = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = text.strip()
    return out


def resolve_train_config(data: Path | None, out: Path | None, config: Path | None, recipe: str | None,
                         resume: Path | None, sets: list[str] | None, flags: dict[str, Any]) -> Any:
    """The command's configuration (a TrainConfig), as :func:`ats_cli.recipes.resolve_config`
    makes it from the defaults, the recipe, the --config file, then the flags and ``--set``
    (one key given by both is refused); a resumed run: its config.json, no recipe read.
    Raises ConfigError (or ValueError) in one line; SystemExit 2 without DATA and --out."""
    from ats_cli.config import ConfigError
    from ats_cli.recipes import resolve_config

    overrides = dict(flags)  # the TrainConfig fields' flags; None = not given
    extra = set_values(sets)
    if both := sorted(k for k in extra if overrides.get(k) is not None):
        raise ConfigError(f"--set {both[0]}: given by its flag too; give it once")
    overrides.update(extra)
    if resume is not None:
        config = config or resume / "config.json"
        overrides["out"] = str(resume)
        if data is not None:
            overrides["data"] = str(data)
        if recipe is not None:
            raise ConfigError("--recipe: a resumed run keeps the settings it started with (RUN/config.json)")
    else:
        overrides.update(data=str(data), out=str(out))
    return resolve_config(config, recipe, use_recipes=resume is None, **overrides)


def recipe_line(cfg: Any, given: str | None, config: Path | None) -> str:
    """The line ``ats train`` prints before settling: the recipe, what named it and the
    values it set that nothing above it overrode (``--config``, flags, ``--set``)."""
    from ats_cli.config import load_config_file
    from ats_cli.recipes import load_recipe

    if given:
        source = "--recipe"
    elif config is not None and load_config_file(config).get("recipe"):
        source = str(config)
    else:
        source = str(Path(cfg.data) / "dataset.json")
    values = load_recipe(cfg.recipe).values
    kept = ", ".join(f"{k} {getattr(cfg, k):g}" if isinstance(getattr(cfg, k), float) else f"{k} {getattr(cfg, k)}"
                     for k, v in values.items() if getattr(cfg, k) == v)
    changed = [k for k, v in values.items() if getattr(cfg, k) != v]
    return (f"recipe {cfg.recipe} (named by {source}): {kept or 'nothing left'}"
            + (f"; overridden: {', '.join(changed)}" if changed else ""))


@app.command()
@config_flags(before="devices")  # --method ... --prepare: the TrainConfig fields marked as flags, in their panels
def train(
    data: Path = typer.Argument(None, help=config_help("data"), show_default=False),
    out: Path = typer.Option(None, "--out", "-o", help=config_help("out"), show_default=False),
    recipe: str = typer.Option(None, "--recipe", metavar="NAME", show_default=False,
                               help="Start from this recipe's settings: a name (--recipes lists them) or a .toml file "
                                    "\\[default: the one DATA/dataset.json names, else none]."),
    recipes: bool = typer.Option(False, "--recipes", callback=_list_recipes, is_eager=True, show_default=False,
                                 help="List the recipes, each with what it is for, and exit."),
    config: Path = typer.Option(None, "--config", help="TOML file of training keys (docs/configuration.md): over "
                                "the recipe's, under the flags'."),
    set_: list[str] = typer.Option(None, "--set", metavar="KEY=VALUE", show_default=False,
                                   help="Set any training key, those without a flag too (docs/configuration.md): "
                                        "--set count_floor=0.1; repeat for more. Over the --config file's."),
    resume: Path = typer.Option(None, "--resume", help="Continue the run in this directory where it stopped."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start a new run in an --out that holds one: the old "
                                   "run is moved aside to RUN.old-YYYYmmdd-HHMMSS (nothing is deleted). Without it "
                                   "such an --out is refused.", show_default=False),
    devices: int = typer.Option(None, min=1, help="Train in N processes on this machine: one per GPU, or N CPU "
                                "processes (starts torchrun for you; --batch-size is per process) \\[default: 1].",
                                rich_help_panel=RUN_PANEL),
    **flags: Any,
) -> None:
    """Train an attention-sampling model on a dataset directory.

    The settings start from the generic defaults, then a recipe (--recipe, else the one
    DATA/dataset.json names), then a TOML --config file, then the flags and --set; every key
    is listed in docs/configuration.md. What they leave to the data
    (0, -1, auto) is settled from it at the start, one printed line per value saying why;
    the settled configuration is saved as RUN_DIR/config.json and the reasons as
    RUN_DIR/settled.json. Ctrl-C saves the state; --resume RUN_DIR continues with the
    settled configuration as it is.
    A RUN_DIR that holds a run is refused unless --resume or --overwrite is given, and
    one that another ats train is writing is always refused (docs/runs-and-inputs.md).
    Several GPUs or nodes: --devices N, or run this same command under torchrun.
    """
    from rich.markup import escape

    from ats_cli import runtime
    from ats_cli.config import ConfigError
    from ats_cli.data.dataset import DatasetError, check_dataset_root
    from ats_cli.runtime import stop_signals_interrupt
    from ats_cli.train import TrainingInterrupted
    from ats_cli.train import train as run_training

    console = OutputConsole()
    if resume is None and (data is None or out is None):
        console.print("[red]error:[/] give DATA_DIR and --out RUN_DIR (or --resume RUN_DIR)")
        raise typer.Exit(2)
    try:
        cfg = resolve_train_config(data, out, config, recipe, resume, set_, flags)
        ctx = runtime.from_env()
    except (ConfigError, ValueError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    if cfg.recipe and resume is None and ctx.is_main:
        console.print(recipe_line(cfg, recipe, config), soft_wrap=True, highlight=False)
    try:  # a DATA that is no dataset folder (missing, a file, class folders): one line, no run directory made
        check_dataset_root(Path(cfg.data).expanduser())
    except DatasetError as e:
        console.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(1) from None
    if ctx.is_main:  # one run per directory, one writer at a time (ats_cli/runtime.py)
        try:
            moved = runtime.prepare_run(cfg.out, resume=resume is not None, overwrite=overwrite)
        except runtime.RunDirError as e:
            console.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(2) from None
        if moved is not None:
            console.print(f"moved the old run in {cfg.out} to {moved}", soft_wrap=True, highlight=False)

    if devices is not None and devices > 1:
        if ctx.enabled:
            console.print("[red]error:[/] --devices starts the processes itself; under torchrun leave it out")
            raise typer.Exit(2)
        try:
            raise typer.Exit(runtime.launch(devices, cfg.to_dict(), resume=resume is not None))
        except ValueError as e:
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(2) from None
    # Under torchrun every process runs this; rank 0 alone draws the bar and reports.
    with Progress(TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]:.3f} acc {task.fields[acc]:.3f}"), TimeElapsedColumn(),
                  console=console, transient=True, disable=not ctx.is_main) as bar:
        task = bar.add_task("train", total=None, epoch=0, loss=0.0, acc=0.0)

        to_log = _LogLines(bar.console.print) if not console.is_terminal else None

        def progress(phase: str, step: int, total: int, info: dict) -> None:
            bar.update(task, completed=step, total=total, **info)
            if to_log is not None:
                to_log(step, total, info)

        try:
            with stop_signals_interrupt():  # SIGTERM (a scheduler's stop) saves and stops as Ctrl-C does
                history = run_training(cfg, resume=resume is not None, progress=progress, log=bar.console.print)
        except TrainingInterrupted as e:
            if ctx.is_main:
                console.print(f"[yellow]{e}")
            raise typer.Exit(130) from None
        except KeyboardInterrupt:  # between the phases that save their own position (an epoch's end)
            if ctx.is_main:
                from ats_cli.runtime import interrupted_line

                console.print(f"[yellow]{interrupted_line(cfg.out)}")
            raise typer.Exit(130) from None
        except (DatasetError, ValueError, FileNotFoundError) as e:  # on any rank: it may be the only one
            where = f" (rank {ctx.rank})" if ctx.enabled else ""
            console.print(f"[red]error{where}:[/] {e}")
            raise typer.Exit(1) from None
    if history and ctx.is_main:
        from ats_cli.train import selection_score

        best = max(history, key=selection_score)  # best.pt's epoch
        what = "exact match" if "test_macro_f1" in best else "accuracy"  # multi-label: the whole set right
        if "val_acc" in best:
            chosen = (f"best val {what} {best['val_acc']:.3f} at epoch {best['epoch']} (best.pt), "
                      f"its test {what} {best['test_acc']:.3f}")
        else:  # chosen on the test split itself: its figure is optimistic, and says so
            chosen = (f"best test {what} {best['test_acc']:.3f} at epoch {best['epoch']} (best.pt; chosen on the "
                      "test split, no val.csv)")
        console.print(f"[green]done:[/] {chosen}; run directory {cfg.out}")
    if ctx.enabled:  # a worker of torchrun: its process group is gone; leave without the gloo teardown abort
        runtime.exit_worker(0)
