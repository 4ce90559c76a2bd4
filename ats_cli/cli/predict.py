"""`ats predict`: parse flags, check them, call :mod:`ats_cli.predict`, write the CSV and
print the results (:mod:`ats_cli.predict.report`)."""

from __future__ import annotations

import datetime
import io
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ats_cli.cli import OutputConsole, app
from ats_cli.cli.options import (
    DEVICE_OPTION,
    SEED_OPTION,
    LevelOption,
    MaxPixelsOption,
    MppOption,
    NPatchesOption,
    ReaderOption,
    TissueOption,
    tissue_setting,
)


@app.command()
def predict(
    inputs: Annotated[list[str], typer.Argument(
        metavar="PATH", show_default=False,
        help="Image files, directories, glob patterns (quoted or not), dataset CSVs (path[,label] columns) or "
             "dataset directories (their test.csv).")],
    model: Annotated[str, typer.Option("--model", "-m", show_default=False,
                                       help="Model checkpoint (.pt), or a run directory (its best.pt).")],
    out: Annotated[str | None, typer.Option(
        "--out", "-o", show_default=False,
        help="Write the predictions CSV here ('-' = stdout); without it only the table is shown.")] = None,
    n_patches: NPatchesOption = None,
    estimator: Annotated[str | None, typer.Option(
        "--estimator", show_default=False,
        help="auto | threshold | sequential: the unbiased estimator (same expectation, different noise; "
             "in prediction auto = threshold; ats_cli/core/sampling.py) \\[default: the model's; auto for "
             "models saved before the choice existed].")] = None,
    samples: Annotated[int, typer.Option(
        "--samples", min=1, help="Average this many independent samplings per image.")] = 1,
    batch_size: Annotated[int, typer.Option(
        "--batch-size", min=1,
        help="Images of equal size per forward pass. 1 keeps each file's result independent of the other "
             "inputs.")] = 1,
    device: str = DEVICE_OPTION,
    seed: int = SEED_OPTION,
    recursive: Annotated[bool, typer.Option("--recursive", "-r",
                                            help="Also take images from sub-directories.")] = False,
    reader: ReaderOption = None,
    level: LevelOption = None,
    mpp: MppOption = None,
    tissue_mask: TissueOption = None,
    max_pixels: MaxPixelsOption = None,
    save_attention: Annotated[Path | None, typer.Option(
        "--save-attention", metavar="DIR", show_default=False,
        help="Also write each input's attention and sampled patches as GeoJSON for QuPath (level-0 pixels) to "
             "DIR/<name>.geojson, as it is predicted; a name seen before gets -2, -3, ... (docs/slides.md).")] = None,
    devices: Annotated[int | None, typer.Option(
        "--devices", min=1, show_default=False,
        help="Predict in N processes on this machine: one per GPU, or N CPU processes (starts torchrun for you, as "
             "ats train --devices; needs --out FILE) \\[default: 1].")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Predict every input again and replace --out. Without it an existing --out of this model "
                            "is resumed (its inputs are skipped) and one of another model or cohort is refused.")]
    = False,
    prefetch: Annotated[bool, typer.Option(
        "--prefetch/--no-prefetch",
        help="Open the next input (its low-res view) in a background thread while the current one is predicted.")]
    = True,
) -> None:
    """Predict the class of images with a trained model.

    Unreadable, too-small or too-large images (and any whose prediction is not a finite
    number) are reported on stderr (by file name) and left out of the CSV; the others are
    still predicted, and the exit status is then 1. A model file that cannot be used, or
    an --out that cannot be written, exits with status 2 before any image is read. Ctrl-C
    writes the rows finished so far to --out, says so and exits with status 130.

    With --out FILE every finished input is also appended to FILE.part-R as it goes, so
    rerunning the same command resumes where a run stopped (or crashed); --devices N (or
    torchrun) shares the inputs among processes and merges one CSV (docs/predict-visualize.md).
    """
    from ats_cli import distributed
    from ats_cli.predict import AttentionSaver, PredictionInterrupted, resolve_inputs
    from ats_cli.predict.report import print_results, run_with_progress

    to_stdout = out == "-"
    # with --out -, stdout carries the CSV only; everything else goes to stderr
    console = OutputConsole(stderr=to_stdout, highlight=False, soft_wrap=True)
    err = OutputConsole(stderr=True, highlight=False, soft_wrap=True)
    if level is not None and mpp is not None:
        err.print("[red]error:[/] give --level or --mpp, not both")
        raise typer.Exit(2)
    try:
        ctx = distributed.from_env()
    except ValueError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    several = ctx.enabled or (devices is not None and devices > 1)
    if several and (out is None or to_stdout):
        err.print("[red]error:[/] several processes need --out FILE.csv (each writes its part next to it, the first "
                  "merges them)")
        raise typer.Exit(2)
    if devices is not None and devices > 1 and ctx.enabled:
        err.print("[red]error:[/] --devices starts the processes itself; under torchrun leave it out")
        raise typer.Exit(2)
    params = dict(inputs=inputs, model=model, out=out, n_patches=n_patches, estimator=estimator, samples=samples,
                  batch_size=batch_size, device=device, seed=seed, recursive=recursive, reader=reader, level=level,
                  mpp=mpp, tissue_mask=tissue_mask, max_pixels=max_pixels, save_attention=save_attention,
                  overwrite=overwrite, prefetch=prefetch)
    if devices is not None and devices > 1:
        raise typer.Exit(_launch(devices, params, err))
    if out is not None and not to_stdout:
        raise typer.Exit(_predict_cohort(params, console, err))
    predictor = _load(params, device, err, check_out=False)
    if predictor is None:
        raise typer.Exit(2)

    items = resolve_inputs(inputs, recursive=recursive)
    _print_header(console, predictor, items, params)
    opener = _opener(predictor, params, err)
    saver = None if save_attention is None else AttentionSaver(save_attention, items, predictor, seed, samples)
    try:
        rows = run_with_progress(predictor, items, err, n_patches=n_patches, samples=samples,
                                  batch_size=batch_size, seed=seed, reader=opener, on_output=saver,
                                  prefetch=prefetch)
    except PredictionInterrupted as stop:
        _save_interrupted(stop, out, to_stdout, predictor.classes, err)
        raise typer.Exit(130) from None
    try:
        _write_csv(rows, predictor.classes, out, to_stdout)
    except OSError as e:
        err.print(f"[red]error:[/] cannot write {out}: {e}", soft_wrap=True)
        raise typer.Exit(1) from None
    print_results(console, err, rows, predictor.classes, out=out, to_stdout=to_stdout, saver=saver)
    if any(not r.ok for r in rows) or (saver is not None and saver.errors):
        raise typer.Exit(1)


def _print_header(console: Console, predictor, items, params: dict, procs: str = "") -> None:
    """The line before the predictions: model, inputs and the sampling settings in force
    (without --n-patches: the model's evaluation count, ATSModel.patches_now in the eval
    mode a loaded predictor is in; '-' for a model that does not sample)."""
    from ats_cli.predict.report import estimator_note

    n_ok_inputs = sum(item.error is None for item in items)
    n_patches = params["n_patches"] or getattr(predictor.model, "patches_now", "-")
    console.print(f"model {predictor.path} ({len(predictor.classes)} classes, {predictor.device}{procs}); "
                  f"{n_ok_inputs} image(s); n_patches {n_patches}, "
                  f"{estimator_note(predictor.model)}samples {params['samples']}, seed {params['seed']}")


def _opener(predictor, params: dict, err: Console, *, announce: bool = True):
    """How inputs are opened: the model's reading options overridden by the command's;
    with ``announce``, the first input read each way says how (level, resampling)."""
    from ats_cli.data.magnification import announce_readings

    opener = predictor.opener(reader=params["reader"], level=params["level"], mpp=params["mpp"],
                              tissue=tissue_setting(params["tissue_mask"]), max_pixels=params["max_pixels"])
    if not announce:
        return opener
    return announce_readings(opener, lambda line: err.print(escape(line), soft_wrap=True, highlight=False))


def _write_csv(rows, classes: list[str], out: str | None, to_stdout: bool) -> None:
    """The predictions CSV to stdout (``--out -``), to ``out``, or nowhere (no ``--out``)."""
    from ats_cli.predict import predictions_csv_text, write_predictions_csv

    if to_stdout:
        sys.stdout.write(predictions_csv_text(rows, classes))
        sys.stdout.flush()
    elif out is not None:
        write_predictions_csv(out, rows, classes)


def _save_interrupted(stop, out: str | None, to_stdout: bool, classes: list[str], err: Console) -> None:
    """Ctrl-C: write the rows finished so far where the full CSV would have gone, and say so."""
    good = sum(r.ok for r in stop.rows)
    try:
        _write_csv(stop.rows, classes, out, to_stdout)
        where = "written to stdout" if to_stdout else "not saved (no --out)" if out is None else f"written to {out}"
    except OSError as e:
        where = f"not saved: cannot write {out}: {e.strerror or e}"
    err.print(f"[yellow]interrupted[/] after {len(stop.rows)} of {stop.total} input(s): the {good} predicted are "
              f"{escape(where)}", soft_wrap=True)


def _attention_writable(folder: Path, predictor, err: Console) -> bool:
    """--save-attention DIR: the model must have an attention map and DIR must be writable
    (checked before any work); False after saying why."""
    from ats_cli.geojson import check_model
    from ats_cli.io import check_writable

    try:
        check_model(predictor.model)
        check_writable(folder / "probe.geojson")
    except ValueError as e:
        err.print(f"[red]error:[/] --save-attention: {escape(str(e))}", soft_wrap=True)
        return False
    except OSError as e:
        err.print(f"[red]error:[/] cannot write to {escape(str(folder))}: {escape(e.strerror or str(e))} "
                  "(nothing was predicted)", soft_wrap=True)
        return False
    return True


# ---------------------------------------------------------------------------- --out FILE: resumable, several processes

COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)  # the final barrier waits for the rank with the slowest share
PROGRESS_EVERY_S = 30.0  # with several processes, each prints a progress line this often
STATUS_FILE_ENV = "ATS_PREDICT_STATUS_FILE"  # --devices: rank 0 leaves its exit status here, not as torchrun's


def _settings(params: dict, predictor) -> dict:
    """What makes two runs' predictions interchangeable (recorded in the part files): the
    model file and every option that changes a probability."""
    path = predictor.path.resolve()
    stat = path.stat()
    keep = ("n_patches", "estimator", "samples", "batch_size", "seed", "reader", "level", "mpp", "tissue_mask",
            "max_pixels")
    return {"model": str(path), "model_bytes": stat.st_size, "model_mtime": int(stat.st_mtime),
            **{k: params[k] for k in keep}}


def _load(params: dict, device: str, err: Console, *, check_out: bool):
    """The model and the checks made before any image is read; None after saying why."""
    from ats_cli.checkpoint import CheckpointError
    from ats_cli.data.images import max_pixels_limit
    from ats_cli.io import check_writable
    from ats_cli.predict import load_predictor

    try:
        max_pixels_limit(params["max_pixels"])
        predictor = load_predictor(params["model"], device, estimator=params["estimator"])
    except (CheckpointError, ValueError, RuntimeError) as e:
        err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        return None
    if check_out:
        try:
            check_writable(params["out"])
        except OSError as e:
            err.print(f"[red]error:[/] cannot write {escape(params['out'])}: {escape(e.strerror or str(e))} (nothing "
                      "was predicted)", soft_wrap=True)
            return None
    if params["save_attention"] is not None and not _attention_writable(params["save_attention"], predictor, err):
        return None
    return predictor


def _worker_args(params: dict) -> list[str]:
    """``ats predict`` arguments that reproduce ``params`` (for the processes --devices starts)."""
    args = [*params["inputs"], "--model", params["model"], "--out", params["out"]]
    for name in ("n_patches", "estimator", "samples", "batch_size", "device", "seed", "reader", "level", "mpp",
                 "tissue_mask", "max_pixels", "save_attention"):
        if params[name] is not None:
            args += ["--" + name.replace("_", "-"), str(params[name])]
    args += ["--recursive"] * params["recursive"] + ["--overwrite"] * params["overwrite"]
    return args + ([] if params["prefetch"] else ["--no-prefetch"])


def _launch(devices: int, params: dict, err: Console) -> int:
    """``--devices N``: check what can be checked here (model, --out, a cohort to resume),
    then run this command in N processes through torchrun; their exit status."""
    import tempfile

    from ats_cli import distributed
    from ats_cli.predict import resolve_inputs
    from ats_cli.predict.cohort import CohortError, plan

    predictor = _load(params, "cpu", err, check_out=True)  # on CPU: the GPUs are the workers'
    if predictor is None:
        return 2
    try:
        distributed.check_devices(devices, params["device"])
        if not params["overwrite"]:
            plan(params["out"], resolve_inputs(params["inputs"], recursive=params["recursive"]), predictor.classes,
                 _settings(params, predictor))
    except (CohortError, ValueError) as e:
        err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        return 2
    del predictor
    with tempfile.NamedTemporaryFile("w", prefix="ats-predict-", suffix=".status", delete=False) as f:
        status = Path(f.name)
    try:
        rc = distributed.run_launched(distributed.launch_command(devices, _worker_args(params), command="predict"),
                                      env={**os.environ, STATUS_FILE_ENV: str(status)})
        text = status.read_text().strip()
        return int(text) if rc == 0 and text.isdigit() else rc
    finally:
        status.unlink(missing_ok=True)


class _Stop(Exception):
    """Leave the process group without its closing barrier (an error or Ctrl-C on this rank)."""

    def __init__(self, code: int):
        self.code = code


def _predict_cohort(params: dict, console: Console, err: Console) -> int:
    """``ats predict --out FILE`` in this process, alone or as one rank of several: its
    share of the inputs not done yet, appended to FILE.part-RANK as they finish; then rank
    0 merges FILE. Returns the exit status (a worker of several leaves through
    :func:`ats_cli.distributed.exit_worker` instead)."""
    from ats_cli import distributed

    code = 2
    ctx = distributed.from_env()
    try:
        with distributed.process_group(params["device"], timeout=COLLECTIVE_TIMEOUT) as (ctx, device):
            code = _cohort_rank(params, ctx, device, console, err)
    except _Stop as stop:
        code = stop.code
    except ValueError as e:  # process_group: an unusable device for this rank
        err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
    if not ctx.enabled:
        return code
    status = os.environ.get(STATUS_FILE_ENV)
    if ctx.is_main and status:  # --devices reads it; torchrun would print a failure report for a non-zero status
        Path(status).write_text(str(code))
        code = 0
    distributed.exit_worker(code if ctx.is_main or code in (2, 130) else 0)


def _cohort_rank(params: dict, ctx, device, console: Console, err: Console) -> int:
    import time

    from ats_cli import distributed
    from ats_cli.predict import AttentionSaver, PredictionInterrupted, resolve_inputs
    from ats_cli.predict.cohort import CohortError, PartWriter, merge, part_path, plan, share
    from ats_cli.predict.report import print_results, run_with_progress

    out = params["out"]
    tag = f"rank {ctx.rank}: " if ctx.enabled else ""
    # one rank says what all would; another rank's own errors are kept, and said if rank 0 had none
    main_err = err if ctx.is_main else OutputConsole(file=io.StringIO(), highlight=False, soft_wrap=True)
    predictor = _load(params, str(device), main_err, check_out=ctx.is_main)
    failed_main, failed_any = distributed.all_reduce([ctx.is_main and predictor is None, predictor is None], ctx,
                                                     device, op="max")
    if failed_any:
        if predictor is None and not ctx.is_main and not failed_main:
            err.print(f"{tag}{main_err.file.getvalue().strip()}", markup=False, soft_wrap=True)
        raise _Stop(2)
    settings = _settings(params, predictor)

    def resolve():
        items = resolve_inputs(params["inputs"], recursive=params["recursive"])
        return items, plan(out, items, predictor.classes, settings, overwrite=params["overwrite"])

    try:
        items, todo_plan = distributed.from_main(resolve, ctx)
    except CohortError as e:
        main_err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise _Stop(2) from None
    todo = todo_plan.todo(items)
    mine = share(todo, ctx.rank, ctx.world_size)
    if ctx.is_main:
        _print_header(console, predictor, items, params, f", {ctx.world_size} processes" if ctx.enabled else "")
        if todo_plan.done:
            console.print(f"{len(todo_plan.done)} of {len(items)} already done, skipping (found in "
                          f"{', '.join(todo_plan.sources)}; --overwrite predicts them again)")
    opener = _opener(predictor, params, err, announce=ctx.rank == 0)  # how files are read: said once, not per rank
    saver = None
    on_output = None
    if params["save_attention"] is not None:  # names from the whole list: the same whichever rank writes a file
        saver = AttentionSaver(params["save_attention"], items, predictor, params["seed"], params["samples"])

        def on_output(j, row, opened, output, b):
            saver(mine[j], row, opened, output, b)

    writer = PartWriter(part_path(out, ctx.rank), predictor.classes, settings)
    options = dict(n_patches=params["n_patches"], samples=params["samples"], batch_size=params["batch_size"],
                   seed=params["seed"], reader=opener, on_output=on_output, prefetch=params["prefetch"],
                   on_row=lambda j, row: writer.write(mine[j], row))
    start = time.perf_counter()
    try:
        if ctx.enabled:
            predictor.predict([items[i] for i in mine], progress=_RankProgress(tag, err), **options)
        else:
            run_with_progress(predictor, [items[i] for i in mine], err, **options)
    except PredictionInterrupted as stop:
        writer.close()
        if ctx.enabled:  # the others stop too (torchrun passes Ctrl-C on); what is done stays in the part files
            main_err.print(f"[yellow]interrupted:[/] the inputs finished so far are kept in {escape(out)}.part-*; "
                           "rerun the same command to continue", soft_wrap=True)
            raise _Stop(130) from None
        _save_interrupted_cohort(stop, out, items, predictor.classes, err, overwrite=params["overwrite"])
        raise _Stop(130) from None
    writer.close()
    mine_s = time.perf_counter() - start
    if ctx.enabled:
        err.print(f"{tag}{len(mine)} input(s) in {mine_s:.1f} s", markup=False)
    written, att_errors = distributed.all_reduce(
        [saver.written if saver else 0, len(saver.errors) if saver else 0], ctx, device)  # also: all ranks done
    if saver is not None and not ctx.is_main:
        for message in saver.errors:
            err.print(f"{tag}attention file not written: {message}", soft_wrap=True, markup=False)
    if not ctx.is_main:
        return 0
    try:
        rows = merge(out, items, predictor.classes, overwrite=params["overwrite"])
    except (OSError, CohortError) as e:
        err.print(f"[red]error:[/] cannot write {escape(out)}: {escape(str(e))} (the predictions are kept in "
                  f"{escape(out)}.part-*; rerun the same command to merge them)", soft_wrap=True)
        return 1
    elapsed = time.perf_counter() - start
    if saver is not None:
        saver.written = int(written)
    print_results(console, err, rows, predictor.classes, out=out, to_stdout=False, saver=saver)
    if saver is not None and att_errors > len(saver.errors):
        err.print(f"({int(att_errors) - len(saver.errors)} more attention file(s) not written by other processes, "
                  "listed above)")
    if todo:
        from ats_cli.data.inputs import is_lazy

        # slides (read lazily: TIFFs, slide formats) or ordinary images: what the user counts in
        noun = "slide" if any(is_lazy(items[i].path) for i in todo) else "image"
        console.print(f"{len(todo)} {noun}{'s' if len(todo) != 1 else ''} in {elapsed:.1f} s: "
                      f"{60 * len(todo) / elapsed:.1f} {noun}s/minute "
                      f"({ctx.world_size} process{'es' if ctx.world_size > 1 else ''})")
    else:
        console.print(f"nothing left to predict: all {len(items)} input(s) were done already")
    return 1 if any(not r.ok for r in rows) or att_errors else 0


class _RankProgress:
    """Several processes: each prints ``rank R: done/total`` lines (no bars that overwrite
    each other), at most every :data:`PROGRESS_EVERY_S` seconds."""

    def __init__(self, tag: str, err: Console):
        import time

        self.tag, self.err, self.clock = tag, err, time.perf_counter
        self.start = self.last = self.clock()

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if now - self.last >= PROGRESS_EVERY_S and done < total:
            self.last = now
            rate = 60 * done / (now - self.start)
            self.err.print(f"{self.tag}{done}/{total} input(s), {rate:.1f}/minute", markup=False)


def _save_interrupted_cohort(stop, out: str, items, classes: list[str], err: Console, *, overwrite: bool) -> None:
    """Ctrl-C in one process: merge what is done into --out (rerunning resumes from it), and say so."""
    from ats_cli.predict.cohort import merge

    good = sum(r.ok for r in stop.rows)
    try:
        merge(out, items, classes, overwrite=overwrite)
        where = f"written to {out}"
    except OSError as e:
        where = f"kept in {out}.part-0 (cannot write {out}: {e.strerror or e})"
    err.print(f"[yellow]interrupted[/] after {len(stop.rows)} of {stop.total} input(s): the {good} predicted are "
              f"{escape(where)}; rerun the same command to continue", soft_wrap=True)
