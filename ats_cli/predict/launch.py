"""``ats predict --devices N``: check here what can be checked, then run the same command
in N processes through torchrun (:func:`ats_cli.runtime.run_launched`).

The checks made here (the model, ``--out``, an output of another run, a live writer of
``--out``) fail in one line before torchrun starts N processes that would each load the
model only to refuse; rank 0 makes them again, holding ``--out``'s lock, and that check
is the one that counts. Rank 0's exit status comes back through a file
(:data:`STATUS_FILE_ENV`): torchrun reports a worker's non-zero status as a failure with
a page of its own, which "some inputs failed" is not.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ats_cli.predict.session import Request, load_checked, run_record, run_settings, worker_args

__all__ = ["STATUS_FILE_ENV", "launch"]

STATUS_FILE_ENV = "ATS_PREDICT_STATUS_FILE"  # --devices: rank 0 leaves its exit status here, not as torchrun's


def launch(devices: int, req: Request, err: Console) -> int:
    """Run ``req`` in ``devices`` processes; their exit status (rank 0's)."""
    from ats_cli import runtime
    from ats_cli.predict import cohort
    from ats_cli.predict.inputs import resolve_inputs
    from ats_cli.predict.provenance import OutLock
    from ats_cli.runtime import resolve_device

    predictor = load_checked(req, "cpu", err, check_out=True)  # on CPU: the GPUs are the workers'
    if predictor is None:
        return 2
    try:
        runtime.check_devices(devices, req.device)
        with OutLock(str(req.out)):  # a live writer refuses here, before N processes start
            pass
        if not req.overwrite:
            items = resolve_inputs(req.inputs, recursive=req.recursive)
            settings = run_settings(predictor, req, devices, resolve_device(req.device).type)
            cohort.plan(str(req.out), items, predictor.classes, settings,
                        record=run_record(predictor, settings, items))
    except ValueError as e:  # CohortError, RunDirError, too few GPUs
        err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        return 2
    del predictor
    with tempfile.NamedTemporaryFile("w", prefix="ats-predict-", suffix=".status", delete=False) as f:
        status = Path(f.name)
    try:
        rc = runtime.run_launched(runtime.launch_command(devices, worker_args(req), command="predict"),
                                      env={**os.environ, STATUS_FILE_ENV: str(status)})
        text = status.read_text().strip()
        return int(text) if rc == 0 and text.isdigit() else rc
    finally:
        status.unlink(missing_ok=True)
