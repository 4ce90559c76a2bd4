"""`ats benchmark`: the methods' time and memory per sample, side by side, in one run."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import typer
from rich.table import Table

from ats_cli.cli import OutputConsole, app
from ats_cli.cli.options import DEVICE_OPTION


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"expected positive integers, got {text!r}")
    return values


@app.command()
def benchmark(
    dataset: str = typer.Option("megapixel-mnist", help="megapixel-mnist or synthetic-slides (a generated image) "
                                "or a dataset directory (its first test image)."),
    methods: str = typer.Option("ats,uniform,deepmil,cnn", help="Comma-separated methods to measure."),
    n_patches: str = typer.Option("5,10,50", help="Patch counts for ats and uniform."),
    image_size: int = typer.Option(None, min=16, help="Side of the generated image \\[default: 1500 for "
                                   "megapixel-mnist, 3072 for synthetic-slides].", show_default=False),
    patch_size: int = typer.Option(None, min=1, help="Patch side (ATS, U-N, Deep MIL's grid) \\[default: 50; "
                                   "synthetic-slides 64; a dataset's hint].", show_default=False),
    scale: float = typer.Option(None, help="Low-res view scale (ATS attention, CNN input) \\[default: 0.12; "
                                "synthetic-slides 1/32; a dataset's hint].", show_default=False),
    feature_net: str = typer.Option(None, help="Feature network (ATS, U-N, Deep MIL) \\[default: mnist-features; "
                                    "synthetic-slides small-cnn].", show_default=False),
    feature_width: int = typer.Option(None, help="Feature network channels \\[default: 32].", show_default=False),
    attention_net: str = typer.Option("mnist-attention", help="Attention network (ATS)."),
    attention_width: int = typer.Option(8, min=1, help="Attention network channels (block-attention: use 32)."),
    repeats: int = typer.Option(3, min=1, help="Timed steps per row (median) after the warm-up/memory step."),
    batch_size: int = typer.Option(1, min=1, help="Images per step (copies of the one image); figures are per "
                                   "sample, the step's divided by it."),
    device: str = DEVICE_OPTION,
    threads: int = typer.Option(0, min=0, help="torch CPU threads per measurement; 0 = torch's default."),
    quick: bool = typer.Option(False, "--quick", help="A 500x500 image, n_patches 10, one timed step: "
                               "about a minute on a 2-core CPU."),
    json_out: Path = typer.Option(None, "--json", help="Also write the rows as JSON to this file."),
) -> None:
    """Time and peak memory per sample of a training step (batch size 1 unless
    --batch-size, patch reading and host-to-device copy included), each method in a fresh process, with ratios to ATS.
    How memory is measured: ats_cli/benchmark.py and docs/benchmark.md."""
    from ats_cli.benchmark import ALL_METHODS, benchmark_image, dataset_defaults, plan, ratio_to_ats, run_benchmark
    from ats_cli.nets import UnknownNetworkError
    from ats_cli.runtime import resolve_device

    console = OutputConsole()
    try:
        given = {"image_size": image_size, "patch_size": patch_size, "scale": scale, "feature_net": feature_net,
                 "feature_width": feature_width}
        settings = {**dataset_defaults(dataset), **{k: v for k, v in given.items() if v is not None}}
        image_size, patch_size, scale, feature_net, feature_width = (settings[k] for k in given)
        if quick:
            image_size, repeats, n_patches = min(image_size, 512 if dataset == "synthetic-slides" else 500), 1, "10"
        dev = str(resolve_device(device))
        counts = _ints(n_patches)
        image = benchmark_image(dataset, image_size)
    except (ValueError, OSError) as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    ref_n = 10 if 10 in counts else counts[0]
    names = [m.strip() for m in methods.split(",") if m.strip()]
    # Progress on stderr, a line as each row starts, reaches each part and ends (no part
    # takes more than a few seconds in --quick), so the table alone can be redirected.
    err = OutputConsole(stderr=True, highlight=False, soft_wrap=True)
    unknown = sorted(set(names) - set(ALL_METHODS))
    if unknown:
        console.print(f"[red]error:[/] unknown method(s) {', '.join(unknown)}; choose from {', '.join(ALL_METHODS)}")
        raise typer.Exit(2)
    todo = plan(names, counts)
    err.print(f"benchmark: {len(todo)} row(s), each in a fresh process, on a {image.shape[1]}x{image.shape[2]} "
              f"image, {dev}, {repeats} timed step(s) per row")
    started: dict[str, float] = {}

    def row_name(spec) -> str:
        return spec.method + (f"-{spec.n_patches}" if spec.n_patches else "")

    def progress(spec) -> None:
        started[row_name(spec)] = time.perf_counter()
        err.print(f"[{len(started)}/{len(todo)}] {row_name(spec)}: starting a process")

    def stage(spec, text: str) -> None:
        err.print(f"[{len(started)}/{len(todo)}] {row_name(spec)}: {text} "
                  f"({time.perf_counter() - started[row_name(spec)]:.0f} s)")

    def finished(spec, row, seconds: float) -> None:
        what = (f"{row['time_ms_per_sample']:.1f} ms, {row['peak_mem_mb_per_sample']:.1f} MB per sample"
                if row["time_ms_per_sample"] is not None else f"failed: {row['error']}")
        err.print(f"[{len(started)}/{len(todo)}] {row_name(spec)}: {what} (row took {seconds:.0f} s)")

    with tempfile.TemporaryDirectory() as tmp:
        try:
            rows = run_benchmark(
                image, names, counts, tmp_dir=tmp, threads=threads, progress=progress, stage=stage,
                finished=finished, patch_size=patch_size, scale=scale, feature_net=feature_net,
                feature_width=feature_width, attention_net=attention_net, attention_width=attention_width,
                device=dev, repeats=repeats, batch_size=batch_size)
        except (ValueError, UnknownNetworkError) as e:
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(2) from None
    ref = ratio_to_ats(rows, ref_n)
    ref_name = f"ATS-{ref['n_patches']}" if ref else "ATS"
    table = Table(title=f"Per sample, one training step, batch {batch_size} | {image.shape[1]}x{image.shape[2]} | "
                  f"{dev}")
    for col in ("method", "time (ms)", "peak mem (MB)", f"time / {ref_name}", f"mem / {ref_name}"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        name = r["method"] + (f"-{r['n_patches']}" if r["n_patches"] else "")
        if r["time_ms_per_sample"] is None:
            table.add_row(name, "[red]failed", "", "", "")
            console.print(f"[yellow]{name}:[/] {r['error']}")
            continue
        ratios = ["", ""]
        if ref:
            ratios = [f"{r['time_ms_per_sample'] / ref['time_ms_per_sample']:.2f}x",
                      f"{r['peak_mem_mb_per_sample'] / max(ref['peak_mem_mb_per_sample'], 1e-9):.2f}x"]
        table.add_row(name, f"{r['time_ms_per_sample']:.1f}", f"{r['peak_mem_mb_per_sample']:.1f}", *ratios)
    console.print(table)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        from ats_cli.io import atomic_write_text

        atomic_write_text(json_out, json.dumps(rows, indent=2) + "\n")
        console.print(f"rows written to {json_out}")
