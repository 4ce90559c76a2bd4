"""`ats selfcheck`: re-run the statistical proof that sampling and the estimator are right."""

from __future__ import annotations

import time

import typer
from rich.table import Table

from ats_cli.cli import OutputConsole, app
from ats_cli.cli.options import SEED_OPTION

Z_MAX = 5.0


@app.command()
def selfcheck(
    draws: int = typer.Option(60_000, help="Monte Carlo draws per check."),
    seed: int = SEED_OPTION,
) -> None:
    """Prove on this machine that attention sampling is unbiased in value and gradients.

    For small problems with a known exact answer, draws many samples and compares the
    mean of the estimate, of its feature gradient and of its attention gradient with
    the exact values; each is reported as a z-score against the measured standard error.
    """
    from ats_cli.core.sampling import ESTIMATORS
    from ats_cli.selfcheck import check_draws, check_estimator

    console = OutputConsole()
    table = Table(title=f"Attention-sampling estimator, {draws:,} draws per row (|z| < {Z_MAX:g} passes)")
    table.add_column("problem", no_wrap=True)
    for col in ("|z| value", "|z| grad f", "|z| grad logits", "rel.err grad logits", "std value", "ok"):
        table.add_column(col, justify="right")
    t0 = time.perf_counter()
    ok_all = True
    cases = (dict(K=7, n=3), dict(K=7, n=3, peaked=True), dict(K=50, n=10), dict(K=50, n=40))
    runs = [dict(case, estimator=e) for case in cases for e in ESTIMATORS] + [dict(case, replace=True)
                                                                              for case in cases[:3]]
    for run in runs:
        r = check_estimator(**run, draws=draws, seed=seed)
        ok = r.max_z < Z_MAX
        ok_all &= ok
        table.add_row(r.name, f"{r.z_value:.2f}", f"{r.z_grad_features:.2f}", f"{r.z_grad_logits:.2f}",
                      f"{r.rel_err_grad_logits:.2%}", f"{r.std_value:.3f}", "[green]yes" if ok else "[red]NO")
    console.print(table)
    z, no_repeats = check_draws(draws=max(draws, 100_000), seed=seed)
    ok = z < Z_MAX and no_repeats
    ok_all &= ok
    console.print(f"Sampling without replacement: first/second-draw frequencies max |z| = {z:.2f}, "
                  f"repeats: {'none' if no_repeats else 'FOUND'} -> {'[green]ok' if ok else '[red]FAILED'}")
    console.print(f"Done in {time.perf_counter() - t0:.1f} s: " + ("[bold green]all checks passed" if ok_all
                                                               else "[bold red]some checks FAILED"))
    if not ok_all:
        raise typer.Exit(1)
