"""`ats make-dataset`: write datasets in the ats format (a thin shell over :mod:`ats_cli.data`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ats_cli.cli import OutputConsole
from ats_cli.data.dataset import DatasetError
from ats_cli.data.generation import GenerationReport
from ats_cli.data.megapixel_mnist import (
    PlacementError,
    check_output,
    generate_megapixel_mnist,
    make_config,
    split_sizes,
)
from ats_cli.data.mnist import DigitSourceError, resolve_digits
from ats_cli.data.noise import FAMILIES as NOISE_FAMILIES

make_dataset_app = typer.Typer(
    help="Create a dataset in the ats format (train.csv / test.csv / dataset.json).",
    no_args_is_help=True,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)

console = OutputConsole()
err_console = OutputConsole(stderr=True)


class Preset(StrEnum):
    paper = "paper"
    small = "small"


class Task(StrEnum):
    majority = "majority"
    max = "max"
    top = "top"
    multilabel = "multilabel"


def fail(err: Exception) -> typer.Exit:
    """``err`` as the one-line error every ``make-dataset`` command prints (exit 1)."""
    err_console.print(f"[bold red]error:[/] {err}", highlight=False, markup=True, soft_wrap=True)
    return typer.Exit(code=1)


@make_dataset_app.command("megapixel-mnist")
def megapixel_mnist(
    out: Annotated[Path, typer.Argument(help="Output directory (created; rerun the same command to resume).")],
    preset: Annotated[Preset, typer.Option(help="paper: 1500x1500, 5000/1000 images, 50 noise patches; small: "
                                           "500x500, 1000/200 images, 10 noise patches. Flags below override it.")]
    = Preset.paper,
    n_train: Annotated[int | None, typer.Option("--n-train", help="Training images (paper: 5000).")] = None,
    n_test: Annotated[int | None, typer.Option("--n-test", help="Test images (paper: 1000).")] = None,
    n_val: Annotated[int | None, typer.Option(
        "--n-val", help="Validation images, each with noise patterns of its own (none in train or test): "
        "ats train then keeps best.pt by them and the test split stays untouched by any choice (paper: 1000, or "
        "0.2 x --n-train when that is given; small: 0, and best.pt is then chosen on test). See "
        "docs/datasets.md.")] = None,
    width: Annotated[int | None, typer.Option(help="Canvas width in pixels (paper: 1500).")] = None,
    height: Annotated[int | None, typer.Option(help="Canvas height in pixels (paper: 1500).")] = None,
    n_digits: Annotated[int | None, typer.Option("--n-digits", help="Digits per image (5).")] = None,
    n_target: Annotated[int | None, typer.Option("--n-target", help="Digits of the target (majority) class (3).")]
    = None,
    n_noise: Annotated[int | None, typer.Option("--n-noise", help="Noise patches per image (paper: 50).")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed; train images use seed+1, test images seed (0).")] = None,
    noise: Annotated[str | None, typer.Option(
        "--noise", metavar="FAMILY[,FAMILY...]",
        help=f"Noise family ({', '.join(NOISE_FAMILIES)}); several, comma-separated, are mixed (each noise "
             "patch draws its family uniformly from the list). Both presets: reference, the paper's. "
             "A clean set: --n-noise 0. See docs/datasets.md.")] = None,
    noise_overlap: Annotated[bool | None, typer.Option(
        "--noise-overlap/--no-noise-overlap", show_default=False,
        help="May noise cover digits? Overlapping noise is placed independently of the digits and pasted "
             "after them, as the reference does. \\[default: per family: reference yes, the others no]")] = None,
    mnist: Annotated[Path | None, typer.Option("--mnist", help="MNIST IDX directory (.gz or not) or .npz with "
                                               "x_train/y_train/x_test/y_test. Default: cached/downloaded MNIST, "
                                               "else the bundled sample digits.")] = None,
    workers: Annotated[int | None, typer.Option(help="Worker processes (default: CPU count); the output does not "
                                                "depend on it.")] = None,
    offline: Annotated[bool, typer.Option("--offline", help="Do not try to download MNIST (also: ATS_OFFLINE=1).")]
    = False,
    task: Annotated[Task, typer.Option(
        help="The label (IPS's four tasks, same images): majority digit, max (largest digit), top (top-most "
             "digit's class), multilabel (the digits present, e.g. 3;7). See docs/datasets.md.")] = Task.majority,
) -> None:
    """Generate Megapixel MNIST (thesis §3.4.2): label = the majority digit among 5, hidden in noise."""
    try:
        config = make_config(
            preset.value, n_train=n_train, n_test=n_test, n_val=n_val, width=width, height=height,
            n_digits=n_digits, n_target=n_target, n_noise=n_noise, seed=seed, noise=noise,
            noise_overlap=noise_overlap, task=task.value,
        )
        digits = resolve_digits(
            mnist,
            offline=True if offline else None,
            on_notice=lambda msg: err_console.print(f"[yellow]note:[/] {msg}", highlight=False),
        )
    except (ValueError, DigitSourceError, OSError) as err:
        raise fail(err) from None
    workers = workers or os.cpu_count() or 1
    console.print(f"Megapixel MNIST -> [bold]{out}[/]: {config.summary()}, {workers} worker(s)", highlight=False)
    console.print(f"digits: {digits.description}", highlight=False)
    try:
        check_output(out, config, digits)  # before the progress bar: a refusal should not draw one
    except DatasetError as err:
        raise fail(err) from None

    _generate(lambda progress: generate_megapixel_mnist(out, config, digits, workers=workers, progress=progress),
              split_sizes(config))


def _generate(run: Callable[[Callable[[str, int, int], None]], GenerationReport], totals: dict[str, int]) -> None:
    """Run a generator under a progress bar per split; errors and Ctrl-C become clean exits
    (finished images are kept: the same command resumes)."""
    columns = (TextColumn("{task.description:>5}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        tasks = {s: bar.add_task(s, total=t) for s, t in totals.items()}
        try:
            report = run(lambda split, done, total: bar.update(tasks[split], completed=done))
        except (DatasetError, PlacementError, ValueError, OSError) as err:
            raise fail(err) from None
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted[/]: finished images are kept; rerun the same command to resume")
            raise typer.Exit(code=130) from None

    rate = f"{report.images_per_s:.1f} images/s" if report.written else "nothing to render"
    console.print(
        f"wrote {report.written} images, skipped {report.skipped} already complete, in {report.seconds:.1f} s "
        f"({rate}, {report.workers} worker(s)); dataset: {report.dataset_json}",
        highlight=False,
    )


@make_dataset_app.command("synthetic-slides")
def synthetic_slides(
    out: Annotated[Path, typer.Argument(help="Output directory (created; rerun the same command to resume).")],
    n_train: Annotated[int, typer.Option("--n-train", help="Training slides.")] = 240,
    n_test: Annotated[int, typer.Option("--n-test", help="Test slides.")] = 80,
    size: Annotated[int, typer.Option(help="Slide side at level 0, pixels.")] = 3072,
    n_spots: Annotated[int, typer.Option("--n-spots", help="Cell clusters per slide (decoys + targets).")] = 8,
    max_targets: Annotated[int, typer.Option("--max-targets", help="A tumor slide has 1..this many targets.")] = 3,
    spot_radius: Annotated[int, typer.Option("--spot-radius", help="Cluster radius, level-0 pixels.")] = 28,
    mpp: Annotated[float, typer.Option(help="Microns per pixel written to the files.")] = 0.5,
    seed: Annotated[int, typer.Option(help="Seed; train slides use seed+1, test slides seed.")] = 0,
    stain_jitter: Annotated[float, typer.Option(
        "--stain-jitter", metavar="S",
        help="Vary the stain per slide: haematoxylin and eosin amounts times U(1-S, 1+S); 0 = every slide "
             "stained alike. The layouts do not depend on it (docs/training.md, colour augmentation).")] = 0.0,
    workers: Annotated[int | None, typer.Option(help="Worker processes (default: CPU count); the output does not "
                                                "depend on it.")] = None,
    virtual: Annotated[bool, typer.Option(
        "--virtual", help="Write virtual slides: a small .vslide.json spec per slide, rendered on demand when read "
                          "(any --size, no pixels on disk; docs/slides.md).")] = False,
    tiff: Annotated[bool, typer.Option(
        "--tiff", help="With --virtual: render each virtual slide into a real pyramidal TIFF (lossless, the same "
                       "pixels) instead of writing its spec.")] = False,
) -> None:
    """Generate synthetic whole slides: pyramidal tiled TIFFs of pink "tissue" whose label
    (tumor / normal) is decided by a few small cell clusters that look alike in the
    low-resolution view and differ only at full resolution. See docs/slides.md."""
    from ats_cli.data.synthetic_slides import SyntheticSlidesConfig, check_slides_output, generate_synthetic_slides

    check, generate = check_slides_output, generate_synthetic_slides
    if tiff and not virtual:
        raise fail(ValueError("--tiff renders virtual slides into TIFFs: give --virtual too"))
    if virtual:
        from functools import partial

        from ats_cli.data.virtual_slides import check_virtual_output, generate_virtual_slides

        check, generate = partial(check_virtual_output, tiff=tiff), partial(generate_virtual_slides, tiff=tiff)

    try:
        config = SyntheticSlidesConfig(n_train=n_train, n_test=n_test, size=size, n_spots=n_spots,
                                       max_targets=max_targets, spot_radius=spot_radius, mpp=mpp,
                                       seed=seed, stain_jitter=stain_jitter).validate()
        check(out, config)
    except (ValueError, OSError) as err:
        raise fail(err) from None
    workers = workers or os.cpu_count() or 1
    console.print(f"{'virtual ' if virtual else ''}synthetic slides -> [bold]{out}[/]: {config.summary()}, "
                  f"{workers} worker(s)", highlight=False)
    _generate(lambda progress: generate(out, config, workers=workers, progress=progress),
              {"train": n_train, "test": n_test})
