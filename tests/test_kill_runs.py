"""``kill -9`` of ``ats train`` and ``ats predict``, then the rerun a user would give, ends
with the uninterrupted run's result (issue #67: "kill -9 at random moments of preparation,
training and predict ... is followed by a run that finishes with the same result").

Two kills of each here (the suite's time); the loops of 20 are tests/kill_runs.py's
command line. One kill of each pair lands at any moment, the other after the run has
something to resume from (train: the first epoch's checkpoint; predict: rows in its part
file).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import kill_runs  # noqa: E402


def test_train_killed_twice_then_rerun_learns_what_an_uninterrupted_run_learns(tmp_path):
    results = kill_runs.train_loop(tmp_path, kills=2, seed=0, say=lambda _: None)
    assert [r["same_weights"] and r["same_metrics"] for r in results] == [True, True]
    # the second kill came after the first checkpoint: its rerun was a --resume
    assert results[1]["rerun"] == "--resume", results[1]


def test_predict_killed_twice_then_rerun_writes_the_uninterrupted_csv(tmp_path):
    results = kill_runs.predict_loop(tmp_path, kills=2, seed=0, say=lambda _: None)
    assert [r["same_csv"] for r in results] == [True, True]
    # a rerun predicts only what is missing: nothing after a finished run, else what its part
    # files lack (the second kill is aimed at the appending, but a loaded machine can move it
    # before the first row or past the end)
    for r in results:
        assert r["predicted_on_rerun"] == (0 if "preds.csv" in r["left"] else 30 - r["rows_in_parts"]), r
    assert not any(r["left_after"] != ["preds.csv.ats.json"] for r in results), results  # no part or lock left
