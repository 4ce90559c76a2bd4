"""`ats predict --out FILE` answers for what made FILE: a rerun with another model or other
settings is refused (by name, non-zero), never "already done" with the old rows; an
interrupted run of one model is never completed by another; --overwrite leaves nothing
of the old run to resume; two writers of one FILE cannot both run; a full disk is one
line and leaves nothing behind."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_predict import make_model, png
from typer.testing import CliRunner

import ats_cli.predict as predict_mod
import ats_cli.predict.cohort as cohort_mod
from ats_cli.cli import app

runner = CliRunner()
N = 6


@pytest.fixture
def cohort(tmp_path: Path):
    """Two models with the same classes and different weights, and a folder of N images."""
    a = make_model(tmp_path / "a.pt", seed=0)
    b = make_model(tmp_path / "b.pt", seed=1)
    images = [png(tmp_path / "slides" / f"s{i:02d}.png", i, size=(64, 64)) for i in range(N)]
    return a, b, tmp_path / "slides", images


def run(*args):
    return runner.invoke(app, ["predict", *map(str, args)])


def refused(result, out: Path) -> bool:
    """Refused the way a user can act on: non-zero, one error line naming the file and the way out."""
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    return (result.exit_code not in (0, 1) and len(lines) == 1 and str(out) in lines[0]
            and "--overwrite" in lines[0] and "another --out" in lines[0] and result.exception is not None
            and isinstance(result.exception, SystemExit))


def reference(folder: Path, model: Path, where: Path, *args) -> str:
    assert run(folder, "-m", model, "--out", where, *args).exit_code == 0
    return where.read_text()


@pytest.mark.parametrize("other", [["--model-b"], ["--seed", "1"], ["--samples", "2"], ["--n-patches", "2"]])
def test_1_a_finished_csv_is_not_reused_for_another_model_or_settings(cohort, tmp_path, other):
    a, b, folder, images = cohort
    out = tmp_path / "p.csv"
    first = run(folder, "-m", a, "--out", out)
    assert first.exit_code == 0, first.output
    before = out.read_text()
    args = ["-m", b] if other == ["--model-b"] else ["-m", a, *other]
    again = run(folder, *args, "--out", out)
    assert refused(again, out), again.output
    assert "already done" not in again.output and out.read_text() == before
    same = run(folder, "-m", a, "--out", out)  # the same command still resumes (nothing left to do)
    assert same.exit_code == 0 and f"{N} of {N} already done" in same.output and out.read_text() == before


def test_naming_the_models_own_settings_is_the_same_run(cohort, tmp_path):
    """The record holds the values in force: the model's n_patches, and the estimator
    prediction uses (auto predicts with threshold), whether named or not."""
    a, b, folder, images = cohort
    out = tmp_path / "p.csv"
    assert run(folder, "-m", a, "--out", out).exit_code == 0
    named = run(folder, "-m", a, "--out", out, "--n-patches", "8", "--estimator", "threshold")
    assert named.exit_code == 0 and f"{N} of {N} already done" in named.output, named.output


def test_1_the_model_is_its_bytes_not_its_path(cohort, tmp_path):
    """A model retrained into the same file is another model."""
    a, b, folder, images = cohort
    out = tmp_path / "p.csv"
    model = tmp_path / "best.pt"
    model.write_bytes(a.read_bytes())
    assert run(folder, "-m", model, "--out", out).exit_code == 0
    model.write_bytes(b.read_bytes())
    assert refused(run(folder, "-m", model, "--out", out), out)


def test_2_an_interrupted_run_is_not_completed_by_another_model(cohort, tmp_path, monkeypatch):
    a, b, folder, images = cohort
    out = tmp_path / "p.csv"
    real = predict_mod.predictor.open_input

    def ctrl_c(path, **kw):
        if Path(path) == images[3]:
            raise KeyboardInterrupt
        return real(path, **kw)

    with monkeypatch.context() as m:
        m.setattr(predict_mod.predictor, "open_input", ctrl_c)
        stopped = run(folder, "-m", a, "--out", out)
    assert stopped.exit_code == 130 and len(out.read_text().splitlines()) == 4, stopped.output
    before = out.read_text()
    other = run(folder, "-m", b, "--out", out)
    assert refused(other, out), other.output
    assert out.read_text() == before  # nothing of b's in a's file
    resumed = run(folder, "-m", a, "--out", out)
    assert resumed.exit_code == 0 and "3 of 6 already done" in resumed.output
    assert out.read_text() == reference(folder, a, tmp_path / "ref-a.csv")


def test_2_a_killed_overwrite_run_leaves_nothing_of_the_old_one_to_resume(cohort, tmp_path, monkeypatch):
    a, b, folder, images = cohort
    out = tmp_path / "p.csv"
    assert run(folder, "-m", a, "--out", out).exit_code == 0
    real = predict_mod.predictor.open_input

    def power_cut(path, **kw):  # kill -9: no merge, no clean-up
        if Path(path) == images[3]:
            raise SystemExit(9)
        return real(path, **kw)

    with monkeypatch.context() as m:
        m.setattr(predict_mod.predictor, "open_input", power_cut)
        assert run(folder, "-m", b, "--out", out, "--overwrite").exit_code == 9
    resumed = run(folder, "-m", b, "--out", out)  # a's finished rows are not b's: only b's 3 are done
    assert resumed.exit_code == 0, resumed.output
    assert "3 of 6 already done" in resumed.output
    assert out.read_text() == reference(folder, b, tmp_path / "ref-b.csv")  # b's rows only
    old_model = run(folder, "-m", a, "--out", out)
    assert refused(old_model, out), old_model.output


def test_a_csv_without_a_record_is_not_resumed(cohort, tmp_path):
    """A CSV that says nothing of what made it (another tool, an older ats) is not counted as done."""
    a, b, folder, images = cohort
    out = tmp_path / "p.csv"
    assert run(folder, "-m", b, "--out", out).exit_code == 0
    Path(f"{out}.ats.json").unlink(missing_ok=True)
    before = out.read_text()
    result = run(folder, "-m", a, "--out", out)
    assert refused(result, out) and out.read_text() == before, result.output
    assert run(folder, "-m", a, "--out", out, "--overwrite").exit_code == 0
    assert out.read_text() == reference(folder, a, tmp_path / "ref-a.csv")


_SLOW_WRITER = """
import sys, time
from pathlib import Path
import ats_cli.predict as package
import ats_cli.predict.inputs as inputs
from ats_cli.cli import app
real, busy, go = inputs.resolve_inputs, Path(sys.argv[1]), Path(sys.argv[1] + ".go")
def slow(*args, **kw):  # the first writer is busy with the inputs until the second has tried
    busy.touch()
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return real(*args, **kw)
inputs.resolve_inputs = package.resolve_inputs = slow
sys.argv = ["ats", "predict", *sys.argv[2:]]
app()
"""


def test_3_two_writers_of_one_out_cannot_both_run(cohort, tmp_path):
    a, b, folder, images = cohort
    out, busy = tmp_path / "p.csv", tmp_path / "busy"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get(
        "PYTHONPATH", "")])}
    first = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(busy), str(folder), "-m", str(a), "--out",
                              str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not busy.exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.1)
        second = run(folder, "-m", b, "--out", out)
        (tmp_path / "busy.go").touch()  # the first writer goes on
        output = first.communicate(timeout=120)[0]
    finally:
        first.kill()
    assert second.exit_code == 2 and "being written by pid" in second.output and str(out) in second.output, \
        second.output
    assert first.returncode == 0, output
    assert out.read_text() == reference(folder, a, tmp_path / "ref-a.csv")  # a's rows, whole


class _FullFile:
    """A file on a full disk: it opens (and exists), but no byte can be written to it."""

    def __init__(self, fh):
        self.fh = fh

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


def _full_disk(monkeypatch, folder: Path, modules, *, pwrite: bool = True) -> None:
    real_open, real_pwrite = open, os.pwrite

    def full_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        inside = isinstance(file, (str, os.PathLike)) and Path(file).resolve().is_relative_to(folder.resolve())
        return _FullFile(fh) if inside and set(mode) & set("wax+") else fh

    def full_pwrite(fd, data, offset):
        if Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(folder.resolve()):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    for module in modules:
        monkeypatch.setattr(module, "open", full_open, raising=False)
    if pwrite:
        monkeypatch.setattr(os, "pwrite", full_pwrite)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_full_disk_is_one_line_and_leaves_nothing_behind(cohort, tmp_path, monkeypatch):
    import ats_cli.io

    a, b, folder, images = cohort
    full = tmp_path / "full"
    full.mkdir()
    _full_disk(monkeypatch, full, [ats_cli.io, cohort_mod])
    result = run(folder, "-m", a, "--out", full / "p.csv")
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert len(errors) == 1 and str(full / "p.csv") in errors[0] and "No space left" in errors[0], result.output
    assert sorted(os.listdir(full)) == []  # no probe, lock, record, temporary or part file


def test_a_full_disk_under_the_part_file_is_one_line(cohort, tmp_path, monkeypatch):
    a, b, folder, images = cohort
    out = tmp_path / "p.csv"
    _full_disk(monkeypatch, tmp_path, [cohort_mod], pwrite=False)  # the part file alone fails
    result = run(folder, "-m", a, "--out", out)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code not in (0, 1) and isinstance(result.exception, SystemExit), result.output
    assert len(errors) == 1 and "p.csv.part-0" in errors[0] and "No space left" in errors[0], result.output
    monkeypatch.undo()
    assert run(folder, "-m", a, "--out", out).exit_code == 0  # space again: the same command finishes
    assert out.read_text() == reference(folder, a, tmp_path / "ref-a.csv")


def test_the_number_of_processes_is_part_of_the_record_only_with_batches():
    """--devices 1 or 2 give the same rows with --batch-size 1 (each batch re-seeds the
    generator with --seed, whatever the rank), so either resumes the other; with larger
    batches the ranks' shares decide which inputs share a batch, so they do not."""
    from ats_cli.predict.provenance import settings

    values = dict(n_patches=4, estimator="threshold", samples=1, batch_size=1, seed=0, device="cpu")
    assert settings("x", values, {}, 1) == settings("x", values, {}, 2)
    batched = {**values, "batch_size": 4}
    assert settings("x", batched, {}, 1) != settings("x", batched, {}, 2)
