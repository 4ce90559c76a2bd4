"""`ats compare`: each method trained in its own process on the user's dataset, then a
table, compare.csv and compare.png of accuracy against wall time and peak memory; a
method that fails gets its row and the others still run; a rerun skips what finished."""

from __future__ import annotations

import csv
import json
import sys

import pytest
from PIL import Image
from typer.testing import CliRunner

import ats_cli.compare as compare_mod
from ats_cli.cli import app
from tests.test_train import _write_squares_dataset

runner = CliRunner()
# tiny models on 32x32 images: 16x16 patches, an 8x8 view; IPS keeps 2 of the 4 grid patches
TINY = ["--set", "patch_size=16", "--set", "scale=0.25", "--set", "n_patches=2", "--set", "feature_width=8",
        "--set", "workers=0", "--set", "ips_memory=2", "--set", "ips_iter=3"]


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    return _write_squares_dataset(tmp_path_factory.mktemp("squares"), n_train=12, n_test=4, size=32)


def _rows(out):
    with open(out / "compare.csv") as fh:
        return list(csv.DictReader(fh))


def test_two_methods_give_the_table_the_csv_and_the_plot_and_a_rerun_trains_nothing(squares, tmp_path,
                                                                                  monkeypatch):
    """ats really trained (1 epoch, ats train in its own process) and deepmil by the
    stand-in below (a real one would cost the suite seconds more and test nothing more of
    the comparison): a table row each, a CSV row per method per epoch with its cost and
    best.pt's test accuracy, a PNG, each method's own run directory. The same command
    again trains nothing (each says it finished before) and writes the same rows; other
    settings in that --out are refused in one line naming the difference."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE)
    real = compare_mod.train_argv

    def argv(data, run, method, *, train_args=()):
        if method == "ats":
            return real(data, run, method, train_args=train_args)
        return [sys.executable, str(script), str(run), "one-epoch", str(tmp_path / "unused")]

    monkeypatch.setattr(compare_mod, "train_argv", argv)
    out = tmp_path / "cmp"
    args = ["compare", str(squares), "--out", str(out), "--methods", "ats,deepmil", "--epochs", "1",
            "--batch-size", "4", *TINY]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    table = result.output[result.output.index("ats compare |"):]
    assert "ats " in table and "deepmil" in table
    assert table.count("small-cnn (all)") == 2 and "│     4 │" in table  # the encoder and batch each settled
    rows = _rows(out)
    assert [(r["method"], r["epoch"]) for r in rows] == [("ats", "1"), ("deepmil", "1")]
    for r in rows:
        assert float(r["wall_s"]) > 0 and float(r["peak_mb"]) > 0
        assert 0 <= float(r["test_acc"]) <= 1 and r["best_epoch"] == "1" and r["error"] == ""
        history = [json.loads(x) for x in (out / r["method"] / "metrics.jsonl").read_text().splitlines()]
        assert float(r["test_acc"]) == history[0]["test_acc"]  # best.pt's own test figure
    assert (out / "ats" / "best.pt").is_file() and (out / "ats.log").is_file()
    with Image.open(out / "compare.png") as im:
        assert im.format == "PNG" and im.size[0] > 600
    state = json.loads((out / "compare.json").read_text())
    assert {m: s["status"] for m, s in state["methods"].items()} == {"ats": "done", "deepmil": "done"}
    assert float(rows[0]["peak_mb"]) > 100  # ats train: torch loaded

    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert again.output.count("finished before with the same data and settings, not trained again") == 2
    assert "training (log" not in again.output
    assert _rows(out) == rows

    other = runner.invoke(app, [*args[:-len(TINY)], *TINY, "--seed", "3"])
    assert other.exit_code == 2
    lines = [ln for ln in other.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "ats finished in this --out with other settings: seed 0 then, 3 now" in lines[0], \
        other.output
    assert _rows(out) == rows


def test_an_unknown_method_is_refused_in_one_line_and_nothing_is_written(squares, tmp_path):
    out = tmp_path / "cmp"
    result = runner.invoke(app, ["compare", str(squares), "--out", str(out), "--methods", "ats,tile-mill"])
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown method(s) tile-mill" in lines[0] and "ats, uniform, deepmil" in lines[0]
    assert not out.exists()


def test_the_methods_are_what_the_config_allows(monkeypatch):
    """A method added to ats train's allowed values (as tile-mil was) is accepted without a
    change to the comparison."""
    import ats_cli.config as config

    real = config.allowed_values
    assert compare_mod.parse_methods("tile-mil, ats,tile-mil") == ["tile-mil", "ats"]
    with pytest.raises(compare_mod.CompareError, match="unknown method"):
        compare_mod.parse_methods("a-new-method")
    monkeypatch.setattr(config, "allowed_values", lambda: {**real(), "method": (*real()["method"], "a-new-method")})
    assert compare_mod.parse_methods("a-new-method") == ["a-new-method"]


# A stand-in for `ats train` (no torch, a fraction of a second): writes the epochs' records as
# ats train does, then ends as told: "ok" (or "one-epoch"), "fail-once" after the first epoch (the first time),
# "kill" (SIGKILL, as the kernel kills a process out of memory) or "refused" before anything.
FAKE = r"""
import json, os, signal, sys, time
from pathlib import Path
run, how, flag = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
if how == "refused":  # before the old run is moved aside (a lock held, say): its metrics.jsonl stays
    print("error: refused at the start")
    sys.exit(2)
if how == "fail-once" and flag.exists():
    how = "ok"
run.mkdir(parents=True, exist_ok=True)
(run / "metrics.jsonl").unlink(missing_ok=True)  # ats train --overwrite moves an old run aside
(run / "config.json").write_text(json.dumps({"feature_net": "small-cnn", "feature_train": "all", "batch_size": 4}))
for epoch in ((1,) if how == "one-epoch" else (1, 2)):
    rec = {"epoch": epoch, "test_acc": 0.5 + 0.25 * (epoch - 1), "val_acc": 0.5, "device": "cpu",
           "peak_mem_mb": 100.0 + epoch}
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(rec) + "\n")
    time.sleep(0.25)
    if how == "fail-once":
        flag.touch()
        print("settled from the data\nerror: simulated failure in epoch 2", flush=True)
        sys.exit(1)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
print("done")
"""


def test_a_method_that_fails_gets_its_row_the_others_run_and_a_rerun_trains_only_it(squares, tmp_path,
                                                                                 monkeypatch):
    """deepmil fails after its first epoch, ips is killed (SIGKILL): each gets its row
    saying why in one line, ats after them still runs; exit status 1. The rerun skips
    ats (finished), trains deepmil again (now it finishes) with a note, and ips again (now
    refused at its start: its row says so, and its killed run's epoch is not taken for
    the new run's)."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE)
    flag = tmp_path / "failed-once"
    how = {"deepmil": "fail-once", "ips": "kill", "ats": "ok"}
    calls = []

    def fake_argv(data, run, method, *, train_args=()):
        calls.append(method)
        return [sys.executable, str(script), str(run), how[method], str(flag)]

    monkeypatch.setattr(compare_mod, "train_argv", fake_argv)
    out = tmp_path / "cmp"
    args = ["compare", str(squares), "--out", str(out), "--methods", "deepmil,ips,ats", "--epochs", "2", *TINY]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert calls == ["deepmil", "ips", "ats"]
    assert "deepmil: error: simulated failure in epoch 2" in result.output
    assert "ips: killed by SIGKILL (out of memory?)" in result.output
    rows = _rows(out)
    by = [(r["method"], r["epoch"], r["error"]) for r in rows]
    assert by == [("deepmil", "1", ""), ("deepmil", "", "error: simulated failure in epoch 2"),
                  ("ips", "1", ""), ("ips", "", "killed by SIGKILL (out of memory?)"),
                  ("ats", "1", ""), ("ats", "2", "")]
    assert [r["test_acc"] for r in rows if r["method"] == "ats"] == ["0.5", "0.75"]
    # each process's own peak: a Python without torch, tens of MB at most, not this test
    # process's hundreds (ru_maxrss would report those: the kernel keeps them across exec)
    assert all(0 < float(r["peak_mb"]) < 100 for r in rows if r["method"] == "ats"), rows
    assert float(rows[-1]["wall_s"]) > float(rows[-2]["wall_s"]) > 0
    assert (out / "compare.png").is_file()

    how["ips"] = "refused"
    calls.clear()
    again = runner.invoke(app, args)
    assert again.exit_code == 1, again.output
    assert calls == ["deepmil", "ips"]  # ats finished: not run again
    assert "deepmil: training again: its last run failed (error: simulated failure in epoch 2)" in again.output
    assert "ats: finished before with the same data and settings, not trained again" in again.output
    # ips's old run (1 epoch, then killed) is not read as the new one's
    assert [(r["method"], r["epoch"], r["error"]) for r in _rows(out)] == [
        ("deepmil", "1", ""), ("deepmil", "2", ""), ("ips", "", "error: refused at the start"),
        ("ats", "1", ""), ("ats", "2", "")]
