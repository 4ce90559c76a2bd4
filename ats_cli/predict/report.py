"""What ``ats predict`` shows on the terminal: a progress bar while it runs, then the
predictions table, accuracy and confusion matrix (when labels are known), a one-line
summary and the failures by name. The CSV holds every row; the terminal shows what fits."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ats_cli.multilabel import NO_CLASS, split_label
from ats_cli.predict.inputs import InputItem
from ats_cli.predict.metrics import Evaluation, evaluate, evaluate_multilabel
from ats_cli.predict.output import AttentionSaver
from ats_cli.predict.predictor import PredictionRow, Predictor

__all__ = ["estimator_note", "print_multilabel", "print_results", "run_with_progress"]

MAX_ROWS_SHOWN = 20  # rows of the terminal table; the CSV has them all
MAX_CONFUSION_CLASSES = 20  # wider confusion matrices do not fit a terminal


def estimator_note(model: object) -> str:
    """'estimator threshold, ' for a model that samples without replacement, else ''."""
    if getattr(model, "estimator", None) is None or getattr(model, "replace", True):
        return ""
    name, active = model.estimator, model.active_estimator
    return f"estimator {name if name == active else f'{name} ({active})'}, "


def levels_note(model: object) -> str:
    """'; two levels: 16 regions of 768 px, coarse view 24 px a region' for a two-level
    model in evaluation (what it draws, and the coarse view whose pixels set its cost: a
    view finer than training's, which --eval-coarse-px may have chosen, shows here), else ''."""
    size = getattr(model, "region_size", None)
    if size is None:
        return ""
    regions = model.eval_regions or model.regions
    return f"; two levels: {regions} regions of {size} px, coarse view {round(model.scale * size)} px a region"


def run_with_progress(predictor: Predictor, items: Sequence[InputItem], console: Console, **options
                      ) -> list[PredictionRow]:
    """:meth:`Predictor.predict` with a progress bar on ``console`` (none for one input)."""
    with Progress(TextColumn("predicting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=len(items) < 2) as bar:
        task = bar.add_task("predict", total=len(items))
        return predictor.predict(items, progress=lambda done, total: bar.update(task, completed=done), **options)


def print_results(console: Console, err: Console, rows: Sequence[PredictionRow], classes: Sequence[str], *,
                  out: str | None, to_stdout: bool, saver: AttentionSaver | None,
                  threshold: float | None = None) -> None:
    """The table, the evaluation, the summary line on ``console``; failures on ``err``.
    ``threshold``: a multi-label model's (its evaluation: :func:`print_multilabel`)."""
    good = [r for r in rows if r.ok]
    failed = [r for r in rows if not r.ok]
    if good:
        console.print(_table(good, len(good), multilabel=threshold is not None))
    evaluation = None if threshold is not None else evaluate(rows, classes)
    if threshold is not None:
        print_multilabel(console, rows, classes, threshold)
    if evaluation is not None:
        console.print(f"[bold]accuracy {evaluation.accuracy:.2%}[/] ({evaluation.correct}/{evaluation.n} labelled "
                      "images)")
        if evaluation.unknown_labels:
            console.print(f"[yellow]note:[/] label(s) {', '.join(evaluation.unknown_labels)} are not classes of the "
                          "model; those images count as wrong")
        if len(evaluation.labels) <= MAX_CONFUSION_CLASSES:
            console.print(_confusion(evaluation))
        else:
            console.print(f"(confusion matrix not shown: {len(evaluation.labels)} classes)")
    summary = f"{len(good)} predicted, {len(failed)} failed"
    if out is not None and not to_stdout:
        summary += f"; predictions written to {out}"
    elif out is None and good:
        summary += "; not saved (give --out FILE.csv to save every row)"
    if saver is not None:
        summary += f"; {saver.written} attention file(s) in {saver.folder}"
    console.print(summary)
    if failed:
        err.print(f"[red]{len(failed)} input(s) failed[/] (not in the CSV):")
        for r in failed:
            err.print(f"  {r.error}", soft_wrap=True, markup=False)
    if saver is not None and saver.errors:
        err.print(f"[red]{len(saver.errors)} attention file(s) not written[/] (predicted all the same):")
        for message in saver.errors:
            err.print(f"  {message}", soft_wrap=True, markup=False)


def print_multilabel(console: Console, rows: Sequence[PredictionRow], classes: Sequence[str], threshold: float
                     ) -> dict | None:
    """A multi-label model's evaluation on the labelled rows (:func:`evaluate_multilabel`):
    per class precision, recall, F1, average precision and support, then the macro means,
    mean AP and exact match. Returns the metrics (None without labelled rows)."""
    ev = evaluate_multilabel(rows, classes, threshold)
    if ev is None:
        return None
    table = Table(title=f"Per class (threshold {threshold:g})", title_justify="left")
    for name in ("class", "precision", "recall", "F1", "AP", "support"):
        table.add_column(name, justify="right")
    for name, c in ev["per_class"].items():
        ap = "-" if c["ap"] != c["ap"] else f"{c['ap']:.3f}"
        table.add_row(name, f"{c['precision']:.3f}", f"{c['recall']:.3f}", f"{c['f1']:.3f}", ap, str(c["support"]))
    if len(classes) <= MAX_CONFUSION_CLASSES:
        console.print(table)
    console.print(f"[bold]macro-F1 {ev['macro_f1']:.3f}[/], macro precision {ev['macro_precision']:.3f}, macro "
                  f"recall {ev['macro_recall']:.3f}, mean AP {ev['mean_ap']:.3f}, exact match {ev['exact_match']:.2%} "
                  f"({ev['n']} labelled images)")
    if ev["unknown_labels"]:
        console.print(f"[yellow]note:[/] label(s) {', '.join(ev['unknown_labels'])} are not classes of the model "
                      "(left out of the scores)")
    return ev


def _short(path: Path, width: int = 60) -> str:
    text = str(path)
    return text if len(text) <= width else "..." + text[-(width - 3):]


def _table(rows: Sequence[PredictionRow], total: int, multilabel: bool = False) -> Table:
    """The predictions (the first :data:`MAX_ROWS_SHOWN`); ``multilabel``: an empty label
    cell is the empty set, shown as :data:`~ats_cli.multilabel.NO_CLASS` (else no label, -)."""
    with_labels = any(r.label is not None and (multilabel or r.label) for r in rows)
    shown = rows[:MAX_ROWS_SHOWN]
    title = "Predictions" + (f" (first {len(shown)} of {total}; all in the CSV)" if total > len(shown) else "")
    table = Table(title=title, title_justify="left")
    table.add_column("path", overflow="fold")
    table.add_column("prediction", justify="right")
    table.add_column("probability", justify="right")
    if with_labels:
        table.add_column("label", justify="right")
    for r in shown:
        cells = [_short(r.path), r.prediction or (NO_CLASS if multilabel else ""), f"{max(r.probs):.3f}"]
        if with_labels:
            if multilabel and r.label is not None:
                mark, shown_label = "[green]" if _same(r.label, r.prediction) else "[red]", r.label or NO_CLASS
            else:
                mark = ("[green]" if _same(r.label, r.prediction) else "[red]") if r.label else ""
                shown_label = r.label or "-"
            cells.append(f"{mark}{shown_label}")
        table.add_row(*cells)
    return table


def _same(label: str, prediction: str | None) -> bool:
    """A label and a prediction that name the same class, or the same set (``3;7`` = ``7;3``)."""
    return label == prediction or sorted(split_label(label)) == sorted(split_label(prediction or ""))


def _confusion(ev: Evaluation) -> Table:
    table = Table(title="Confusion matrix (rows: label, columns: prediction)", title_justify="left")
    table.add_column("label \\ pred", justify="right", style="bold")
    for c in ev.classes:
        table.add_column(c, justify="right")
    table.add_column("recall", justify="right")
    for i, label in enumerate(ev.labels):
        counts = ev.matrix[i]
        n = sum(counts)
        cells = []
        for j, c in enumerate(ev.classes):
            v = counts[j]
            style = ("green" if c == label else "red") if v else "dim"
            cells.append(f"[{style}]{v}[/]")
        recall = counts[ev.classes.index(label)] / n if n and label in ev.classes else 0.0
        table.add_row(label, *cells, f"{recall:.0%}" if n else "-")
    return table
