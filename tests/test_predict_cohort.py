"""`ats predict --out FILE` on a cohort: several processes give the CSV of one, an
interrupted run resumes without redoing finished inputs, a bad file is a failed row that
stops nothing, and an output of another run is refused rather than replaced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_predict import make_model, png
from typer.testing import CliRunner

import ats_cli.predict as predict_mod
import ats_cli.predict.cohort as cohort_mod
from ats_cli.cli import app
from ats_cli.predict.cohort import PART_FORMAT, part_path, part_paths, share

runner = CliRunner()
N = 7


@pytest.fixture
def cohort(tmp_path: Path):
    """A tiny model and a folder of N tiny images plus one that is not an image at all."""
    model = make_model(tmp_path / "model.pt")
    images = [png(tmp_path / "slides" / f"s{i:02d}.png", i, size=(64, 48 + 8 * (i % 3))) for i in range(N)]
    (tmp_path / "slides" / "s03b.png").write_bytes(b"\x89PNG\r\n\x1a\n but not a picture")
    return model, tmp_path / "slides", images


def run(*args):
    return runner.invoke(app, ["predict", *map(str, args)])


@pytest.fixture
def opens(monkeypatch):
    """The paths open_input is called with (the one place a file is read)."""
    seen: list[Path] = []
    real = predict_mod.predictor.open_input

    def counting(path, **kw):
        seen.append(Path(path))
        return real(path, **kw)

    monkeypatch.setattr(predict_mod.predictor, "open_input", counting)
    return seen


def test_devices_2_gives_the_csv_of_devices_1(cohort, tmp_path):
    model, folder, images = cohort
    one = tmp_path / "one.csv"
    result = run(folder, "-m", model, "--out", one)
    assert result.exit_code == 1, result.output  # the bad file
    assert f"{N + 1} images in" in result.output and "images/minute (1 process)" in result.output  # PNGs

    two = tmp_path / "two.csv"
    done = subprocess.run([sys.executable, "-m", "ats_cli", "predict", str(folder), "-m", str(model), "--out",
                           str(two), "--devices", "2", "--device", "cpu"], capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output  # rank 0's status, through --devices: one input failed
    assert two.read_text() == one.read_text()  # same rows, same probabilities, same (input) order
    assert len(two.read_text().splitlines()) == N + 1
    assert "s03b.png" in output and "1 failed" in output
    assert "images/minute (2 processes)" in output and output.count("Predictions") == 1  # rank 0 alone reports
    assert "rank 0: 4 input(s)" in output and "rank 1: 4 input(s)" in output  # round-robin shares of 8
    assert not part_paths(two) and "Traceback" not in output and "terminate called" not in output


def test_an_interrupted_run_resumes_without_redoing_finished_inputs(cohort, tmp_path, monkeypatch, opens):
    model, folder, images = cohort
    reference = tmp_path / "ref.csv"
    assert run(folder, "-m", model, "--out", reference).exit_code == 1

    out = tmp_path / "preds.csv"
    real = predict_mod.predictor.open_input

    def power_cut(path, **kw):  # a crash, not Ctrl-C: no merge, no clean-up
        if Path(path) == images[3]:
            raise SystemExit(9)
        return real(path, **kw)

    with monkeypatch.context() as m:
        m.setattr(predict_mod.predictor, "open_input", power_cut)
        crashed = run(folder, "-m", model, "--out", out)
    assert crashed.exit_code == 9 and not out.exists()
    part = part_path(out, 0)
    lines = part.read_text().splitlines()
    assert json.loads(lines[0])["format"] == PART_FORMAT
    assert [Path(json.loads(x)["path"]) for x in lines[1:]] == images[:3]  # appended as they finished
    with open(part, "a") as fh:  # the crash cut the next line short
        fh.write('{"i": 3, "path": "' + str(images[3]) + '", "label": null, "predic')

    opens.clear()
    result = run(folder, "-m", model, "--out", out)
    assert result.exit_code == 1, result.output
    assert "3 of 8 already done, skipping" in result.output
    assert sorted(opens) == sorted([*images[3:], folder / "s03b.png"])  # not one finished input again
    assert out.read_text() == reference.read_text() and not part.exists()

    opens.clear()  # the failed one is tried again; the finished CSV is kept whole
    again = run(folder, "-m", model, "--out", out)
    assert "7 of 8 already done" in again.output and opens == [folder / "s03b.png"]
    assert out.read_text() == reference.read_text()


def test_parts_of_two_processes_are_resumed_by_one(cohort, tmp_path, monkeypatch, opens):
    """Part files are found whatever number of processes wrote them; the truncated tail of
    the file this rank appends to is cut, so the next record starts on its own line."""
    model, folder, images = cohort
    reference = tmp_path / "ref.csv"
    assert run(folder, "-m", model, "--out", reference).exit_code == 1
    out = tmp_path / "preds.csv"
    csv_rows = reference.read_text().splitlines()[1:]
    settings = _settings_of(model, tmp_path, monkeypatch)
    for rank, idx in ((0, [0, 2]), (1, [1])):
        with open(part_path(out, rank), "w") as fh:
            fh.write(json.dumps({"format": PART_FORMAT, "classes": ["cat", "dog", "eel"], "settings": settings})
                     + "\n")
            for i in idx:
                path, pred, *probs = csv_rows[i].split(",")
                fh.write(json.dumps({"i": i, "path": path, "label": None, "prediction": pred,
                                     "probs": [float(p) for p in probs]}) + "\n")
        if rank == 0:
            with open(part_path(out, rank), "a") as fh:
                fh.write('{"i": 4, "pa')
    opens.clear()
    result = run(folder, "-m", model, "--out", out)
    assert "3 of 8 already done" in result.output, result.output
    assert sorted(opens) == sorted([images[3], *images[4:], folder / "s03b.png"])
    assert out.read_text() == reference.read_text() and not part_paths(out)


def _settings_of(model: Path, tmp_path: Path, monkeypatch) -> dict:
    """The settings record a default run of ``model`` writes, from the part file it leaves
    when the CSV cannot be written (tmp_path/probe/p.csv.part-0, for one image p.png)."""
    img = png(tmp_path / "probe" / "p.png", 99)
    out = tmp_path / "probe" / "p.csv"

    def no_merge(*a, **kw):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(cohort_mod, "merge", no_merge)
        result = run(img, "-m", model, "--out", out)
    assert result.exit_code == 1 and "rerun the same command" in result.output, result.output
    return json.loads(part_path(out, 0).read_text().splitlines()[0])["settings"]


def test_a_corrupt_file_is_a_failed_row_and_the_rest_is_predicted(cohort, tmp_path):
    model, folder, images = cohort
    out = tmp_path / "p.csv"
    result = run(folder, "-m", model, "--out", out)
    assert result.exit_code == 1
    rows = out.read_text().splitlines()
    assert len(rows) == N + 1 and [r.split(",")[0] for r in rows[1:]] == [str(p) for p in images]
    assert "s03b.png" in result.output and "7 predicted, 1 failed" in result.output


def test_an_output_of_another_run_is_refused_not_replaced(cohort, tmp_path):
    model, folder, images = cohort
    out = tmp_path / "p.csv"
    assert run(*images[:3], "-m", model, "--out", out).exit_code == 0
    before = out.read_text()

    # another model (other classes): refused, by name; --overwrite replaces it
    other = make_model(tmp_path / "other.pt", classes=["a", "b"])
    refused = run(*images[:3], "-m", other, "--out", out)
    assert refused.exit_code == 2 and str(out) in refused.output and "--overwrite" in refused.output
    assert out.read_text() == before
    # predictions of files that are not among the inputs: a CSV with fewer rows is never written over it
    fewer = run(images[0], "-m", model, "--out", out)
    assert fewer.exit_code == 2 and "not among these inputs" in fewer.output and out.read_text() == before
    replaced = run(images[0], "-m", other, "--out", out, "--overwrite")
    assert replaced.exit_code == 0 and out.read_text().startswith("path,prediction,prob_a,prob_b\n")
    assert len(out.read_text().splitlines()) == 2


def test_a_part_file_with_other_settings_is_refused(cohort, tmp_path, monkeypatch):
    model, folder, images = cohort
    _settings_of(model, tmp_path, monkeypatch)  # leaves tmp_path/probe/p.csv.part-0
    out, img = tmp_path / "probe" / "p.csv", tmp_path / "probe" / "p.png"
    refused = run(img, "-m", model, "--out", out, "--seed", "1")
    assert refused.exit_code == 2 and "p.csv.part-0" in refused.output and "seed" in refused.output
    assert not out.exists() and part_path(out, 0).exists()
    resumed = run(img, "-m", model, "--out", out)  # the same settings: merged, nothing predicted again
    assert resumed.exit_code == 0 and "1 of 1 already done" in resumed.output
    assert len(out.read_text().splitlines()) == 2 and not part_path(out, 0).exists()


def test_prefetch_does_not_change_the_predictions(cohort, tmp_path):
    model, folder, images = cohort
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    run(folder, "-m", model, "--out", a, "--batch-size", "2")
    run(folder, "-m", model, "--out", b, "--batch-size", "2", "--no-prefetch")
    assert a.read_text() == b.read_text() and len(a.read_text().splitlines()) == N + 1


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shares_are_round_robin_and_cover_every_input_once(world):
    todo = [0, 2, 3, 5, 8, 9, 11]
    shares = [share(todo, r, world) for r in range(world)]
    assert sorted(i for s in shares for i in s) == todo
    assert shares[0][:2] == todo[:world * 2:world]
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
