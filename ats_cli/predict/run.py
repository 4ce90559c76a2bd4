"""Running ``ats predict`` in this process: to the terminal or stdout, or to ``--out FILE``
alone or as one rank of several (:mod:`ats_cli.runtime`).

``--out FILE`` is the resumable path (:mod:`ats_cli.predict.cohort`): rank 0 holds the
file's lock for the whole run, checks what is there against this run's record
(:mod:`ats_cli.predict.provenance`) and writes the record; every rank predicts its share
of what is left, appending each input to its part file as it finishes; rank 0 merges the
CSV. Each function returns the exit status (0 ok, 1 some inputs failed, 2 refused before
any image was read, 130 Ctrl-C) after saying, in one line, anything that went wrong.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ats_cli.predict import cohort
from ats_cli.predict.inputs import InputItem, resolve_inputs
from ats_cli.predict.output import AttentionSaver, predictions_csv_text
from ats_cli.predict.predictor import PredictionInterrupted, PredictionRow
from ats_cli.predict.provenance import holding, write_record
from ats_cli.predict.report import print_results, run_with_progress
from ats_cli.predict.session import Request, announced, load_checked, opener, print_header, run_record, run_settings

__all__ = ["COLLECTIVE_TIMEOUT", "PROGRESS_EVERY_S", "RankProgress", "predict_cohort", "predict_here"]

COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)  # the final barrier waits for the rank with the slowest share
PROGRESS_EVERY_S = 30.0  # with several processes, each prints a progress line this often


def predict_here(req: Request, console: Console, err: Console) -> int:
    """No ``--out FILE``: predict in this process; the CSV to stdout (``--out -``) or none."""
    predictor = load_checked(req, req.device, err, check_out=False)
    if predictor is None:
        return 2
    items = resolve_inputs(req.inputs, recursive=req.recursive)
    print_header(console, predictor, items, req)
    saver = None if req.save_attention is None else AttentionSaver(req.save_attention, items, predictor, req.seed,
                                                                   req.samples)
    try:
        rows = run_with_progress(predictor, items, err, n_patches=req.n_patches, samples=req.samples,
                                 batch_size=req.batch_size, seed=req.seed, reader=announced(predictor, req, err),
                                 on_output=saver, prefetch=req.prefetch)
    except PredictionInterrupted as stop:
        good = sum(r.ok for r in stop.rows)
        _write_csv(stop.rows, predictor.classes, req)
        where = "written to stdout" if req.to_stdout else "not saved (no --out)"
        err.print(f"[yellow]interrupted[/] after {len(stop.rows)} of {stop.total} input(s): the {good} predicted are "
                  f"{where}", soft_wrap=True)
        return 130
    _write_csv(rows, predictor.classes, req)
    print_results(console, err, rows, predictor.classes, out=req.out, to_stdout=req.to_stdout, saver=saver,
                  threshold=predictor.threshold)
    return 1 if any(not r.ok for r in rows) or (saver is not None and saver.errors) else 0


def _write_csv(rows: Sequence[PredictionRow], classes: list[str], req: Request) -> None:
    if req.to_stdout:
        sys.stdout.write(predictions_csv_text(rows, classes))
        sys.stdout.flush()


class _Stop(Exception):
    """Leave the process group without its closing barrier (an error or Ctrl-C on this rank)."""

    def __init__(self, code: int):
        self.code = code


def predict_cohort(req: Request, console: Console, err: Console) -> int:
    """``ats predict --out FILE`` in this process, alone or as one rank of several. Returns
    the exit status; a worker of several leaves through
    :func:`ats_cli.runtime.exit_worker` instead."""
    from ats_cli import runtime
    from ats_cli.predict.launch import STATUS_FILE_ENV

    code = 2
    ctx = runtime.from_env()
    try:
        with contextlib.ExitStack() as held, \
                runtime.process_group(req.device, timeout=COLLECTIVE_TIMEOUT) as (ctx, device):
            code = _cohort_rank(req, ctx, device, held, console, err)
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
    runtime.exit_worker(code if ctx.is_main or code in (2, 130) else 0)


def _cohort_rank(req: Request, ctx, device, held: contextlib.ExitStack, console: Console, err: Console) -> int:
    from ats_cli import runtime

    out = str(req.out)
    tag = f"rank {ctx.rank}: " if ctx.enabled else ""
    # one rank says what all would; another rank's own errors are kept, and said if rank 0 had none
    main_err = err if ctx.is_main else Console(file=io.StringIO(), highlight=False, soft_wrap=True)
    predictor = load_checked(req, str(device), main_err, check_out=ctx.is_main)
    failed_main, failed_any = runtime.all_reduce([ctx.is_main and predictor is None, predictor is None], ctx,
                                                     device, op="max")
    if failed_any:
        if predictor is None and not ctx.is_main and not failed_main:
            err.print(f"{tag}{main_err.file.getvalue().strip()}", markup=False, soft_wrap=True)
        raise _Stop(2)
    settings = run_settings(predictor, req, ctx.world_size)

    def resolve():  # rank 0, holding FILE's lock until this rank returns
        held.enter_context(holding(out))
        items = resolve_inputs(req.inputs, recursive=req.recursive)
        record = run_record(predictor, settings, items)
        todo_plan = cohort.plan(out, items, predictor.classes, settings, overwrite=req.overwrite, record=record)
        write_record(out, record)
        return items, todo_plan

    try:
        items, todo_plan = runtime.from_main(resolve, ctx)
    except (ValueError, OSError) as e:  # CohortError, the lock's RunDirError, a record that cannot be written
        text = str(e) if isinstance(e, ValueError) else \
            f"cannot write {e.filename or out}: {e.strerror or e} (nothing was predicted)"
        main_err.print(f"[red]error:[/] {escape(text)}", soft_wrap=True)
        raise _Stop(2) from None
    todo = todo_plan.todo(items)
    mine = cohort.share(todo, ctx.rank, ctx.world_size)
    if ctx.is_main:
        print_header(console, predictor, items, req, f", {ctx.world_size} processes" if ctx.enabled else "")
        if todo_plan.done:
            console.print(f"{len(todo_plan.done)} of {len(items)} already done, skipping (found in "
                          f"{', '.join(todo_plan.sources)}; --overwrite predicts them again)")
    saver = on_output = None
    if req.save_attention is not None:  # names from the whole list: the same whichever rank writes a file
        saver = AttentionSaver(req.save_attention, items, predictor, req.seed, req.samples)

        def on_output(j, row, opened, output, b):
            saver(mine[j], row, opened, output, b)

    part = cohort.part_path(out, ctx.rank)
    start = time.perf_counter()
    reader = announced(predictor, req, err) if ctx.rank == 0 else opener(predictor, req)  # said once, not per rank
    try:
        writer = cohort.PartWriter(part, predictor.classes, settings, model=str(predictor.path.resolve()))
        options = dict(n_patches=req.n_patches, samples=req.samples, batch_size=req.batch_size, seed=req.seed,
                       reader=reader, on_output=on_output, prefetch=req.prefetch,
                       on_row=lambda j, row: writer.write(mine[j], row))
        with contextlib.closing(writer):
            if ctx.enabled:
                predictor.predict([items[i] for i in mine], progress=RankProgress(tag, err), **options)
            else:
                run_with_progress(predictor, [items[i] for i in mine], err, **options)
    except PredictionInterrupted as stop:
        if ctx.enabled:  # the others stop too (torchrun passes Ctrl-C on); what is done stays in the part files
            main_err.print(f"[yellow]interrupted:[/] the inputs finished so far are kept in {escape(out)}.part-*; "
                           "rerun the same command to continue", soft_wrap=True)
            raise _Stop(130) from None
        _save_interrupted(stop, out, items, predictor.classes, err, overwrite=req.overwrite)
        raise _Stop(130) from None
    except OSError as e:  # a full disk under the part file
        err.print(f"[red]error:[/] {tag}cannot write {escape(str(part))}: {escape(e.strerror or str(e))} (the inputs "
                  "finished before are kept; free some space and rerun the same command to continue)", soft_wrap=True)
        raise _Stop(2) from None
    if ctx.enabled:
        err.print(f"{tag}{len(mine)} input(s) in {time.perf_counter() - start:.1f} s", markup=False)
    written, att_errors = runtime.all_reduce(
        [saver.written if saver else 0, len(saver.errors) if saver else 0], ctx, device)  # also: all ranks done
    if saver is not None and not ctx.is_main:
        for message in saver.errors:
            err.print(f"{tag}attention file not written: {message}", soft_wrap=True, markup=False)
    if not ctx.is_main:
        return 0
    try:
        rows = cohort.merge(out, items, predictor.classes, overwrite=req.overwrite)
    except (OSError, cohort.CohortError) as e:
        err.print(f"[red]error:[/] cannot write {escape(out)}: {escape(str(e))} (the predictions are kept in "
                  f"{escape(out)}.part-*; rerun the same command to merge them)", soft_wrap=True)
        return 1
    elapsed = time.perf_counter() - start
    if saver is not None:
        saver.written = int(written)
    print_results(console, err, rows, predictor.classes, out=out, to_stdout=False, saver=saver,
                  threshold=predictor.threshold)
    if saver is not None and att_errors > len(saver.errors):
        err.print(f"({int(att_errors) - len(saver.errors)} more attention file(s) not written by other processes, "
                  "listed above)")
    _throughput(console, items, todo, elapsed, ctx.world_size)
    return 1 if any(not r.ok for r in rows) or att_errors else 0


def _throughput(console: Console, items: Sequence[InputItem], todo: Sequence[int], elapsed: float, world: int) -> None:
    if not todo:
        console.print(f"nothing left to predict: all {len(items)} input(s) were done already")
        return
    from ats_cli.data.dataset import is_lazy

    # slides (read lazily: TIFFs, slide formats) or ordinary images: what the user counts in
    noun = "slide" if any(is_lazy(items[i].path) for i in todo) else "image"
    console.print(f"{len(todo)} {noun}{'s' if len(todo) != 1 else ''} in {elapsed:.1f} s: "
                  f"{60 * len(todo) / elapsed:.1f} {noun}s/minute ({world} process{'es' if world > 1 else ''})")


class RankProgress:
    """Several processes: each prints ``rank R: done/total`` lines (no bars that overwrite
    each other), at most every :data:`PROGRESS_EVERY_S` seconds."""

    def __init__(self, tag: str, err: Console):
        self.tag, self.err, self.clock = tag, err, time.perf_counter
        self.start = self.last = self.clock()

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if now - self.last >= PROGRESS_EVERY_S and done < total:
            self.last = now
            rate = 60 * done / (now - self.start)
            self.err.print(f"{self.tag}{done}/{total} input(s), {rate:.1f}/minute", markup=False)


def _save_interrupted(stop: PredictionInterrupted, out: str, items: Sequence[InputItem], classes: list[str],
                      err: Console, *, overwrite: bool) -> None:
    """Ctrl-C in one process: merge what is done into --out (rerunning resumes from it), and say so."""
    good = sum(r.ok for r in stop.rows)
    try:
        cohort.merge(out, items, classes, overwrite=overwrite)
        where = f"written to {out}"
    except OSError as e:
        where = f"kept in {out}.part-0 (cannot write {out}: {e.strerror or e})"
    err.print(f"[yellow]interrupted[/] after {len(stop.rows)} of {stop.total} input(s): the {good} predicted are "
              f"{escape(where)}; rerun the same command to continue", soft_wrap=True)

